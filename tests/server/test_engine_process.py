"""The server over an AsyncLLM with the engine in its own process (`jaxllm serve`'s
default): the same outputs and errors as over the in-thread AsyncLLM (the
session's `async_engine`, same settings), aborts reaching the engine process, its
death answered with 503, and `jaxllm serve` itself (start-up failure, no jax backend
in the server process, no process left behind).

One engine process serves the module (spawning one costs ~10 s here); the test that
kills it comes last. Its steps take 4 ms more than they would, so that a request of
240 tokens is still running when a test acts on it mid-stream."""
from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import queue
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from serve_process import follow_stderr, wait_for_url
from server_helpers import MODEL, metric, sse_events, wait_until_idle

from jaxllm.engine.async_llm import AsyncLLM, EngineDeadError
from jaxllm.engine.core_client import _remote_error
from jaxllm.engine.output_wire import OutputDecoder
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 240,
        "ignore_eos": True, "temperature": 0, "stream": True}


def slow_steps(engine) -> None:
    """AsyncLLM.from_config's setup hook, run in the engine process."""
    step = engine.step_deltas

    def slow_step():
        time.sleep(0.004)
        return step()
    engine.step_deltas = slow_step


@pytest.fixture(scope="module")
def mp_engine(server_config):
    engine = AsyncLLM.from_config(server_config, multiprocess=True, setup=slow_steps)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def mp_url(mp_engine, server_config):
    from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
    with serve_in_background(build_app(mp_engine, server_config, log_stats_interval=0.5)) as url:
        yield url


def collect(engine, request_id: str, prompt, params) -> list[RequestOutput]:
    async def run():
        return [out async for out in engine.generate(request_id, prompt, params)]
    return asyncio.run(run())


def test_decoder_forgets_and_remote_errors_carry_the_traceback():
    dec = OutputDecoder()
    metrics = (None, ("m",))
    first = ("r", ("p", [1], None), [(0, "ab", [5, 6], None, None, None, None)], False, 0,
             metrics)
    assert dec.decode(first).outputs[0].text == "ab"
    dec.forget("r")
    late = ("r", None, [(2, "c", [7], None, None, None, None)], False, 0, metrics)
    assert dec.decode(late) is None                # no header: forgotten (aborted) here
    error = _remote_error(None, "Traceback ...\nKeyError: 'x'\n")
    assert "KeyError: 'x'" in str(error) and "Traceback" in str(error.__cause__)


def test_text_prompts_are_tokenized_in_the_server_process(mp_engine):
    """The writer thread encodes a chunk's text prompts as one batch: the same ids as
    the engine's tokenizer.encode, one by one; other commands pass unchanged."""
    params = SamplingParams(max_tokens=3)
    texts = ["hello world", "  déjà vu — 東京\n", "x" * 3000]
    kept = [("add", "k1", [5, 6], params, 1.0), ("abort", "k2"),
            ("add", "k3", {"prompt_token_ids": [5]}, params, 1.0)]
    commands = [("add", f"r{i}", t if i != 1 else {"prompt": t}, params, 1.0)
                for i, t in enumerate(texts)] + kept
    out = mp_engine.engine_core._tokenized(commands)
    encode = mp_engine.engine.tokenizer.encode
    assert [c[2] for c in out[:3]] == [{"prompt": t, "prompt_token_ids": encode(t)}
                                       for t in texts]
    assert all(a is b for a, b in zip(out[3:], kept))
    assert out[0][:2] == ("add", "r0") and out[0][3:] == (params, 1.0)
    assert mp_engine.engine_core._tokenized(kept) is kept


def test_engine_outputs_equal_in_thread_engine(mp_engine, async_engine):
    # Every request to the session's engine has a seed: one without draws from the
    # engine's generator, which later tests sampling without a seed depend on.
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, seed=0)
    text = collect(async_engine, "probe", "paris france", greedy)[-1].outputs[0].text
    cases = [
        ("hello world", SamplingParams(temperature=0, max_tokens=12, logprobs=3,
                                       prompt_logprobs=2, seed=0)),
        ([5, 17, 42, 99, 3], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10,
                                            logprobs=1)),
        ("paris france", SamplingParams(temperature=0, max_tokens=24, stop=[text[6:9]],
                                        seed=0)),
    ]
    for i, (prompt, params) in enumerate(cases):
        want = collect(async_engine, f"case-{i}", prompt, params)[-1]
        got = collect(mp_engine, f"case-{i}", prompt, params)
        final = got[-1]
        assert dataclasses.replace(final, metrics=None) == \
            dataclasses.replace(want, metrics=None), i
        assert final.metrics.finished_time >= final.metrics.arrival_time
        assert [o.finished for o in got] == [False] * (len(got) - 1) + [True]
        for out in got:   # cumulative: each output is a prefix of the last
            for c, last in zip(out.outputs, final.outputs):
                assert last.token_ids[:len(c.token_ids)] == c.token_ids
                assert last.text.startswith(c.text)
    assert final.outputs[0].finish_reason == "stop"     # the stop-string case


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_server_answers_as_in_thread_server(mp_url, server_url, stream):
    requests = [("/v1/completions", {"model": MODEL, "prompt": "hello world",
                                     "max_tokens": 10, "temperature": 0, "ignore_eos": True}),
                ("/v1/chat/completions", {"model": MODEL, "max_tokens": 10, "temperature": 0,
                                          "messages": [{"role": "user", "content": "hi"}]})]
    for path, body in requests:
        body = {**body, "stream": stream, "seed": 0}   # see above
        if stream:
            body["stream_options"] = {"include_usage": True}
        answers = [_answer(httpx.post(f"{url}{path}", json=body, timeout=120), stream)
                   for url in (server_url, mp_url)]
        assert answers[0] == answers[1] and answers[0][0], path


def _answer(response: httpx.Response, stream: bool) -> tuple:
    """(text, finish reason, usage) of a response, streamed or whole."""
    assert response.status_code == 200, response.text
    if not stream:
        body = response.json()
        choice = body["choices"][0]
        return (choice.get("text") or choice["message"]["content"], choice["finish_reason"],
                body["usage"])
    text, finish, usage = "", None, None
    for event in sse_events(response):
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            finish = choice["finish_reason"] or finish
    return text, finish, usage


def test_too_long_prompt_same_400(mp_url, server_url):
    body = {"model": MODEL, "prompt": " ".join(["hello world"] * 200), "max_tokens": 2}
    for stream in (False, True):
        answers = [httpx.post(f"{url}/v1/completions", json={**body, "stream": stream},
                              timeout=60) for url in (server_url, mp_url)]
        assert [a.status_code for a in answers] == [400, 400]
        assert answers[0].json() == answers[1].json()
        assert answers[1].json()["error"]["code"] == "context_length_exceeded"


def wait_until_freed(engine: AsyncLLM, timeout: float = 30) -> None:
    """Until the engine process's stats show no request and every KV block free."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.metrics.stats
        if (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_total_blocks):
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


def test_client_disconnect_frees_request_in_engine_process(mp_engine, mp_url):
    aborted = metric(mp_url, "vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", f"{mp_url}/v1/completions", json=LONG, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if '"text":"' in line)
        assert mp_engine.metrics.stats.num_running == 1
    wait_until_freed(mp_engine)   # the disconnect aborted it in the engine process
    m = wait_until_idle(mp_url)
    assert m["jaxllm:kv_cache_free_blocks"][()] == m["jaxllm:kv_cache_total_blocks"][()]
    assert metric(mp_url, "vllm:request_success_total", finished_reason="abort") == \
        aborted + 1


def test_closing_the_generator_frees_request_in_engine_process(mp_engine):
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)

    async def run():
        gen = mp_engine.generate("close-me", "hello", params)
        first = await anext(gen)
        await gen.aclose()
        return first

    assert not asyncio.run(run()).finished
    wait_until_freed(mp_engine)
    assert not mp_engine.engine_core._decoder._state   # the engine process acknowledged the abort
    with pytest.raises(ValueError, match="maximum context length"):   # as in-thread
        collect(mp_engine, "too-long", "hello " * 300, params)
    assert collect(mp_engine, "close-me", "hello", SamplingParams(max_tokens=2))[-1].finished


def test_idle_engine_process_and_threads_sleep(mp_engine):
    """Nothing to do: the engine process and the server's reader and writer threads
    block (on the pipes, a condition variable) rather than poll."""
    stats = [f"/proc/{mp_engine.process.pid}/stat"] + [
        f"/proc/self/task/{t.native_id}/stat"
        for t in (mp_engine.engine_core._reader, mp_engine.engine_core._writer)]
    before = [_cpu_seconds(path) for path in stats]
    time.sleep(0.5)
    used = [_cpu_seconds(path) - b for path, b in zip(stats, before)]
    assert max(used) < 0.05, used


def _cpu_seconds(stat_path: str) -> float:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_killed_engine_process_gives_503(mp_engine, mp_url):
    """Last: kills the module's engine process."""
    with httpx.stream("POST", f"{mp_url}/v1/completions", json=LONG, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if '"text":"' in line)
        os.kill(mp_engine.process.pid, signal.SIGKILL)
        events = [line for line in lines if line]
    assert "engine_dead" in events[-2] and events[-1] == "data: [DONE]"
    assert mp_engine.is_dead and "signal 9" in str(mp_engine.dead_error)
    for method, path, body in [("GET", "/health", None), ("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {**LONG, "stream": False}),
                               ("POST", "/v1/chat/completions",
                                {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})]:
        r = httpx.request(method, f"{mp_url}{path}", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", path
    with pytest.raises(EngineDeadError):
        collect(mp_engine, "after", "hello", SamplingParams(max_tokens=2))
    assert httpx.get(f"{mp_url}/metrics").status_code == 200
    mp_engine.shutdown()
    assert not mp_engine.process.is_alive()
    assert mp_engine.process not in multiprocessing.active_children()


# ---------------------------------------------------------------- `jaxllm serve`

# `jaxllm serve` as its own process, reporting at exit whether it started a jax backend.
SERVE = """\
import atexit, sys
def report():
    bridge = sys.modules.get("jax._src.xla_bridge")
    backends = sorted(bridge._backends) if bridge else "jax not imported"
    print(f"server process jax backends: {backends}", file=sys.stderr, flush=True)
atexit.register(report)
from jaxllm.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""
NO_BACKEND = re.compile(r"server process jax backends: (\[\]|jax not imported)")


def serve_cmd(folder: str, *flags: str) -> list[str]:
    return [sys.executable, "-c", SERVE, "serve", folder, "--port", "0", "--max-model-len",
            "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
            "--num-gpu-blocks-override", "32", "--enforce-eager", "--compilation-cache-dir",
            "none", "--served-model-name", MODEL, *flags]


def serve_env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)   # one CPU device
    return env


def test_serve_engine_start_failure_exits_with_its_message(tiny_model):
    """An error in the engine process (here: more devices asked for than present,
    which only a jax backend can tell) ends `jaxllm serve` with that error."""
    folder, _ = tiny_model("llama")
    out = subprocess.run(serve_cmd(folder, "--tensor-parallel-size", "2"), cwd=REPO,
                         capture_output=True, text=True, env=serve_env(), timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "jaxllm serve: error: tensor_parallel_size=2 asks for 2 devices but 1 is present" \
        in out.stderr
    assert NO_BACKEND.search(out.stderr), out.stderr[-3000:]


def test_serve_runs_engine_in_own_process_and_stops_it(tiny_model):
    folder, _ = tiny_model("llama")
    proc = subprocess.Popen(serve_cmd(folder), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=serve_env(),
                            start_new_session=True)
    log: list[str] = []
    lines = follow_stderr(proc)
    try:
        url = wait_for_url(proc, lines, log, deadline=time.monotonic() + 300)
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == MODEL
        children = _children(proc.pid)
        engines = [pid for pid in children if "spawn_main" in _cmdline(pid)]
        assert len(engines) == 1, {pid: _cmdline(pid) for pid in children}
        # Ctrl-C reaches the whole group: the engine process ignores it, uvicorn
        # stops, then run_server stops the engine process.
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) in (0, 130)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while [pid for pid in children if _running(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _running(pid)]
    while True:
        try:
            log.append(lines.get(timeout=5))
        except queue.Empty:
            break
    text = "".join(log)
    assert NO_BACKEND.search(text), text[-3000:]
    # The model checks before the spawn import no jax either (it would delay the spawn).
    assert "server process jax backends: jax not imported" in text, text[-3000:]
    assert "engine process" not in text, text[-3000:]   # no warning, no death report
    # The start-up timeline: the engine process's phases, then the server's.
    assert re.search(r"engine core ready [\d.]+ s after its spawn \(spawn_s [\d.]+, "
                     r"imports_s [\d.]+, launch_s [\d.]+, engine_s [\d.]+", text), text[-3000:]
    assert re.search(r"server ready in [\d.]+ s \(launch_s [\d.]+, imports_s [\d.]+, "
                     r"engine_wait_s [\d.]+, ready_message_s [\d.]+, app_s [\d.]+, "
                     r"uvicorn_s [\d.]+\)", text), text[-3000:]


def _children(pid: int) -> list[int]:
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            pids.append(int(name))
    return pids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
