"""`jaxllm serve` launched from a config file as its own process, on the tiny random
Llama of tests/conftest.py (127.0.0.1, a free port), and `jaxllm bench serve`
driving it."""
import functools
import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from serve_process import follow_stderr, wait_for_url

from jaxllm.entrypoints.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER_YAML = """\
max_model_len: 128
max_num_seqs: 8
max_num_batched_tokens: 64
num_gpu_blocks_override: 64
enforce_eager: true          # buckets compile when first used: a quick start
served_model_name: [tiny]
compilation_cache_dir: null
"""


@pytest.fixture(scope="module")
def live_server(tiny_model, tmp_path_factory):
    folder, _ = tiny_model("llama")
    config = tmp_path_factory.mktemp("serve") / "server.yaml"
    config.write_text(SERVER_YAML)
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", folder,
           "--config", str(config), "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        url = wait_for_url(proc, follow_stderr(proc), [], deadline=time.monotonic() + 300)
        yield url, folder
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_answers_with_the_config_files_settings(live_server):
    url, _ = live_server
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "x " * 200, "max_tokens": 2}).json()
    assert "128" in reply["error"]["message"]          # max_model_len from the file


def bench(capsys, *argv):
    assert main(["bench", "serve", "--disable-tqdm", *argv]) == 0
    return capsys.readouterr().out


def test_bench_serve_all_at_once(live_server, capsys):
    url, folder = live_server
    out = bench(capsys, "--base-url", url, "--tokenizer", folder, "--num-prompts", "6",
                "--input-len", "12", "--output-len", "5", "--ignore-eos",
                "--metric-percentiles", "50,99")
    assert re.search(r"^=+ Serving Benchmark Result =+$", out, re.M), out
    assert re.search(r"^Successful requests:\s+6\s*$", out, re.M)
    assert re.search(r"^Total input tokens:\s+72\s*$", out, re.M)     # exact lengths
    assert re.search(r"^Total generated tokens:\s+30\s*$", out, re.M)  # ignore_eos
    for field in ("Benchmark duration (s)", "Request throughput (req/s)",
                  "Output token throughput (tok/s)", "Total Token throughput (tok/s)"):
        assert re.search(rf"^{re.escape(field)}:\s+[\d.]+", out, re.M), field
    for name in ("TTFT", "TPOT", "ITL", "E2EL"):
        for stat in ("Mean", "Median", "P50", "P99"):
            assert re.search(rf"^{stat} {name} \(ms\):\s+[\d.]+", out, re.M), (stat, name)
    assert "Request rate configured" not in out        # inf: no rate line, as in vLLM


def test_bench_serve_poisson_rate_concurrency_and_saved_result(live_server, capsys, tmp_path):
    url, folder = live_server
    out = bench(capsys, "--base-url", url, "--tokenizer", folder, "--num-prompts", "5",
                "--input-len", "10", "--output-len", "4", "--range-ratio", "0.5",
                "--request-rate", "50", "--max-concurrency", "2", "--model", "tiny",
                "--save-result", "--result-dir", str(tmp_path),
                "--result-filename", "r.json")
    assert re.search(r"^Maximum request concurrency:\s+2\s*$", out, re.M), out
    assert re.search(r"^Request rate configured \(RPS\):\s+50.00", out, re.M)
    assert re.search(r"^Successful requests:\s+5\s*$", out, re.M)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["completed"] == 5 and data["model_id"] == "tiny"
    assert data["request_rate"] == 50 and data["max_concurrency"] == 2
    assert len(data["ttfts"]) == 5 and all(t > 0 for t in data["ttfts"])
    assert all(5 <= n <= 15 for n in data["input_lens"])
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert data[key] >= 0


def test_bench_serve_without_a_server_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert "cannot list the server's models" in err and "jaxllm serve" in err


def test_bench_client_reads_errors_and_streams_like_httpx(live_server):
    """The benchmark's asyncio HTTP client against httpx on the same requests: an
    error status with a sized JSON body, and a chunked SSE stream, line for line."""
    import asyncio
    from jaxllm.benchmarks import serve
    url, _ = live_server
    bad = json.dumps({"model": "nope", "prompt": "hi", "max_tokens": 2}).encode()
    good = json.dumps({"model": json.loads(httpx.get(url + "/v1/models").text)["data"][0]["id"],
                       "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()

    async def fetch(stream, body):
        async with stream(url + "/v1/completions", body, {}) as (status, lines):
            return status, [line async for line in lines]

    async def both():
        async with httpx.AsyncClient() as client:
            via_httpx = functools.partial(serve._httpx_stream, client)
            return [(await fetch(serve._raw_stream, b), await fetch(via_httpx, b))
                    for b in (bad, good)]
    (raw_bad, httpx_bad), (raw_good, httpx_good) = asyncio.run(both())
    assert raw_bad[0] == httpx_bad[0] == 404 and "nope" in "".join(raw_bad[1])
    assert raw_good[0] == 200

    def events(lines):   # the chunks' text, ids and timestamps aside
        out = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
        return [c["choices"][0]["text"] for c in out]
    # Chunks may coalesce differently (a slow reader gets them merged): the text agrees.
    assert events(raw_good[1]) and "".join(events(raw_good[1])) == "".join(events(httpx_good[1]))
    assert raw_good[1][-2:] == ["data: [DONE]", ""]
