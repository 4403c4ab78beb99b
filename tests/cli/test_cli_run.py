"""The commands run end to end on the default model, each as its own process, all on
one compile cache: `generate` starts cold and fills it; `chat`, `bench throughput` and
`bench latency` are later starts of the same engine settings and must compile nothing
(JAX's own cache-hit log says so). Small buckets keep the compile work small."""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Two bucket shapes (decode 4, tokens 16); longer prompts are prefilled in chunks.
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "16"]
TIMEOUT = 600


def jaxllm(*argv, cache, stdin=None, jax_log=False):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if jax_log:   # JAX's compiler logger at DEBUG: one line per cache hit or miss
        env.update(JAX_LOGGING_LEVEL="WARNING", JAX_DEBUG_LOG_MODULES="jax._src.compiler")
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli", *argv, *ENGINE,
           "--compilation-cache-dir", cache]
    out = subprocess.run(cmd, cwd=REPO, input=stdin, capture_output=True, text=True,
                         env=env, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def cache_counts(stderr: str) -> tuple[int, int]:
    hits, compiled = re.search(r"compilation cache .*: (\d+) hits, (\d+) compiled",
                               stderr).groups()
    return int(hits), int(compiled)


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """The first start: `jaxllm generate` over a JSONL prompts file, cache empty."""
    tmp = tmp_path_factory.mktemp("cli-run")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text('{"prompt": "The capital of France is"}\n'
                       '{"prompt_token_ids": [1, 504, 3458, 282]}\n"Hello"\n')
    out_path = tmp / "out.jsonl"
    cache = str(tmp / "xla")
    run = jaxllm("generate", "--prompts-file", str(prompts), "--output", str(out_path),
                 "--max-tokens", "4", "--temperature", "0", cache=cache)
    return cache, run, out_path


def test_generate_writes_json_lines(warm_cache):
    _, run, out_path = warm_cache
    records = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert records[0]["prompt"] == "The capital of France is"
    assert records[1]["prompt"] is None and records[1]["num_prompt_tokens"] == 4
    for r in records:
        (completion,) = r["outputs"]
        assert len(completion["token_ids"]) <= 4 and completion["finish_reason"]
        assert isinstance(completion["text"], str)
    assert "Paris" in records[0]["outputs"][0]["text"]      # greedy, the real model
    assert "Processed prompts" in run.stderr                 # the tqdm progress bar
    hits, compiled = cache_counts(run.stderr)
    assert compiled > 0


def test_chat_second_start_skips_compilation(warm_cache):
    cache, _, _ = warm_cache
    run = jaxllm("chat", "--max-tokens", "4", "--temperature", "0", "--system",
                 "You are terse.", cache=cache, stdin="What is the capital of France?\n"
                 "/reset\nHi\n/exit\nnever read\n", jax_log=True)
    assert run.stdout.strip()                                # the replies
    assert "Persistent compilation cache hit" in run.stderr
    assert "PERSISTENT COMPILATION CACHE MISS" not in run.stderr
    hits, compiled = cache_counts(run.stderr)
    assert hits > 0 and compiled == 0


# Both benchmarks in one process (one model load): `main` runs twice with the LLM of
# the first run reused, as the engine settings are the same.
BENCH_SCRIPT = """
import functools, sys
from jaxllm.entrypoints import cli
cli.make_llm = functools.lru_cache(cli.make_llm)
argv, split = sys.argv[1:], sys.argv.index("--then") - 1
cli.main(argv[:split])
print("-- then --", flush=True)
cli.main(argv[split + 1:])
"""


def test_bench_throughput_and_latency_print_vllm_fields(warm_cache, tmp_path):
    cache, _, _ = warm_cache
    common = [*ENGINE, "--compilation-cache-dir", cache]
    argv = ["bench", "throughput", "--num-prompts", "4", "--input-len", "16",
            "--output-len", "4", "--range-ratio", "0.5", "--output-json",
            str(tmp_path / "t.json"), *common, "--then",
            "bench", "latency", "--batch-size", "2", "--input-len", "8", "--output-len", "4",
            "--num-iters-warmup", "1", "--num-iters", "2", "--output-json",
            str(tmp_path / "l.json"), *common]
    run = subprocess.run([sys.executable, "-c", BENCH_SCRIPT, *argv], cwd=REPO,
                         capture_output=True, text=True, timeout=TIMEOUT,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-3000:]
    throughput, latency = run.stdout.split("-- then --")

    assert re.search(r"^Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, "
                     r"[\d.]+ output tokens/s$", throughput, re.M), throughput
    assert re.search(r"^Total num prompt tokens:\s+\d+$", throughput, re.M)
    assert re.search(r"^Total num output tokens:\s+\d+$", throughput, re.M)
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["num_requests"] == 4
    assert data["total_num_output_tokens"] >= 4 * 2          # ignore_eos, lengths 2..6

    assert re.search(r"^Avg latency: [\d.e-]+ seconds$", latency, re.M), latency
    for p in (10, 25, 50, 75, 90, 99):
        assert re.search(rf"^{p}% percentile latency: [\d.e-]+ seconds$", latency, re.M)
    data = json.loads((tmp_path / "l.json").read_text())
    assert len(data["latencies"]) == 2 and set(data["percentiles"]) == {
        "10", "25", "50", "75", "90", "99"}
    assert cache_counts(run.stderr)[1] == 0                  # a warm start
