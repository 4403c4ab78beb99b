"""One process of the two-process test (test_multihost.py), run as
`python multihost_worker.py PORT PROCESS_ID FOLDER TP OUT.npz` with XLA_FLAGS giving it
its host devices. Process 0 generates and saves tokens and logits; process 1 follows."""
from __future__ import annotations

import sys

import numpy as np

from jaxllm import LLM
from jaxllm.parallel import distributed
from tp_util import ENGINE, generate_greedy


def main(port: str, process_id: str, folder: str, tp: str, out: str) -> None:
    pid = int(process_id)
    llm = LLM(folder, tensor_parallel_size=int(tp), coordinator_address=f"127.0.0.1:{port}",
              num_processes=2, process_id=pid, **ENGINE)
    runner, executor = llm.llm_engine.runner, llm.llm_engine.executor
    if pid != 0:
        print(f"follower ran {distributed.follow(executor)} steps")
        return
    tokens, logits = generate_greedy(llm)
    executor.leader.close()
    np.savez(out, tokens=np.array(tokens), num_devices=len(runner.mesh.devices.flat),
             **{f"logits{i}": x for i, x in enumerate(logits)})


if __name__ == "__main__":
    main(*sys.argv[1:])
