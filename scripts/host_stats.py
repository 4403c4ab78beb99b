"""Where an engine step's wall time goes on the host, per step of a run: the engine
thread's phases and CPU time (bench_host's timers), and what the kernel says about its
threads and the machine (Linux /proc):

- the engine thread's time on a CPU, time runnable but waiting for one (another thread
  or, in a VM, the hypervisor had it), and the rest of its wall time, asleep: reading
  steps back, waiting for a mask, or waiting for the GIL;
- its voluntary and involuntary context switches;
- the whole process's CPU time (all threads: llguidance's, XLA's);
- the machine's CPUs: busy and stolen (a VM's vCPUs that the host did not run).

Used by bench_structured's `--phases`.
"""
from __future__ import annotations

import os
import threading
import time


def thread_sched(tid: int) -> tuple[float, float, int, int]:
    """(seconds on a CPU, seconds runnable and waiting, voluntary, involuntary context
    switches) of one of this process's threads; zeros where /proc does not say."""
    run = wait = 0.0
    vol = invol = 0
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            a, b, _ = f.read().split()
            run, wait = int(a) / 1e9, int(b) / 1e9
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return run, wait, vol, invol


def machine_cpu() -> tuple[int, int, int]:
    """(all jiffies, idle + iowait jiffies, stolen jiffies) over every CPU so far."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0, 0
    fields += [0] * (8 - len(fields))
    return sum(fields[:8]), fields[3] + fields[4], fields[7]


def topology() -> dict:
    """The CPUs this process may use, each one's SMT siblings, and the CPU model."""
    cpus = sorted(os.sched_getaffinity(0))
    siblings = {}
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                siblings[c] = f.read().strip()
        except OSError:
            pass
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": cpus, "smt_siblings": siblings, "model": model}


class StepPhases:
    """Per engine step of a run: wall time, the engine thread's CPU time, its phases
    (bench_host's PHASES), the wall time it waited to read steps back (large: the
    device sets the pace), Python's collector, the mask thread's bitmask uploads, and
    the kernel's accounting above, so a run shows where its steps go on the card's
    own host. The engine thread is the one that builds this (LLM.generate's)."""

    def __init__(self, engine):
        from bench_host import gc_timer, time_phases
        self.phases, self.gc = time_phases(engine), gc_timer()
        self.tid = threading.get_native_id()
        self.steps, self.wall, self.cpu, self.upload, self.wait = 0, 0.0, 0.0, 0.0, 0.0
        step, executor = engine.step, engine.engine_core.executor
        upload, get_output = executor.upload_bitmask, executor.get_output

        def timed_step():
            t, c = time.perf_counter(), time.thread_time()
            try:
                return step()
            finally:
                self.steps += 1
                self.wall += time.perf_counter() - t
                self.cpu += time.thread_time() - c

        def wall_timed(fn, total: str):       # fn, its wall time added to self.<total>
            def timed(arg):
                t = time.perf_counter()
                try:
                    return fn(arg)
                finally:
                    setattr(self, total, getattr(self, total) + time.perf_counter() - t)
            return timed
        engine.step = timed_step
        executor.upload_bitmask = wall_timed(upload, "upload")
        executor.get_output = wall_timed(get_output, "wait")

    def snapshot(self) -> dict:
        run, runnable, vol, invol = thread_sched(self.tid)
        total, idle, steal = machine_cpu()
        times = os.times()
        return {"steps": self.steps, "wall": self.wall, "engine_cpu": self.cpu,
                "read-back wall": self.wait, "python gc": self.gc[0],
                "mask upload": self.upload, **self.phases,
                "engine on cpu": run, "engine runnable": runnable, "engine switches": vol,
                "engine preempted": invol, "process cpu": times.user + times.system,
                "jiffies": total, "idle jiffies": idle, "stolen jiffies": steal,
                "clock": time.perf_counter()}

    @staticmethod
    def per_step(before: dict, after: dict) -> dict:
        """Per step between two snapshots: seconds as ms, counts as counts; the
        machine's CPUs as shares of their time over the span."""
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        n = max(d.pop("steps"), 1)
        jiffies, idle, stolen = d.pop("jiffies"), d.pop("idle jiffies"), d.pop("stolen jiffies")
        clock = d.pop("clock")
        out = {"steps": n, "span_ms": round(1000 * clock / n, 3)}
        for k, v in d.items():
            if k in ("engine switches", "engine preempted"):
                out[f"{k}_per_step"] = round(v / n, 2)
            else:
                out[f"{k}_ms"] = round(1000 * v / n, 3)
        # Over the whole span (the run's requests added, its steps, its outputs):
        # asleep is neither on a CPU nor runnable (the read-back, a mask, the GIL).
        out["engine asleep_ms"] = round(
            out["span_ms"] - out["engine on cpu_ms"] - out["engine runnable_ms"], 3)
        if jiffies:
            out["machine busy_cpus"] = round((jiffies - idle - stolen) / jiffies
                                             * os.cpu_count(), 2)
            out["machine stolen_pct"] = round(100 * stolen / jiffies, 2)
        out["process cpus"] = round(d["process cpu"] / clock, 2) if clock else 0.0
        return out
