"""Host cost of the engine and of the serving path, with a simulated device.

The model runner's launch and read-back are replaced by a fake device that takes
`--device-ms` per step (steps run in order, like a GPU stream) and samples a made-up
token, so what is timed is the host: scheduling, input preparation, sampling
metadata, output building, detokenization, and (with --serve) the HTTP/SSE path of
`jaxllm serve` with a `jaxllm bench serve` client, over the engine in a thread of
the server (AsyncLLM in-process) and/or in a process of its own (AsyncLLM's engine process, the
default of `jaxllm serve`; its engine process gets the same fake device). Runs on
the CPU.

    python scripts/bench_host.py --batch 256 --device-ms 15 --serve
    python scripts/bench_host.py --serve --serve-engine process --skip-offline
"""
from __future__ import annotations

import argparse
import json
import collections
import functools
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))      # bench_structured

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "max_position_embeddings": 2048, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


class FakeDevice:
    """The runner's device launches replaced: the model step (`launch_step`) packs and
    uploads its inputs as the real one does and takes device_ms on a stream that runs
    steps in order, like a GPU's; the sampler (`sample_step`) makes up a token per row,
    for a constrained row one its grammar bitmask allows (chosen at random, as a model
    with dummy weights samples). So everything else of a step runs for real on the
    host: scheduling, input preparation, sampling metadata, the grammar masks, reading
    back, output processing. `fake_s`: this class's own host time (choosing allowed
    tokens), to subtract."""

    def __init__(self, runner, device_ms: float):
        from jaxllm.runner import step_output
        self.runner, self.device_ms = runner, device_ms
        self.read_back = step_output.read_back
        self.free = 0.0
        self.done: collections.deque[float] = collections.deque()
        self.fake_s = 0.0
        self.rng = np.random.default_rng(0)
        runner.launch_step, runner.sample_step = self.launch_step, self.sample_step
        runner.get_output = self.get_output

    def launch_step(self, arrays: dict, decode_only: bool, prompt_targets=None):
        from jaxllm.runner.step_inputs import StepInputs
        StepInputs.pack(arrays, decode_only, None)           # the host-to-device copy
        self.free = max(time.perf_counter(), self.free) + self.device_ms / 1000
        self.done.append(self.free)
        logits = np.empty((len(arrays["seq_lens"]), 0), np.float32)   # only .shape is read
        return logits if prompt_targets is None else (logits, None)

    def sample_step(self, logits, md, flags, bitmask=None):
        import jax
        from jaxllm.runner.sampler import SamplerOutput
        s = logits.shape[0]
        tokens = 300 + np.arange(s, dtype=np.int32) % 500
        if bitmask is not None:
            t0 = time.perf_counter()
            self._allowed_tokens(np.asarray(bitmask), tokens)
            self.fake_s += time.perf_counter() - t0
        k = 20 if flags.num_logprobs else 1
        out = (tokens, np.full(s, -0.5, np.float32), np.zeros((s, k), np.int32),
               np.zeros((s, k), np.float32), np.ones(s, np.int32))
        return SamplerOutput(*(jax.device_put(x) for x in out))

    def _allowed_tokens(self, bitmask: np.ndarray, tokens: np.ndarray) -> None:
        """A random allowed token for each constrained row (one not all ones): a
        random word of the mask among 64 tried, else its first allowed word, then a
        random set bit of it. Vectorized: this stands for device work."""
        rows = np.flatnonzero((bitmask != -1).any(axis=1))
        if not len(rows):
            return
        masks = bitmask[rows].view(np.uint32)
        tried = self.rng.integers(0, masks.shape[1], (len(rows), 64))
        words = np.take_along_axis(masks, tried, 1)
        hit = words != 0
        first = np.argmax(masks != 0, axis=1)
        w = np.where(hit.any(1), tried[np.arange(len(rows)), np.argmax(hit, 1)], first)
        bits = (masks[np.arange(len(rows)), w][:, None] >> np.arange(32, dtype=np.uint32)) & 1
        bit = np.argmax(bits * self.rng.random((len(rows), 32)), axis=1)
        tokens[rows] = 32 * w + bit

    def get_output(self, handle):
        time.sleep(max(0.0, self.done.popleft() - time.perf_counter()))
        return self.read_back(handle)


def fake_device(runner, device_ms: float) -> FakeDevice:
    return FakeDevice(runner, device_ms)


def fake_engine_device(engine, device_ms: float):
    """The engine process's setup hook: the fake device, in the engine process."""
    fake_device(engine.runner, device_ms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--device-ms", type=float, default=15.0)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--serve-engine", choices=("thread", "process", "both"), default="both",
                    help="--serve over the in-thread engine, the engine process, or both")
    ap.add_argument("--skip-offline", action="store_true", help="only the --serve part")
    ap.add_argument("--kinds", default="FINAL_ONLY,CUMULATIVE",
                    help="the offline runs' output kinds, comma-separated")
    ap.add_argument("--structured", type=float, default=0.0, metavar="FRACTION",
                    help="this fraction of the requests (spread evenly) with a JSON schema")
    ap.add_argument("--phases", action="store_true",
                    help="time the host phases of a step (per step, over the offline runs)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile the offline runs; print the top N functions by own time")
    args = ap.parse_args()
    from jaxllm import LLM
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(TINY, f)
    llm = LLM(folder, load_format="dummy", dtype="float32", max_model_len=2048,
              max_num_seqs=args.batch, max_num_batched_tokens=4096, enforce_eager=True,
              num_gpu_blocks_override=20000)
    engine = llm.llm_engine
    device = fake_device(engine.runner, args.device_ms)
    use_real_vocabulary(engine, bool(args.structured))
    phases = time_phases(engine) if args.phases else None
    if not args.skip_offline:
        offline(engine, device, args, phases)
    if not args.serve:
        return
    from jaxllm.engine.async_llm import AsyncLLM
    if args.serve_engine in ("thread", "both"):
        serve(lambda: AsyncLLM.from_engine(engine), engine.config, folder, args, "engine thread")
    if args.serve_engine in ("process", "both"):
        setup = functools.partial(fake_engine_device, device_ms=args.device_ms)
        serve(lambda: AsyncLLM.from_config(engine.config, multiprocess=True, setup=setup),
              engine.config, folder,
              args, "engine process")


def use_real_vocabulary(engine, structured: bool) -> None:
    """Detokenize (and with `structured`, compute grammar masks) over a real byte-level
    BPE vocabulary, the default model's (SmolLM2's 49k, Llama 3's kind), masks as wide
    as the model's. The dummy folder's placeholder tokenizer decodes ~4x slower than
    a BPE one and has no byte-level tokens for JSON."""
    from jaxllm.structured_output.backend_guidance import make_tokenizer
    from jaxllm.tokenizer import get_tokenizer
    tok = get_tokenizer(None)
    engine.output_processor.tokenizer = tok
    if structured:
        som = engine.engine_core.structured_output_manager
        som.set_tokenizer(make_tokenizer(tok, engine.arch.vocab_size, engine.eos_token_id))


def request_params(args, kind) -> list:
    """Each request's SamplingParams: plain (greedy, ignore_eos), or for every
    1/structured-th a JSON schema longer than output_len."""
    from jaxllm import SamplingParams
    from jaxllm.sampling_params import StructuredOutputsParams
    from bench_structured import SCHEMA      # at least 24 records: longer than output_len
    plain = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                           output_kind=kind)
    constrained = SamplingParams(temperature=0, max_tokens=args.output_len, output_kind=kind,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    f = args.structured
    return [constrained if int((i + 1) * f) > int(i * f) else plain
            for i in range(args.requests)]


PHASES = (("scheduler", "schedule"), ("scheduler", "update_from_output"),
          ("runner", "prepare_inputs"), ("runner", "_sampling_metadata"),
          ("runner", "launch_step"), ("runner", "sample_step"), ("runner", "get_output"),
          ("output_processor", "process_outputs"), ("structured", "constrained_rows"),
          ("structured", "start_bitmask"), ("structured", "bitmask"),
          ("structured", "accept_tokens"))


def time_phases(engine) -> dict[str, float]:
    """Wrap the step's phases (PHASES) with timers of the engine thread's CPU time
    (steadier than wall time on a busy host); phase -> seconds so far. A phase's
    time includes the phases it calls."""
    owners = {"scheduler": engine.scheduler, "runner": engine.runner,
              "output_processor": engine.output_processor,
              "structured": engine.engine_core.structured_output_manager}
    seconds: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.thread_time() - t0
        return wrapper
    for owner, method in PHASES:
        obj = owners[owner]
        if hasattr(obj, method):
            setattr(obj, method, timed(method, getattr(obj, method)))
    return seconds


def gc_timer() -> list[float]:
    """[seconds spent in Python's garbage collector from now on]."""
    import gc
    total, start = [0.0], [0.0]

    def callback(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            total[0] += time.perf_counter() - start[0]
    gc.callbacks.append(callback)
    return total


def offline(engine, device: FakeDevice, args, phases: dict | None = None) -> None:
    """LLMEngine.step until done, per output kind: ms per step (mean, and the median
    step, which at --requests 2 x --batch is a step of --batch decoding rows)."""
    import cProfile
    import pstats
    from jaxllm.sampling_params import RequestOutputKind
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 1000, args.prompt_len).tolist()}
               for _ in range(args.requests)]
    profile = cProfile.Profile() if args.profile else None
    gc_s = gc_timer()
    for name in args.kinds.split(","):
        kind = RequestOutputKind[name]
        fake0, gc0, times = device.fake_s, gc_s[0], []
        cpu0 = time.thread_time()
        if phases is not None:
            phases.clear()
        t0 = time.perf_counter()
        for i, (p, params) in enumerate(zip(prompts, request_params(args, kind))):
            engine.add_request(f"{kind.name}-{i}", p, params)
        if profile:
            profile.enable()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        if profile:
            profile.disable()
        t = time.perf_counter() - t0 - (device.fake_s - fake0)
        cpu = time.thread_time() - cpu0 - (device.fake_s - fake0)
        print(f"offline, {kind.name} outputs"
              f"{f', {args.structured:g} structured' if args.structured else ''}: "
              f"{t:.2f} s, {1000 * t / len(times):.2f} ms per step, median step "
              f"{1000 * float(np.median(times)):.2f} ms, engine thread CPU "
              f"{1000 * cpu / len(times):.2f} ms per step ({len(times)} steps; the device alone: "
              f"{args.device_ms} ms; the fake's own "
              f"{1000 * (device.fake_s - fake0) / len(times):.2f}"
              f" ms per step left out of the mean), "
              f"{args.requests * args.output_len / t:.0f} out tok/s", flush=True)
        if phases is not None:
            phases["python gc"] = gc_s[0] - gc0
            print("  ms per step: " + ", ".join(f"{k} {1000 * v / len(times):.2f}"
                                               for k, v in phases.items()), flush=True)
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


def serve(make_engine, config, folder, args, label: str):
    from jaxllm.entrypoints.openai.api_server import build_app
    async_engine = make_engine()
    process = getattr(async_engine, "process", None)
    try:
        before = cpu_seconds(process)
        _serve(build_app(async_engine, config), folder, args, label)
        used = [b - a for a, b in zip(before, cpu_seconds(process))]
        print(f"CPU seconds: server process {used[0]:.1f}"
              + (" (engine thread included)" if process is None else
                 f", engine process {used[1]:.1f}") + f", client {used[2]:.1f}")
    finally:
        async_engine.shutdown()


def cpu_seconds(process) -> tuple[float, float, float]:
    """CPU time (user + system) of this process, of the engine process (if any),
    and of the waited-for children (the benchmark client)."""
    import resource
    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    engine = 0.0
    if process is not None:
        with open(f"/proc/{process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        engine = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own.ru_utime + own.ru_stime, engine, children.ru_utime + children.ru_stime


def _serve(app, folder, args, label: str):
    from jaxllm.entrypoints.openai.api_server import serve_in_background
    with serve_in_background(app) as url:
        port = url.rstrip("/").rsplit(":", 1)[1]
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "jaxllm.entrypoints.cli", "bench", "serve", "--port", port,
             "--tokenizer", folder, "--num-prompts", str(args.requests), "--input-len", "64",
             "--output-len", str(args.output_len), "--ignore-eos", "--disable-tqdm"],
            capture_output=True, text=True)
        t = time.perf_counter() - t0
    keep = ("Benchmark duration", "Output token throughput", "Mean TPOT")
    print(f"serve, {label} (client in another process), wall {t:.1f} s")
    print("\n".join(line for line in out.stdout.splitlines() if line.startswith(keep)))
    if out.returncode:
        print(out.stderr[-800:])


if __name__ == "__main__":
    main()
