"""Prometheus metrics under vLLM's names, types, labels and buckets, and the stats log.

The series are vLLM v1's (``vllm/v1/metrics/loggers.py``): the same ``vllm:`` names,
types, label names (``model_name``, ``engine``; ``finished_reason`` on
``vllm:request_success_total``) and bucket boundaries, so vLLM's Grafana dashboard,
alerts and ``curl .../metrics | grep vllm`` work unchanged. ``engine`` is always "0":
one engine core per server.

- Engine-wide state (running, waiting, KV usage, preemptions, prefix-cache queries and
  hits) is read from the latest ``EngineStats`` snapshot at scrape time; the engine's
  thread refreshes the snapshot after every step.
- Per-request numbers are recorded from the outputs as they come back, as vLLM's
  front end does: prompt and generation token counters, tokens per step
  (``vllm:iteration_tokens_total``), TTFT (arrival to first token, on the server's
  clock), inter-token latency (between the engine's step times of a completion's
  tokens), and at a completion's finish: e2e, queue (arrival to first scheduled),
  prefill (first scheduled to first token), decode (first to last token), inference
  (first scheduled to last token), time per output token, token counts, max_tokens,
  and ``vllm:request_success_total`` by reason. A request of ``n`` samples counts as
  ``n`` requests, as vLLM's child requests do, except ``vllm:request_params_n`` and
  ``vllm:request_max_num_generation_tokens``, once per request. The engine-side
  times come from ``RequestOutput.metrics`` (``RequestMetrics``); they are the
  request's, shared by its samples.

- Speculative decoding, with a ``speculative_config`` only (as vLLM): the counters
  ``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens``
  and ``_num_accepted_tokens_per_pos`` (label ``position``, 0..k-1), read from the
  snapshot's ``spec_decoding`` (a copy of ``EngineCore.spec_stats``, attached by
  ``core_proc.engine_stats``), and vLLM's "SpecDecoding metrics" log line.

Not exported: ``vllm:time_per_output_token_seconds`` (vLLM deprecated it for
``vllm:inter_token_latency_seconds`` and hides it by default; its dashboard queries
the new name), the deprecated ``vllm:gpu_*`` cache series, and series of features
jaxllm lacks (LoRA, sleep mode, KV connectors, multi-modal).

``jaxllm:`` series are those vLLM has no name for: the KV blocks free and in the pool
(an exact leak check: every block back when idle), the structured-output mask and
grammar-compile work, and requests rejected by overload. The old ``jaxllm:``-prefixed
copies of vLLM's series are gone rather than kept beside the new names: two names for
one number double the series scraped and let dashboards built on either drift apart;
a query on an old name becomes the same query with the ``vllm:`` prefix.

Each ``EngineMetrics`` has its own registry, so several servers can live in one
process (tests do).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger("jaxllm.stats")

LABELS = ("model_name", "engine")
ENGINE = "0"
# vLLM v1's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's FinishReason values: each gets its series from the start, at 0.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's token-count buckets."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# (EngineStats field, metric name, help). Counters get "_total" in the exposition.
_GAUGES = (
    ("num_running", "vllm:num_requests_running",
     "Number of requests in model execution batches."),
    ("num_waiting", "vllm:num_requests_waiting",
     "Number of requests waiting to be processed (swapped out ones too)."),
    ("kv_cache_usage", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    ("num_free_blocks", "jaxllm:kv_cache_free_blocks",
     "Free KV blocks (cached but unused ones too)."),
    ("num_total_blocks", "jaxllm:kv_cache_total_blocks", "KV blocks in the pool."),
)
_COUNTERS = (
    ("num_preemptions_total", "vllm:num_preemptions",
     "Cumulative number of preemption from the engine."),
    ("prefix_cache_queries", "vllm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "vllm:prefix_cache_hits",
     "Prefix cache hits, in terms of number of cached tokens."),
    ("grammar_mask_seconds", "jaxllm:structured_output_mask_seconds",
     "Seconds computing structured outputs' token masks (off the engine thread)."),
    ("grammar_compile_seconds", "jaxllm:structured_output_compile_seconds",
     "Seconds compiling structured outputs' grammars (off the engine thread)."),
    ("grammars_compiled", "jaxllm:structured_output_grammars_compiled",
     "Structured outputs' grammars compiled (a cached one is not compiled again)."),
)
# (SpecDecodingStats field, metric name, help): vLLM's counters.
_SPEC_COUNTERS = (
    ("num_drafts", "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("num_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
     "Number of accepted tokens."),
)


@dataclass
class _Sample:
    """What the metrics saw of one of a request's completions."""
    num_tokens: int = 0
    last_token: float | None = None    # the step time of its latest token
    finished: bool = False


@dataclass
class _Timing:
    arrival: float
    n: int
    max_tokens: int | None
    samples: list[_Sample] = field(default_factory=list)
    max_generation_tokens: int = 0


class EngineMetrics:
    """The metrics of one engine. ``record_*`` (but ``record_rejected``) and
    ``update_stats`` run on the engine client's thread; scrapes and
    ``record_rejected`` on the event loop (prometheus_client is thread-safe, and the
    snapshot is replaced, never mutated)."""

    def __init__(self, model_name: str, max_model_len: int = 2048,
                 registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        self.stats = None
        self._timings: dict[str, _Timing] = {}
        self._step_tokens: int | None = None   # tokens of the step being recorded
        values = (model_name, ENGINE)

        def counter(name, doc):
            return Counter(name, doc, LABELS, registry=self.registry).labels(*values)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets,
                             registry=self.registry).labels(*values)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.request_success = Counter("vllm:request_success",
                                       "Count of successfully processed requests.",
                                       LABELS + ("finished_reason",), registry=self.registry)
        for reason in FINISH_REASONS:
            self.request_success.labels(*values, reason)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_BUCKETS)
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets)
        self.params_n = histogram("vllm:request_params_n",
                                  "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_BUCKETS)
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_BUCKETS)
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)
        # vLLM has no such series: requests the server turned away before the engine.
        self.request_rejected = Counter(
            "jaxllm:request_rejected", "Requests rejected by overload, by reason.",
            ("model_name", "reason"), registry=self.registry)
        self.registry.register(_StatsCollector(self))

    def update_stats(self, stats) -> None:
        self.stats = stats

    def record_rejected(self, reason: str) -> None:
        """A request the server turned away (e.g. 429 with the waiting queue full)."""
        self.request_rejected.labels(self.model_name, reason).inc()

    def record_arrival(self, request_id: str, arrival_time: float, n: int,
                       max_tokens: int | None = None) -> None:
        self._timings[request_id] = _Timing(arrival_time, n, max_tokens,
                                            [_Sample() for _ in range(n)])

    def record_output(self, output, now: float) -> None:
        """One output of a request (cumulative: every completion's tokens so far)."""
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        if self._step_tokens is None:
            self._step_tokens = 0
        metrics = output.metrics
        # The engine's time of this step's tokens; the server's clock without it.
        step_time = getattr(metrics, "last_token_time", None) or now
        num_prompt = len(output.prompt_token_ids or ())
        for completion, sample in zip(output.outputs, timing.samples):
            num_new = len(completion.token_ids) - sample.num_tokens
            if num_new > 0:
                if sample.last_token is None:
                    self.ttft.observe(now - timing.arrival)
                    self.prompt_tokens.inc(num_prompt)
                    self._step_tokens += num_prompt
                else:
                    self.itl.observe(max(step_time - sample.last_token, 0.0))
                self.generation_tokens.inc(num_new)
                self._step_tokens += num_new
                sample.num_tokens, sample.last_token = len(completion.token_ids), step_time
            if completion.finish_reason is not None and not sample.finished:
                sample.finished = True
                self._record_finished(timing, metrics, completion, num_prompt, now)
        if output.finished:
            del self._timings[output.request_id]
            self.params_n.observe(timing.n)
            self.max_num_generation_tokens.observe(timing.max_generation_tokens)

    def record_step(self) -> None:
        """The outputs of one engine step are recorded: observe its tokens (prompts of
        the requests whose first token came, plus the tokens generated), as vLLM
        does for a step with outputs."""
        if self._step_tokens is not None:
            self.iteration_tokens.observe(self._step_tokens)
            self._step_tokens = None

    def _record_finished(self, timing: _Timing, metrics, completion, num_prompt: int,
                         now: float) -> None:
        num_generated = len(completion.token_ids)
        timing.max_generation_tokens = max(timing.max_generation_tokens, num_generated)
        self.request_success.labels(self.model_name, ENGINE, completion.finish_reason).inc()
        self.e2e.observe(max(now - timing.arrival, 0.0))
        self.request_prompt_tokens.observe(num_prompt)
        self.request_generation_tokens.observe(num_generated)
        if timing.max_tokens:
            self.params_max_tokens.observe(timing.max_tokens)
        scheduled = getattr(metrics, "first_scheduled_time", None)
        first = getattr(metrics, "first_token_time", None)
        last = getattr(metrics, "last_token_time", None)
        if scheduled is None:
            return
        # The server's arrival time and the engine's times: one machine's clock.
        self.queue_time.observe(max(scheduled - timing.arrival, 0.0))
        if first is None or last is None:
            return
        self.prefill_time.observe(max(first - scheduled, 0.0))
        self.decode_time.observe(max(last - first, 0.0))
        self.inference_time.observe(max(last - scheduled, 0.0))
        self.tpot.observe((last - first) / (num_generated - 1) if num_generated > 1 else 0.0)

    def record_abort(self, request_id: str) -> None:
        timing = self._timings.pop(request_id, None)
        if timing is not None:
            unfinished = sum(not s.finished for s in timing.samples)
            self.request_success.labels(self.model_name, ENGINE, "abort").inc(unfinished)


class _StatsCollector:
    """Exports the latest EngineStats snapshot (zeros before the first one)."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics

    def collect(self):
        stats, values = self.metrics.stats, [self.metrics.model_name, ENGINE]
        for families, cls in ((_GAUGES, GaugeMetricFamily), (_COUNTERS, CounterMetricFamily)):
            for attr, name, doc in families:
                family = cls(name, doc, labels=LABELS)
                family.add_metric(values, float(getattr(stats, attr, 0)))
                yield family
        spec = getattr(stats, "spec_decoding", None)
        if spec is not None:
            yield from _spec_families(spec, values)


def _spec_families(spec, values: list[str]):
    for attr, name, doc in _SPEC_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(values, float(getattr(spec, attr)))
        yield family
    family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                 "Accepted tokens per draft position.",
                                 labels=LABELS + ("position",))
    for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
        family.add_metric(values + [str(pos)], float(count))
    yield family


class StatLogger:
    """Logs one line of engine stats every ``interval`` seconds while there is work
    (and once more when it goes idle), like vLLM's ``LoggingStatLogger``."""

    def __init__(self, metrics: EngineMetrics, interval: float = 5.0):
        self.metrics = metrics
        self.interval = interval
        self._last = (time.monotonic(), 0, 0)
        self._was_idle = True
        self._last_spec = None      # the SpecDecodingStats of the previous log line

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
        self._log_spec(getattr(stats, "spec_decoding", None), elapsed)
        return line

    def _log_spec(self, spec, elapsed: float) -> str | None:
        """vLLM's "SpecDecoding metrics" line over the interval, when it drafted."""
        last, self._last_spec = self._last_spec, spec
        if spec is None:
            return None
        drafts = spec.num_drafts - (last.num_drafts if last else 0)
        if drafts <= 0:
            return None
        drafted = spec.num_draft_tokens - (last.num_draft_tokens if last else 0)
        accepted = spec.num_accepted_tokens - (last.num_accepted_tokens if last else 0)
        per_pos = [n - (last.num_accepted_tokens_per_pos[i] if last else 0)
                   for i, n in enumerate(spec.num_accepted_tokens_per_pos)]
        line = (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {drafted / elapsed:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                "Per-position acceptance rate: "
                f"{', '.join(f'{n / drafts:.3f}' for n in per_pos)}, "
                f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%")
        logger.info(line)
        return line
