"""Prometheus metrics with vLLM's names under a ``jaxllm:`` prefix, and the stats log.

Engine-wide numbers (running, waiting, KV usage, token and preemption totals, prefix
cache) are read from the latest ``EngineStats`` snapshot at scrape time; the engine
thread refreshes the snapshot after every step. Per-request numbers (latency
histograms, finished requests by reason) are recorded by the engine thread as
outputs come back. Each ``EngineMetrics`` has its own registry, so several servers
can live in one process (tests do).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger("jaxllm.stats")

# vLLM v1's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (EngineStats field, metric name, help). Counters get "_total" in the exposition.
_GAUGES = (
    ("num_running", "num_requests_running", "Requests in the running batch."),
    ("num_waiting", "num_requests_waiting", "Requests waiting (or swapped out)."),
    ("kv_cache_usage", "kv_cache_usage_perc", "KV cache usage: 1 means every block is used."),
    ("num_free_blocks", "kv_cache_free_blocks", "Free KV blocks (cached but unused ones too)."),
    ("num_total_blocks", "kv_cache_total_blocks", "KV blocks in the pool."),
)
_COUNTERS = (
    ("num_preemptions_total", "num_preemptions", "Preemptions of running requests."),
    ("prompt_tokens_total", "prompt_tokens", "Prompt tokens of requests added."),
    ("generation_tokens_total", "generation_tokens", "Tokens generated."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("grammar_mask_seconds", "structured_output_mask_seconds",
     "Seconds computing structured outputs' token masks (off the engine thread)."),
    ("grammar_compile_seconds", "structured_output_compile_seconds",
     "Seconds compiling structured outputs' grammars (off the engine thread)."),
    ("grammars_compiled", "structured_output_grammars_compiled",
     "Structured outputs' grammars compiled (a cached one is not compiled again)."),
)


@dataclass
class _Timing:
    arrival: float
    n: int
    last_token: float | None = None
    num_tokens: int = 0


class EngineMetrics:
    """The metrics of one engine. ``record_*`` and ``update_stats`` run on the
    engine thread; scrapes read on the event loop (prometheus_client is
    thread-safe, and the snapshot is replaced, never mutated)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        self.stats = None
        self._timings: dict[str, _Timing] = {}
        labels = ["model_name"]

        def histogram(name, doc, buckets):
            return Histogram(f"jaxllm:{name}", doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first schedule.",
                                    REQUEST_BUCKETS)
        self.request_success = Counter("jaxllm:request_success", "Finished requests.",
                                       labels + ["finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        self.registry.register(_StatsCollector(self))

    def update_stats(self, stats) -> None:
        self.stats = stats

    def record_arrival(self, request_id: str, arrival_time: float, n: int) -> None:
        self._timings[request_id] = _Timing(arrival_time, n)

    def record_output(self, output, now: float) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens > timing.num_tokens:
            if timing.last_token is None:
                self.ttft.observe(now - timing.arrival)
            else:
                self.itl.observe(now - timing.last_token)
            timing.last_token, timing.num_tokens = now, num_tokens
        if output.finished:
            del self._timings[output.request_id]
            self.e2e.observe(now - timing.arrival)
            scheduled = getattr(output.metrics, "first_scheduled_time", None)
            if scheduled is not None:
                self.queue_time.observe(max(scheduled - timing.arrival, 0.0))
            for completion in output.outputs:
                self.request_success.labels(self.model_name, completion.finish_reason).inc()

    def record_abort(self, request_id: str) -> None:
        timing = self._timings.pop(request_id, None)
        if timing is not None:
            self.request_success.labels(self.model_name, "abort").inc(timing.n)


class _StatsCollector:
    """Exports the latest EngineStats snapshot (zeros before the first one)."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics

    def collect(self):
        stats, model = self.metrics.stats, self.metrics.model_name
        for families, cls in ((_GAUGES, GaugeMetricFamily), (_COUNTERS, CounterMetricFamily)):
            for field, name, doc in families:
                family = cls(f"jaxllm:{name}", doc, labels=["model_name"])
                family.add_metric([model], float(getattr(stats, field, 0)))
                yield family


class StatLogger:
    """Logs one line of engine stats every ``interval`` seconds while there is work
    (and once more when it goes idle), like vLLM's ``LoggingStatLogger``."""

    def __init__(self, metrics: EngineMetrics, interval: float = 5.0):
        self.metrics = metrics
        self.interval = interval
        self._last = (time.monotonic(), 0, 0)
        self._was_idle = True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.log()

    def log(self) -> str | None:
        """Log (and return) the line, or None when idle now and before."""
        stats, now = self.metrics.stats, time.monotonic()
        if stats is None:
            return None
        last_time, last_prompt, last_gen = self._last
        self._last = (now, stats.prompt_tokens_total, stats.generation_tokens_total)
        elapsed = max(now - last_time, 1e-9)
        prompt_tps = (stats.prompt_tokens_total - last_prompt) / elapsed
        gen_tps = (stats.generation_tokens_total - last_gen) / elapsed
        idle = not (prompt_tps or gen_tps or stats.num_running or stats.num_waiting)
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        hit_rate = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
        line = (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
                f"Avg generation throughput: {gen_tps:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%, "
                f"Preemptions: {stats.num_preemptions_total}")
        logger.info(line)
        return line
