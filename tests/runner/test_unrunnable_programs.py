"""Programs read from disk that cannot run: never saved, and never an engine death.

On XLA:CPU an executable that was deserialized (by jax's persistent cache or by the
executable store) and serialized again lacks kernels: loading that copy fails on its
first run ("Function ... not found (type id: 1)"). The store saves fresh compiles
only, and a stored program that fails its first run is evicted and compiled again;
for a step, whose KV pool was donated to the failed run, every running request
computes its KV again; a sampler runs again on a new token buffer. Same tiny Llama
and engine settings as test_executable_store."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
from test_executable_store import ENGINE, GREEDY, NUM_PROGRAMS, PROMPTS, REPO, first  # noqa: F401

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams

# Prompts long enough that every request decodes through several steps.
MANY = [{"prompt_token_ids": [(7 * i + j) % 300 + 1 for j in range(3 + i % 9)]}
        for i in range(10)]


def many_tokens(llm) -> list[list[int]]:
    outs = llm.generate(MANY, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def break_stored(cache: str, folder: str, name: tuple) -> str:
    """Replace the stored program `name` by a copy that deserialized and serialized
    again (well-formed, right digest, unrunnable); returns its path."""
    llm = LLM(folder, compilation_cache_dir=cache, enforce_eager=True, **ENGINE)
    runner = llm.llm_engine.runner
    program = next(p for p in runner.warm_up_programs() if p.name == name)
    key = runner.store.key(program.name, program.args)
    loaded = runner.store.load(key)
    runner.store.save(key, loaded.compiled, loaded.peak_bytes)
    return runner.store.path(key)


@pytest.mark.parametrize("name", [("step", 4, 4, True), ("sample", 4, "greedy")])
def test_unrunnable_stored_program_is_compiled_again(first, tmp_path, caplog, name):  # noqa: F811
    """A decode step that fails after the prefill steps filled the pool (their KV is
    lost: every request computes it again), or the greedy sampler (run again on a new
    token buffer): the same tokens as a cold start, a warning naming the file, and the
    file rewritten."""
    folder, cache, cold, _ = first
    copy = str(tmp_path / "xla")
    shutil.copytree(cache, copy)
    if name[0] == "sample":
        from jaxllm.runner.sampler import SamplerFlags
        name = ("sample", 4, SamplerFlags(all_greedy=True))
    expected = many_tokens(cold)
    path = break_stored(copy, folder, name)
    with caplog.at_level(logging.WARNING):
        llm = LLM(folder, compilation_cache_dir=copy, **ENGINE)
        assert llm.llm_engine.runner.store.loads == NUM_PROGRAMS
        assert many_tokens(llm) == expected
    failed = [r.getMessage() for r in caplog.records if "failed its first run" in r.getMessage()]
    assert len(failed) == 1 and path in failed[0], failed
    # A step's pool went to the failed run: every request computed its KV again. A
    # sampler's token buffer did too, but the next step reads only the rows the
    # sampler writes: it runs again on a new buffer, nothing recomputed.
    assert (llm.llm_engine.scheduler.num_preemptions_total > 0) == (name[0] == "step")
    again = LLM(folder, compilation_cache_dir=copy, **ENGINE)
    assert again.llm_engine.runner.store.loads == NUM_PROGRAMS
    assert many_tokens(again) == expected


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_unrunnable_bitmask_sampler_under_a_grammar(first, tmp_path, caplog,  # noqa: F811
                                                    async_scheduling):
    """The sampler with a grammar bitmask launches apart from its step: before the next
    step's model (async scheduling) or as the step is read back (without). A copy of
    it that fails its first run is compiled again and runs again on a new token
    buffer there too: the cold start's tokens, nothing recomputed."""
    from jaxllm.runner.sampler import SamplerFlags
    folder, cache, cold, _ = first
    copy = str(tmp_path / "xla")
    shutil.copytree(cache, copy)
    regex = StructuredOutputsParams(regex=r"[a-z ]{5,20}")
    params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=regex)] * 2 + [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 2
    prompts = [{"prompt_token_ids": [5, 9, 2, 7, 1, 3]}] * 4

    def tokens(llm):
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False)]
    expected = tokens(cold)
    path = break_stored(copy, folder, ("sample", 4, SamplerFlags(False, False, 0, True,
                                                                 use_bitmask=True)))
    with caplog.at_level(logging.WARNING):
        llm = LLM(folder, compilation_cache_dir=copy, **ENGINE)
        llm.llm_engine.async_scheduling = async_scheduling
        assert tokens(llm) == expected
    failed = [r.getMessage() for r in caplog.records if "failed its first run" in r.getMessage()]
    assert len(failed) == 1 and path in failed[0], failed
    assert llm.llm_engine.scheduler.num_preemptions_total == 0


CHILD = """
import json, sys
from jaxllm import LLM, SamplingParams, compilation_cache
folder, cache, engine, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), \\
    json.loads(sys.argv[4])
compilation_cache.enable(cache)          # as `jaxllm serve` does: jax's cache on too
llm = LLM(folder, compilation_cache_dir=cache, **engine)
store = llm.llm_engine.runner.store
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                    use_tqdm=False)
print("RESULT " + json.dumps(dict(loads=store.loads, saves=store.saves,
                                  tokens=[list(o.outputs[0].token_ids) for o in outs])))
"""


def test_programs_served_by_jax_cache_are_not_stored(tiny_model, tmp_path, caplog):
    """The root cause: jax's persistent cache holds programs the store does not (here
    the store folder is removed, as a source edit changes every store key). The
    second start gets them from jax's cache and must not save them, or the third
    start loads unrunnable copies and dies on its first step."""
    folder, _ = tiny_model("llama")
    cache = str(tmp_path / "xla")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))

    def start() -> dict:
        proc = subprocess.run([sys.executable, "-c", CHILD, folder, cache, json.dumps(ENGINE),
                               json.dumps(MANY)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.split("RESULT ")[1])

    cold = start()
    assert (cold["loads"], cold["saves"]) == (0, NUM_PROGRAMS)
    shutil.rmtree(os.path.join(cache, "jaxllm-executables"))
    from_jax_cache = start()
    assert from_jax_cache["saves"] == 0 and from_jax_cache["tokens"] == cold["tokens"]
    third = start()
    assert third["tokens"] == cold["tokens"]
