"""Where an engine run's wall time goes, step by step: each schedule's prefill tokens
and decode rows, and the wall time until the next schedule, summed by kind of step
(decode only, prefill only, mixed) and by phase (a run of steps of one kind).

With async scheduling the engine launches step k, then waits for step k-1's tokens,
so the span from schedule k to schedule k+1 is step k-1's device time (or the host's
cycle, where that is longer): each span is counted to the step before it.

    from step_timeline import timed_run
    seconds, outs, summary = timed_run(llm, prompts, params)

``host_timing`` (the engine in this process): the host's time per step by part.
"""
from __future__ import annotations

import statistics
import time


def _kind(prefill_tokens: int, decode_rows: int) -> str:
    if prefill_tokens and decode_rows:
        return "mixed"
    return "prefill" if prefill_tokens else "decode"


def timed_run(llm, prompts, params) -> tuple[float, list, dict]:
    """llm.generate(prompts, params) with each schedule recorded: (wall seconds,
    outputs, summary). The recorder goes where the engine core runs (this process or
    its own, through call_utility); perf_counter is the system's monotonic clock, the
    same in both processes."""
    core = llm.llm_engine.engine_core
    core.call_utility(_record)
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        steps = core.call_utility(_stop_recording)
    return seconds, outs, summarize(steps, t0 + seconds)


_STEPS: list[tuple[float, int, int, int]] = []    # (time, prefill tokens, decode rows, ctx)


def _record(core) -> None:
    scheduler = core.scheduler
    real = scheduler.schedule
    _STEPS.clear()

    def schedule(*a, **k):
        so = real(*a, **k)
        prefill = decode = ctx = 0
        for r in so.scheduled:
            n = len(r.token_ids)
            if n == 1 and r.num_computed_tokens > 0:
                decode += 1
                ctx += r.num_computed_tokens + 1
            else:
                prefill += n
        if so.scheduled:
            _STEPS.append((time.perf_counter(), prefill, decode, ctx))
        return so
    schedule.real = real
    scheduler.schedule = schedule


def _stop_recording(core) -> list:
    scheduler = core.scheduler
    scheduler.schedule = scheduler.schedule.real
    steps = list(_STEPS)
    _STEPS.clear()
    return steps


def summarize(steps: list[tuple[float, int, int, int]], end: float) -> dict:
    """By kind: steps, seconds, prefill tokens, decode rows, ms per step; phases: the
    runs of one kind in order (at most 40 listed)."""
    # Span k = time from schedule k+1 to schedule k+2 (the step read back in it);
    # the last two steps end with the run.
    times = [s[0] for s in steps] + [end, end]
    by_kind: dict[str, dict] = {}
    phases: list[dict] = []
    for k, (_, prefill, decode, ctx) in enumerate(steps):
        span = times[k + 2] - times[k + 1] if k + 2 < len(times) else 0.0
        kind = _kind(prefill, decode)
        agg = by_kind.setdefault(kind, {"steps": 0, "seconds": 0.0, "prefill_tokens": 0,
                                        "decode_rows": 0, "decode_ctx": 0})
        agg["steps"] += 1
        agg["seconds"] += span
        agg["prefill_tokens"] += prefill
        agg["decode_rows"] += decode
        agg["decode_ctx"] += ctx
        if phases and phases[-1]["kind"] == kind:
            p = phases[-1]
        else:
            p = {"kind": kind, "steps": 0, "seconds": 0.0, "prefill_tokens": 0,
                 "decode_rows": 0}
            phases.append(p)
        p["steps"] += 1
        p["seconds"] += span
        p["prefill_tokens"] += prefill
        p["decode_rows"] += decode
    for agg in by_kind.values():
        agg["ms_per_step"] = round(1000 * agg["seconds"] / max(agg["steps"], 1), 3)
        agg["seconds"] = round(agg["seconds"], 3)
    for p in phases:
        p["seconds"] = round(p["seconds"], 3)
    return {"by_kind": by_kind, "num_phases": len(phases), "phases": phases[:40]}


def host_timing(llm, prompts, params) -> dict:
    """Mean host milliseconds per engine step: launching a step (schedule, inputs,
    dispatch), waiting for the step read back, and the rest of the step."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    spans = {"launch": [], "wait": [], "step": [], "model_dispatch": [], "sample_dispatch": []}
    real = (runner.execute_model, runner.get_output, engine.step, runner.launch_step,
            runner.sample_step)

    def timed(name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spans[name].append(time.perf_counter() - t0)
        return call
    runner.execute_model, runner.get_output = timed("launch", real[0]), timed("wait", real[1])
    engine.step = timed("step", real[2])
    runner.launch_step = timed("model_dispatch", real[3])
    runner.sample_step = timed("sample_dispatch", real[4])
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        (runner.execute_model, runner.get_output, engine.step, runner.launch_step,
         runner.sample_step) = real
    return {k: round(1000 * statistics.mean(v), 4) for k, v in spans.items() if v}
