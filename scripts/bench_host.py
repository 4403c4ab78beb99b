"""Host cost of the engine and of the serving path, with a simulated device.

The model runner's launch and read-back are replaced by a fake device that takes
`--device-ms` per step (steps run in order, like a GPU stream) and samples a made-up
token, so what is timed is the host: scheduling, input preparation, sampling
metadata, output building, detokenization, and (with --serve) the HTTP/SSE path of
`jaxllm serve` with a `jaxllm bench serve` client, over the engine in a thread of
the server (AsyncLLM in-process) and/or in a process of its own (AsyncLLM's engine process, the
default of `jaxllm serve`; its engine process gets the same fake device). Runs on
the CPU.

    python scripts/bench_host.py --batch 256 --device-ms 15 --serve
    python scripts/bench_host.py --serve --serve-engine process --skip-offline
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "max_position_embeddings": 2048, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def fake_device(runner, device_ms: float):
    """Replace the runner's device work by a stream that takes device_ms per step."""
    from jaxllm.runner.step_output import SampleResult
    from jaxllm.runner.sampler import SamplingMetadata
    free = [0.0]

    class Handle:
        pass

    def execute_model(so, requests, seeds):
        arrays, _, rows = runner.prepare_inputs(so.scheduled)
        runner.remember_rows(so.scheduled)
        reqs = [requests[r.request_id] for r in so.scheduled]
        SamplingMetadata.from_params(
            [q.sampling_params for q in reqs], [r.output_index for r in so.scheduled],
            [q.prompt_token_ids for q in reqs], [q.output_token_ids for q in reqs], rows,
            runner.arch.vocab_size, fallback_seeds=[seeds[q.request_id] for q in reqs],
            eos_token_ids=(2,))
        h = Handle()
        h.scheduled = so.scheduled
        h.done = free[0] = max(time.perf_counter(), free[0]) + device_ms / 1000
        return h

    def get_output(h):
        time.sleep(max(0.0, h.done - time.perf_counter()))
        return {r.request_id: SampleResult(300 + i % 500, -0.5, 1)
                for i, r in enumerate(h.scheduled) if r.do_sample}, {}
    runner.execute_model, runner.get_output = execute_model, get_output


def fake_engine_device(engine, device_ms: float):
    """The engine process's setup hook: the fake device, in the engine process."""
    fake_device(engine.runner, device_ms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device-ms", type=float, default=15.0)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--serve-engine", choices=("thread", "process", "both"), default="both",
                    help="--serve over the in-thread engine, the engine process, or both")
    ap.add_argument("--skip-offline", action="store_true", help="only the --serve part")
    args = ap.parse_args()
    import json
    from jaxllm import LLM, SamplingParams
    from jaxllm.sampling_params import RequestOutputKind
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(TINY, f)
    llm = LLM(folder, load_format="dummy", dtype="float32", max_model_len=2048,
              max_num_seqs=args.batch, max_num_batched_tokens=4096, enforce_eager=True,
              num_gpu_blocks_override=20000)
    engine = llm.llm_engine
    fake_device(engine.runner, args.device_ms)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 1000, 64).tolist()}
               for _ in range(args.requests)]
    for kind in () if args.skip_offline else (RequestOutputKind.FINAL_ONLY,
                                              RequestOutputKind.CUMULATIVE):
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                                output_kind=kind)
        steps, t0 = 0, time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"{kind.name}-{i}", p, params)
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        t = time.perf_counter() - t0
        print(f"offline, {kind.name} outputs: {t:.2f} s, {1000 * t / steps:.2f} ms per step "
              f"({steps} steps; the device alone: {args.device_ms} ms), "
              f"{args.requests * args.output_len / t:.0f} out tok/s", flush=True)
    if not args.serve:
        return
    from jaxllm.engine.async_llm import AsyncLLM
    if args.serve_engine in ("thread", "both"):
        serve(lambda: AsyncLLM.from_engine(engine), engine.config, folder, args, "engine thread")
    if args.serve_engine in ("process", "both"):
        setup = functools.partial(fake_engine_device, device_ms=args.device_ms)
        serve(lambda: AsyncLLM.from_config(engine.config, multiprocess=True, setup=setup),
              engine.config, folder,
              args, "engine process")


def serve(make_engine, config, folder, args, label: str):
    from jaxllm.entrypoints.openai.api_server import build_app
    async_engine = make_engine()
    process = getattr(async_engine, "process", None)
    try:
        before = cpu_seconds(process)
        _serve(build_app(async_engine, config), folder, args, label)
        used = [b - a for a, b in zip(before, cpu_seconds(process))]
        print(f"CPU seconds: server process {used[0]:.1f}"
              + (" (engine thread included)" if process is None else
                 f", engine process {used[1]:.1f}") + f", client {used[2]:.1f}")
    finally:
        async_engine.shutdown()


def cpu_seconds(process) -> tuple[float, float, float]:
    """CPU time (user + system) of this process, of the engine process (if any),
    and of the waited-for children (the benchmark client)."""
    import resource
    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    engine = 0.0
    if process is not None:
        with open(f"/proc/{process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        engine = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own.ru_utime + own.ru_stime, engine, children.ru_utime + children.ru_stime


def _serve(app, folder, args, label: str):
    from jaxllm.entrypoints.openai.api_server import serve_in_background
    with serve_in_background(app) as url:
        port = url.rstrip("/").rsplit(":", 1)[1]
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "jaxllm.entrypoints.cli", "bench", "serve", "--port", port,
             "--tokenizer", folder, "--num-prompts", str(args.requests), "--input-len", "64",
             "--output-len", str(args.output_len), "--ignore-eos", "--disable-tqdm"],
            capture_output=True, text=True)
        t = time.perf_counter() - t0
    keep = ("Benchmark duration", "Output token throughput", "Mean TPOT")
    print(f"serve, {label} (client in another process), wall {t:.1f} s")
    print("\n".join(line for line in out.stdout.splitlines() if line.startswith(keep)))
    if out.returncode:
        print(out.stderr[-800:])


if __name__ == "__main__":
    main()
