"""A mixed load on a running server, of the kinds users send at once: plain and
streamed completions, n=2 sampled, stop strings, logprobs, chat completions, and
streaming clients that leave after 3 chunks. Counts answers by (kind, status); a
stream that ends with an error event counts as "error event".

    python -m jaxllm.benchmarks.mixed_load http://127.0.0.1:8000 --num 2000 --concurrency 32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys

import httpx

WORDS = "the quick brown fox jumps over a lazy dog paris france sea waves hello".split()
KINDS = ("plain", "stream", "n2", "stop", "logprobs", "chat", "disconnect")
# Prompt lengths in words: short ones and some long enough to fill large token buckets.
PROMPT_WORDS = (1, 3, 12, 40, 60)


def request(kind: str, model: str, rng: random.Random) -> tuple[str, dict]:
    """(path, JSON body) of one request of `kind`."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice(PROMPT_WORDS)))
    body = {"model": model, "max_tokens": rng.randint(1, 16), "prompt": prompt}
    if kind == "chat":
        del body["prompt"]
        return "/v1/chat/completions", {**body, "temperature": rng.choice((0, 0.7)),
                                        "messages": [{"role": "user", "content": prompt}]}
    body.update({"plain": {"temperature": 0}, "stream": {"stream": True},
                 "disconnect": {"stream": True, "max_tokens": 16},
                 "n2": {"n": 2, "temperature": 0.9}, "stop": {"stop": ["the", "sea"]},
                 "logprobs": {"logprobs": 3, "temperature": 0.8}}[kind])
    return "/v1/completions", body


async def _send(client: httpx.AsyncClient, url: str, kind: str, path: str, body: dict):
    if not body.get("stream"):
        return (await client.post(url + path, json=body)).status_code
    async with client.stream("POST", url + path, json=body) as r:
        chunks = 0
        async for line in r.aiter_lines():
            chunks += line.startswith("data: ")
            if kind == "disconnect" and chunks == 3:
                break
            if '"error"' in line:
                return "error event"
        return r.status_code


async def mixed_load(url: str, model: str, num: int, concurrency: int,
                     seed: int = 0) -> dict:
    """(kind, status) -> count over `num` requests, kinds in turn, `concurrency` at a
    time. A transport error counts under its exception's name."""
    rng, counts = random.Random(seed), {}
    sem = asyncio.Semaphore(concurrency)

    async def one(client, i):
        kind = KINDS[i % len(KINDS)]
        path, body = request(kind, model, rng)
        async with sem:
            try:
                status = await _send(client, url, kind, path, body)
            except httpx.HTTPError as e:
                status = type(e).__name__
        counts[(kind, status)] = counts.get((kind, status), 0) + 1

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, i) for i in range(num)))
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--num", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    url = args.url.rstrip("/")
    model = args.model or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    counts = asyncio.run(mixed_load(url, model, args.num, args.concurrency, args.seed))
    failed = sum(v for (_, status), v in counts.items() if status != 200)
    print(json.dumps({"requests": args.num, "failed": failed,
                      "by_kind": {f"{k} {s}": v for (k, s), v in sorted(
                          counts.items(), key=str)}}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
