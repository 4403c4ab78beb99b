"""Two processes on localhost (jax.distributed, gloo CPU collectives) run one tiny
model with tensor parallelism across them: process 0 schedules and broadcasts each
step, process 1 follows. Tokens and logits match a one-device run of this process."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tp_util import ENGINE, free_port, generate_greedy, host_devices_env, make_tp_model

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")


def _launch(port: int, folder: str, tp: int, out: str) -> list[str]:
    env = host_devices_env(2)      # 2 devices per process: TP=4 spans both processes
    procs = [subprocess.Popen([sys.executable, WORKER, str(port), str(pid), folder, str(tp), out],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for pid in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for pid, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {pid} failed:\n{log[-4000:]}"
    return logs


def test_tp_across_two_processes_matches_one_device(tmp_path):
    from jaxllm import LLM
    folder = make_tp_model(str(tmp_path / "llama"), "llama")
    out = str(tmp_path / "leader.npz")
    logs = _launch(free_port(), folder, 4, out)
    got = np.load(out)
    assert int(got["num_devices"]) == 4
    tokens, logits = generate_greedy(LLM(folder, tensor_parallel_size=1, **ENGINE))
    assert got["tokens"].tolist() == tokens
    assert f"follower ran {len(logits)} steps" in logs[1]
    for i, ref in enumerate(logits):
        np.testing.assert_allclose(got[f"logits{i}"], ref, rtol=1e-5, atol=1e-4)
