"""The executable store (a restart loads every compiled step instead of tracing it) and
the KV pool sized from the compiled largest step, on a tiny 2-layer Llama (CPU).

Engine settings: 2 step shapes (decode 4, tokens 16) and 6 sampler variants."""
from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import threading

import jax
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import CacheConfig, ConfigError
from jaxllm.models.registry import ArchConfig
from jaxllm.parallel import mesh as mesh_lib
from jaxllm.runner import compilation, executable_store, kv_cache, model_runner
from jaxllm.runner.model_runner import ModelRunner

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              cpu_kv_cache_bytes=1 << 20)
NUM_PROGRAMS = 2 + 10      # steps, then the sampler variants (8 plain, 2 with a grammar bitmask)
PROMPTS = [{"prompt_token_ids": ids} for ids in ([5, 9, 2, 7, 1, 3], [17, 3, 8], [40] * 20)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def store_files(cache: str) -> list[str]:
    folder = os.path.join(cache, executable_store.FOLDER)
    return sorted(os.path.join(folder, f) for f in os.listdir(folder))


@pytest.fixture(scope="module")
def first(tiny_model, tmp_path_factory):
    """A cold start on an empty cache folder: (folder, cache, llm, greedy tokens)."""
    folder, _ = tiny_model("llama")
    cache = str(tmp_path_factory.mktemp("store") / "xla")
    llm = LLM(folder, compilation_cache_dir=cache, **ENGINE)
    runner = llm.llm_engine.runner
    assert runner.store.saves == NUM_PROGRAMS and runner.store.loads == 0
    assert len(store_files(cache)) == NUM_PROGRAMS
    return folder, cache, llm, generate(llm)


@pytest.fixture
def count_traces(monkeypatch):
    """Python calls of the step and sampler functions: each is one trace."""
    calls = []

    def spy(fn):
        def traced(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return traced

    monkeypatch.setattr(model_runner, "_forward", spy(model_runner._forward))
    monkeypatch.setattr(model_runner, "_sample_into", spy(model_runner._sample_into))
    return calls


def test_restart_loads_every_program_and_traces_nothing(first, count_traces):
    folder, cache, llm1, tokens = first
    llm = LLM(folder, compilation_cache_dir=cache, **ENGINE)
    runner = llm.llm_engine.runner
    assert runner.store.loads == NUM_PROGRAMS and runner.store.saves == 0
    assert count_traces == []
    pool = runner.kv_caches
    assert generate(llm) == tokens
    assert count_traces == []                       # every step ran a loaded program
    # Donation as in the jit: the pool passed in is gone, and the loaded programs donate
    # and place their outputs exactly as the freshly compiled ones.
    assert all(k.is_deleted() and v.is_deleted() for k, v in pool)
    fresh = llm1.llm_engine.runner.compilation.programs
    assert runner.compilation.programs.keys() == fresh.keys()
    for name, compiled in runner.compilation.programs.items():
        assert compiled.donate_argnums == fresh[name].donate_argnums, name
        assert str(compiled.output_shardings) == str(fresh[name].output_shardings), name
    steps = [c for name, c in runner.compilation.programs.items() if name[0] == "step"]
    samplers = [c for name, c in runner.compilation.programs.items() if name[0] == "sample"]
    num_pool_leaves = 2 * runner.arch.num_layers
    # The pool and the logits buffer; the sampler's token buffer (step_fn.LogitsBuffers).
    assert steps and all(len(c.donate_argnums) == num_pool_leaves + 1 for c in steps)
    assert samplers and all(len(c.donate_argnums) == 1 for c in samplers)


def test_folder_kept_under_its_cap_least_recently_used_first(first, tmp_path):
    """Files of other configurations (older) go first, oldest first, until the folder
    fits jax's cache cap; the files this start loaded are kept and marked used."""
    folder, cache, _, tokens = first
    copy = str(tmp_path / "xla")
    shutil.copytree(cache, copy)
    ours = store_files(copy)
    old = os.path.getmtime(ours[0]) - 1000
    for path in ours:
        os.utime(path, (old, old))
    stale = [os.path.join(copy, executable_store.FOLDER, f"stale{i}.bin") for i in range(3)]
    for i, path in enumerate(stale):
        with open(path, "wb") as f:
            f.write(b"x" * 1000)
        os.utime(path, (old - 100 + i, old - 100 + i))    # stale0 the least recent
    cap = sum(os.path.getsize(p) for p in ours) + 1000      # room for one stale file
    saved = jax.config.jax_compilation_cache_max_size
    jax.config.update("jax_compilation_cache_max_size", cap)
    try:
        llm = LLM(folder, compilation_cache_dir=copy, **ENGINE)
    finally:
        jax.config.update("jax_compilation_cache_max_size", saved)
    assert llm.llm_engine.runner.store.loads == NUM_PROGRAMS
    assert store_files(copy) == sorted(ours + stale[2:])
    assert all(os.path.getmtime(p) > old + 500 for p in ours)
    assert generate(llm) == tokens


def test_cap_zero_turns_the_store_off(first):
    folder, cache, _, _ = first
    saved = jax.config.jax_compilation_cache_max_size
    jax.config.update("jax_compilation_cache_max_size", 0)
    try:
        assert executable_store.max_bytes() == 0
        llm = LLM(folder, compilation_cache_dir=cache, enforce_eager=True, **ENGINE)
    finally:
        jax.config.update("jax_compilation_cache_max_size", saved)
    assert llm.llm_engine.runner.store is None
    assert executable_store.max_bytes() == executable_store.DEFAULT_MAX_BYTES


def warm_up_keys(folder: str, cache: str, **overrides) -> set[str]:
    """The store keys of an engine's warm-up programs (enforce_eager: nothing compiled)."""
    llm = LLM(folder, compilation_cache_dir=cache, enforce_eager=True,
              **{**ENGINE, **overrides})
    runner = llm.llm_engine.runner
    return {runner.store.key(p.name, p.args) for p in runner.warm_up_programs()}


def test_what_changes_the_program_changes_the_key(first, monkeypatch):
    folder, cache, _, _ = first
    stored = {os.path.basename(p)[:-4] for p in store_files(cache)}
    assert warm_up_keys(folder, cache) == stored             # deterministic across starts
    changed = [warm_up_keys(folder, cache, max_num_seqs=2),
               warm_up_keys(folder, cache, block_size=8),
               warm_up_keys(folder, cache, kv_cache_dtype="fp8")]
    for switch, value in (("JAXLLM_INT8_ROTATE_KERNEL", "0"), ("JAXLLM_INT4_MOSAIC", "1")):
        monkeypatch.setenv(switch, value)                   # switches read while tracing
        changed.append(warm_up_keys(folder, cache))
        monkeypatch.delenv(switch)
    monkeypatch.setattr(executable_store, "source_hash", lambda: "edited")
    changed.append(warm_up_keys(folder, cache))
    for keys in changed:
        assert keys and not keys & stored                   # all misses: compiled again


def test_quantization_scheme_is_in_the_key(first, monkeypatch):
    """Online int8 with and without its rotation: the same weight shapes and dtypes, but
    a program that rotates its inputs must not serve weights that were not rotated."""
    folder, cache, _, _ = first
    rotated = warm_up_keys(folder, cache, quantization="int8")
    monkeypatch.setenv("JAXLLM_INT8_ROTATION", "0")
    plain = warm_up_keys(folder, cache, quantization="int8")
    assert rotated and plain and not rotated & plain


def test_corrupt_entries_are_ignored_and_compiled_again(first, tmp_path, caplog):
    folder, cache, _, tokens = first
    copy = str(tmp_path / "xla")
    shutil.copytree(cache, copy)
    flipped, garbage = store_files(copy)[:2]
    with open(flipped, "r+b") as f:             # a damaged byte: fails the digest
        f.seek(os.path.getsize(flipped) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    # A well-formed file whose executable XLA cannot parse.
    payload = pickle.dumps((b"not an executable", jax.tree.structure(((0,), {})),
                            jax.tree.structure(0), None))
    with open(garbage, "wb") as f:
        f.write(executable_store._MAGIC + executable_store.hashlib.sha256(payload)
                .hexdigest().encode() + b"\n" + payload)
    with caplog.at_level(logging.WARNING, logger="jaxllm.runner.executable_store"):
        llm = LLM(folder, compilation_cache_dir=copy, **ENGINE)
    ignored = [r for r in caplog.records if "ignoring" in r.getMessage()]
    assert sorted(r.getMessage().split()[3] for r in ignored) == [flipped, garbage]
    runner = llm.llm_engine.runner
    assert runner.store.loads == NUM_PROGRAMS - 2 and runner.store.saves == 2
    assert generate(llm) == tokens
    # Rewritten: the next start loads all of them.
    assert LLM(folder, compilation_cache_dir=copy, **ENGINE).llm_engine.runner.store.loads \
        == NUM_PROGRAMS


# ------------------------------------------------------------------- KV pool sizing
LLAMA_8B = ArchConfig("LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
GIB = 1 << 30


def fit(limit, weights, temp, bound, **cache):
    """fit_to_device for Llama-3.1-8B shapes with a fake compiled step whose
    temporaries are `temp` bytes; returns (report, pool sizes compiled)."""
    compiled = []
    per_block = kv_cache.bytes_per_block(LLAMA_8B, 16, "bfloat16")

    def step_peak(num_blocks):
        compiled.append(num_blocks)
        return weights + num_blocks * per_block + temp + (64 << 20)    # + logits out

    report = kv_cache.fit_to_device(LLAMA_8B, CacheConfig(block_size=16, **cache), "bfloat16",
                                    2048, weights, limit, bound, step_peak)
    return report, compiled


def fits(report, limit, weights, temp, utilization=0.9):
    used = weights + report.num_blocks * report.per_block + temp + (64 << 20)
    return used + kv_cache.HEADROOM <= int(limit * utilization)


def test_pool_fits_the_first_guess_when_the_bound_holds():
    limit, weights = 104 * GIB, 15 * GIB
    bound = kv_cache.activation_bound(LLAMA_8B, 8192, 256, "bfloat16")
    report, compiled = fit(limit, weights, int(1.35 * GIB), bound)
    assert compiled == [report.num_blocks]                  # one compile, no shrinking
    assert fits(report, limit, weights, int(1.35 * GIB))
    assert report.num_blocks == kv_cache.stable_block_count(report.num_blocks)
    exact = (int(limit * 0.9) - weights - bound - kv_cache.HEADROOM) // report.per_block
    assert exact * 31 // 32 <= report.num_blocks <= exact
    # The same numbers give the same pool (restarts find their programs).
    assert fit(limit, weights, int(1.35 * GIB), bound)[0] == report


def test_pool_shrinks_when_the_step_needs_more_than_the_bound():
    limit, weights, temp = 104 * GIB, 15 * GIB, 6 * GIB
    report, compiled = fit(limit, weights, temp, bound=GIB)
    assert len(compiled) == 2 and compiled[1] < compiled[0]
    assert report.num_blocks == compiled[1] == kv_cache.stable_block_count(compiled[1])
    assert fits(report, limit, weights, temp)
    assert report.activations == temp + (64 << 20)


def test_too_little_memory_names_the_numbers_and_the_knob():
    with pytest.raises(ConfigError, match=r"cannot hold one sequence of max_model_len=2048 "
                                          r".*raise --gpu-memory-utilization"):
        fit(17 * GIB, 15 * GIB, GIB, GIB)


def test_bound_covers_the_compiled_temporaries(first):
    """The analytical bound is above what XLA allocates for the tiny model's step."""
    _, _, llm, _ = first
    runner = llm.llm_engine.runner
    mem = runner.compilation.programs[("step", 16, 4, False)].memory_analysis()
    assert runner.spec.backend == "reference"
    bound = kv_cache.activation_bound(runner.arch, 16, 4, runner.model_dtype,
                                      gather_block_size=runner.block_size)
    assert mem.temp_size_in_bytes <= bound <= 4 * mem.temp_size_in_bytes


def test_gpu_sizing_path_with_a_fakedevice_limit(first, tmp_path, monkeypatch):
    """The GPU's sizing on this CPU: the largest step compiles once for the pool it
    checks, is kept for dispatch, and a restart loads it."""
    folder, _, _, tokens = first
    limit = 300 << 20            # 270 MiB usable: 256 MiB headroom, ~1 MiB weights
    monkeypatch.setattr(ModelRunner, "device_limit", lambda self: limit)
    cache = str(tmp_path / "xla")
    engine = dict(ENGINE, compilation_cache_dir=cache, enforce_eager=True)
    llm = LLM(folder, **engine)
    runner = llm.llm_engine.runner
    assert runner.store.saves == 1 and list(runner.compilation.programs) == [("step", 16, 4, False)]
    peak = runner.store.load(runner.store.key(*_largest(runner))).peak_bytes
    pool = kv_cache.device_bytes(runner.kv_caches)
    assert runner.num_blocks > 1000 and peak > pool    # the compiled peak holds the pool
    assert peak + kv_cache.HEADROOM <= int(limit * 0.9)
    assert generate(llm) == tokens
    again = LLM(folder, **engine).llm_engine.runner
    assert again.num_blocks == runner.num_blocks
    assert again.store.loads == 1 and again.store.saves == 0
    # num_gpu_blocks_override: no sizing compile.
    forced = LLM(folder, num_gpu_blocks_override=20, **engine).llm_engine.runner
    assert forced.num_blocks == 20 and forced.store.saves == 0 and forced.compilation.programs == {}
    # A bound below the step's temporaries: the first pool does not fit, the second does.
    monkeypatch.setattr(kv_cache, "activation_bound", lambda *args, **kwargs: 0)
    shrunk = LLM(folder, **dict(engine, compilation_cache_dir=str(tmp_path / "xla2")))
    runner = shrunk.llm_engine.runner
    assert runner.store.saves == 2 and runner.num_blocks <= again.num_blocks
    peak = runner.store.load(runner.store.key(*_largest(runner))).peak_bytes
    assert peak + kv_cache.HEADROOM <= int(limit * 0.9)
    assert generate(shrunk) == tokens


def test_gpu_sizing_queues_the_warm_up(first, tmp_path, monkeypatch, count_traces):
    """Without enforce_eager the KV sizing lowers every warm-up program for the pool it
    plans and queues their compiles beside its own; warm_up only collects them, and
    they run on the allocated pool (a call the program rejected would fall back to
    the jit, which traces). A restart loads them all. When the planned pool does not
    fit, that queue is stale: dropped, and every program compiles for the pool that does."""
    folder, _, _, tokens = first
    monkeypatch.setattr(ModelRunner, "device_limit", lambda self: 300 << 20)
    queued, warm_up = [], ModelRunner.warm_up

    def spy(self):
        queued.append(set(self.compilation.queue._futures))
        return warm_up(self)

    monkeypatch.setattr(ModelRunner, "warm_up", spy)
    for shrink in (False, True):
        if shrink:
            monkeypatch.setattr(kv_cache, "activation_bound", lambda *args, **kwargs: 0)
        cache = str(tmp_path / f"xla{shrink}")
        llm = LLM(folder, compilation_cache_dir=cache, **ENGINE)
        runner = llm.llm_engine.runner
        programs = runner.compilation.programs
        assert len(programs) == NUM_PROGRAMS and queued[-1] == set(programs)
        # Shrinking: the stale queue's compiles already running still finish and save,
        # and the sampler's (which take no pool) are loaded by the second queue.
        if not shrink:
            assert (runner.store.loads, runner.store.saves) == (0, NUM_PROGRAMS)
        count_traces.clear()
        assert generate(llm) == tokens and count_traces == []
        if not shrink:
            again = LLM(folder, compilation_cache_dir=cache, **ENGINE).llm_engine.runner
            assert (again.store.loads, again.store.saves) == (NUM_PROGRAMS, 0)
            assert again.num_blocks == runner.num_blocks


def test_compiles_start_while_later_programs_lower():
    """A program's compile is handed to the pool as soon as it is lowered, not once
    every program is: here the second program's lowering waits for the first compile."""
    started = threading.Event()
    waited = []

    class Jitted:
        def __init__(self, wait):
            self.wait = wait

        def trace(self):
            if self.wait:
                waited.append(started.wait(timeout=30))
            return self

        def lower(self):
            return self

        def compile(self):
            started.set()
            return Compiled()

    class Compiled:
        def memory_analysis(self):
            return None

    programs = [compilation.Program(("p", i), (), Jitted(i > 0), ()) for i in range(2)]
    queue = compilation.CompileQueue(None, compile_workers=2)
    queue.submit(programs)
    out = queue.results()
    assert waited == [True] and set(out) == {("p", 0), ("p", 1)}


def _largest(runner):
    """(name, args) of the KV sizing's program: the largest step on an abstract pool."""
    dtype = kv_cache.cache_dtype(runner.config.cache, runner.model_dtype)
    pool = kv_cache.abstract(runner.arch, runner.num_blocks, runner.block_size, dtype,
                             mesh_lib.kv_cache_sharding(runner.mesh))
    program = runner._step_program(16, 4, False, pool)
    return program.name, program.args


# ------------------------------------------------------------------- tensor parallel
TP_CHILD = """
import json, sys
from jaxllm import LLM, SamplingParams
folder, cache, engine, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), \\
    json.loads(sys.argv[4])
runs = []
for _ in range(2):
    llm = LLM(folder, compilation_cache_dir=cache, tensor_parallel_size=2, **engine)
    store = llm.llm_engine.runner.store
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    runs.append(dict(loads=store.loads, saves=store.saves,
                     tokens=[list(o.outputs[0].token_ids) for o in outs]))
print("RESULT " + json.dumps(runs))
"""


def test_tensor_parallel_restart_loads_from_the_store(first, tmp_path):
    """TP = 2 on 2 of 8 host devices: a sharded step saved, loaded, and the same tokens."""
    folder, _, _, tokens = first
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", TP_CHILD, folder, str(tmp_path / "xla"),
                           json.dumps(ENGINE), json.dumps(PROMPTS)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cold, warm = json.loads(proc.stdout.split("RESULT ")[1])
    assert (cold["saves"], cold["loads"]) == (NUM_PROGRAMS, 0)
    assert (warm["saves"], warm["loads"]) == (0, NUM_PROGRAMS)
    assert cold["tokens"] == warm["tokens"] == tokens
