"""`jaxllm bench serve`: streamed completions against a running server, arriving as a
Poisson process (or all at once), reported as `vllm bench serve` reports them: TTFT,
TPOT, ITL and E2EL mean / median / percentiles.

Prompts are random token ids sent as token-id prompts, so their lengths are exact.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime

from jaxllm.benchmarks.datasets import (BenchRequest, add_dataset_arguments,
                                        check_dataset_arguments, sample_requests)

METRICS = (("ttft", "TTFT", "Time to First Token"),
           ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"),
           ("e2el", "E2EL", "End-to-end Latency"))


def add_arguments(p) -> None:
    p.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000 "
                                      "(default: from --host and --port)")
    p.add_argument("--host", default="127.0.0.1", help="server host (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="server port (default: 8000)")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="completions route (default: /v1/completions)")
    p.add_argument("--model", help="model name to request (default: the server's first)")
    p.add_argument("--tokenizer", help="model folder or .gguf whose vocabulary the random "
                                       "prompts draw from (default: the embedded model)")
    p.add_argument("--api-key", help="Bearer token, if the server wants one")
    add_dataset_arguments(p, num_prompts=200)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf = all at once (default)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps; 1 = Poisson (default: 1)")
    p.add_argument("--max-concurrency", type=int,
                   help="at most this many requests in flight (default: no limit)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly --output-len tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    p.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles to report (default: 99)")
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-dir", default=".", help="folder for --save-result (default: .)")
    p.add_argument("--result-filename", help="file name for --save-result "
                                             "(default: jaxllm-<rate>qps-<date>.json)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def check_arguments(args) -> None:
    from jaxllm.config import ConfigError
    check_dataset_arguments(args)
    if args.request_rate <= 0:
        raise ConfigError(f"request_rate={args.request_rate}: must be > 0 (inf = all at once)")
    if args.burstiness <= 0:
        raise ConfigError(f"burstiness={args.burstiness}: must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"max_concurrency={args.max_concurrency}: must be >= 1")
    try:
        args.percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        args.percentiles = None
    if not args.percentiles or not all(0 < p < 100 for p in args.percentiles):
        raise ConfigError(f"metric_percentiles={args.metric_percentiles!r}: give numbers "
                          "in (0, 100) separated by commas, e.g. 50,90,99")


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str = ""


def run(args) -> int:
    from jaxllm.models.info import read_model_arch
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or _first_model(base, headers)
    vocab_path = args.tokenizer or (args.model if args.model and os.path.exists(args.model)
                                    else None)
    vocab_size = read_model_arch(vocab_path)[0].vocab_size
    requests = sample_requests(args.dataset_name, args.num_prompts, args.input_len,
                               args.output_len, args.range_ratio, vocab_size, args.seed)
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    results, duration = asyncio.run(_benchmark(args, base + args.endpoint, model, headers,
                                               requests))
    metrics = calculate_metrics(results, duration, args.percentiles)
    print_metrics(metrics, args)
    if args.save_result:
        _save(args, model, metrics, results)
    if not metrics["completed"]:
        print(f"all requests failed; first error: {results[0].error}", file=sys.stderr)
        return 1
    return 0


def _first_model(base: str, headers: dict) -> str:
    import httpx
    from jaxllm.config import ConfigError
    try:
        resp = httpx.get(base + "/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"base_url={base!r}: cannot list the server's models ({e}); "
                          "is `jaxllm serve` running there?") from None


async def _arrivals(requests: list[BenchRequest], rate: float, burstiness: float, seed: int):
    import numpy as np
    rng = np.random.default_rng(seed + 1)
    for i, request in enumerate(requests):
        if i and rate != float("inf"):
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))
        yield request


async def _benchmark(args, url, model, headers, requests):
    from tqdm import tqdm
    bar = tqdm(total=len(requests), disable=args.disable_tqdm, file=sys.stderr)
    limit = (asyncio.Semaphore(args.max_concurrency) if args.max_concurrency
             else contextlib.nullcontext())
    async with contextlib.AsyncExitStack() as stack:
        # Plain HTTP goes through asyncio's streams: httpx costs more per request and
        # per SSE line than a 1000-stream burst leaves a one-process client (vLLM's
        # client uses aiohttp for the same reason); https through httpx.
        stream = _raw_stream
        if not url.startswith("http://"):
            import httpx
            client = await stack.enter_async_context(httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=30.0),
                limits=httpx.Limits(max_connections=None)))
            stream = functools.partial(_httpx_stream, client)

        async def one(request):
            async with limit:
                result = await _send(stream, url, model, headers, request, args.ignore_eos)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(r))
                 async for r in _arrivals(requests, args.request_rate, args.burstiness, args.seed)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


async def _send(stream, url, model, headers, request: BenchRequest, ignore_eos: bool):
    payload = {"model": model, "prompt": request.prompt_token_ids, "max_tokens":
               request.output_len, "temperature": 0.0, "ignore_eos": ignore_eos,
               "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(request.prompt_token_ids))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with stream(url, json.dumps(payload).encode(), headers) as (status, lines):
            if status != 200:
                body = "".join([line async for line in lines])
                result.error = f"HTTP {status}: {body[:200]}"
                return result
            async for line in lines:
                data = line[len("data:"):].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    result.text += chunk["choices"][0].get("text") or ""
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
        result.output_tokens = result.output_tokens or chunks
        result.latency, result.success = last - start, chunks > 0
        if not chunks:
            result.error = "the stream held no tokens"
    except Exception as e:  # noqa: BLE001 - connection, protocol or JSON errors
        result.error = f"{type(e).__name__}: {e}"
    return result


@contextlib.asynccontextmanager
async def _httpx_stream(client, url: str, body: bytes, headers: dict):
    """(status, the response's lines) of a POST, through httpx."""
    headers = {"Content-Type": "application/json", **headers}
    async with client.stream("POST", url, content=body, headers=headers) as resp:
        yield resp.status_code, resp.aiter_lines()


@contextlib.asynccontextmanager
async def _raw_stream(url: str, body: bytes, headers: dict):
    """(status, the response's lines) of a POST over a connection of its own, with
    asyncio's streams: HTTP/1.1, a chunked or sized body."""
    parts = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(parts.hostname, parts.port or 80, limit=1 << 22), 30.0)
    try:
        head = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {parts.netloc}",
                "Content-Type: application/json", f"Content-Length: {len(body)}",
                "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        chunked, length = False, None
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            key, value = key.strip().lower(), value.strip()
            if key == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif key == "content-length":
                length = int(value)
        yield status, _lines(_body(reader, chunked, length))
    finally:
        writer.close()


async def _body(reader, chunked: bool, length: int | None):
    if not chunked:
        yield await (reader.readexactly(length) if length is not None else reader.read())
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)      # the CRLF after each chunk


async def _lines(chunks):
    rest = b""
    async for data in chunks:
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if rest:
        yield rest.decode()


def calculate_metrics(results: list[RequestResult], duration: float,
                      percentiles: list[float]) -> dict:
    import numpy as np
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    m = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for key, vals in values.items():
        ms = np.array(vals or [0.0]) * 1000
        m[f"mean_{key}_ms"], m[f"median_{key}_ms"] = float(ms.mean()), float(np.median(ms))
        m[f"std_{key}_ms"] = float(ms.std())
        for p in percentiles:
            m[f"p{_p_word(p)}_{key}_ms"] = float(np.percentile(ms, p))
    m["percentiles"] = list(percentiles)
    return m


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def print_metrics(m: dict, args) -> None:
    row = "{:<40} {:<10}".format
    num = "{:<40} {:<10.2f}".format
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(row("Successful requests:", m["completed"]))
    print(row("Failed requests:", m["failed"]))
    if args.max_concurrency is not None:
        print(row("Maximum request concurrency:", args.max_concurrency))
    if args.request_rate != float("inf"):
        print(num("Request rate configured (RPS):", args.request_rate))
    print(num("Benchmark duration (s):", m["duration"]))
    print(row("Total input tokens:", m["total_input_tokens"]))
    print(row("Total generated tokens:", m["total_output_tokens"]))
    print(num("Request throughput (req/s):", m["request_throughput"]))
    print(num("Output token throughput (tok/s):", m["output_throughput"]))
    print(num("Total Token throughput (tok/s):", m["total_token_throughput"]))
    for key, name, header in METRICS:
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print(num(f"Mean {name} (ms):", m[f"mean_{key}_ms"]))
        print(num(f"Median {name} (ms):", m[f"median_{key}_ms"]))
        for p in m["percentiles"]:
            print(num(f"P{_p_word(p)} {name} (ms):", m[f"p{_p_word(p)}_{key}_ms"]))
    print("=" * 50)


def _save(args, model: str, metrics: dict, results: list[RequestResult]) -> None:
    now = datetime.now()
    result = {
        "date": now.strftime("%Y%m%d-%H%M%S"), "backend": "jaxllm", "model_id": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
    }
    name = args.result_filename or f"jaxllm-{args.request_rate}qps-{result['date']}.json"
    os.makedirs(args.result_dir, exist_ok=True)
    path = os.path.join(args.result_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"results written to {path}")
