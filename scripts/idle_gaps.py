"""Where a traced run's device waits, and what the host was doing meanwhile.

From a jax.profiler trace (its Chrome-format events): the GPU's kernels on its
compute streams in time order; every gap between two of them longer than
`min_us` is device idle. Each gap is put down to the XLA module whose kernel ends
it (the program launched late: the model step or the sampler), and the host
threads' spans that overlap it are summed by thread and name (the runtime's
launches, transfers and waits, CUDA driver calls). Used by step_profile's
profile_engine, whose traces run without Python tracing so a step keeps its pace.
"""
from __future__ import annotations

import bisect
import collections


def _threads(events) -> dict:
    return {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
            for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}


def idle_gaps(events, gpu_pids: set, steps: int, min_us: float = 20.0, top: int = 16) -> dict:
    """Device idle per step, by the module launched after it, and the host spans
    overlapping the idle (ms per step)."""
    threads = _threads(events)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in spans if e["pid"] in gpu_pids]
    streams = {k for k, v in threads.items() if k[0] in gpu_pids and "stream" in v.lower()}
    modules = sorted((e for e in gpu if "module" in threads.get((e["pid"], e.get("tid")), "")
                      .lower()), key=lambda e: e["ts"])
    kernels = sorted((e for e in gpu if (e["pid"], e.get("tid")) in streams
                      and "memcpy" not in str(e["name"]).lower()), key=lambda e: e["ts"])
    if not kernels:
        return {"error": "no kernels on a GPU stream"}
    starts = [m["ts"] for m in modules]

    def module_at(ts: float) -> str:
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and modules[i]["ts"] + modules[i]["dur"] >= ts:
            return str(modules[i]["name"]).split("(")[0][:40]
        return "?"
    gaps, end = [], kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        if k["ts"] - end > min_us:
            gaps.append((end, k["ts"], module_at(k["ts"] + 0.01)))
        end = max(end, k["ts"] + k["dur"])
    per = 1000.0 * steps
    by_module = collections.Counter()
    for a, b, m in gaps:
        by_module[m] += b - a
    host = collections.Counter()
    host_spans = sorted((e for e in spans if e["pid"] not in gpu_pids), key=lambda e: e["ts"])
    for a, b, _ in gaps:
        for e in host_spans:
            if e["ts"] >= b:
                break
            overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
            if overlap > 0:
                key = (threads.get((e["pid"], e.get("tid")), "?")[:24], str(e["name"])[:70])
                host[key] += overlap
    lengths = sorted(b - a for a, b, _ in gaps)
    return {
        "idle_ms_per_step": round(sum(lengths) / per, 4),
        "gaps_per_step": round(len(gaps) / steps, 2),
        "gap_us_median": round(lengths[len(lengths) // 2], 1) if lengths else 0.0,
        "idle_ms_per_step_before": {m: round(v / per, 4) for m, v in by_module.most_common()},
        "host_during_idle": [(t, n, round(v / per, 4)) for (t, n), v in host.most_common(top)],
    }
