"""Host cost of the engine and of the serving path, with a simulated device.

The model runner's launch and read-back are replaced by a fake device that takes
`--device-ms` per step (steps run in order, like a GPU stream) and samples a made-up
token, so what is timed is the host: scheduling, input preparation, sampling
metadata, output building, detokenization, and (with --serve) the HTTP/SSE path of
`jaxllm serve` with a `jaxllm bench serve` client. Runs on the CPU.

    python scripts/bench_host.py --batch 256 --device-ms 15 --serve
"""
from __future__ import annotations

import argparse
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
    from jaxllm.runner.model_runner import SampleResult
    from jaxllm.runner.sampler import SamplingMetadata
    free = [0.0]

    class Handle:
        pass

    def execute_model(so, requests, seeds):
        arrays, _, rows = runner.prepare_inputs(so.scheduled)
        runner._prev_rows = {r.request_id: i for i, r in enumerate(so.scheduled) if r.do_sample}
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device-ms", type=float, default=15.0)
    ap.add_argument("--serve", action="store_true")
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
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):
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
    if args.serve:
        serve(engine, folder, args)


def serve(engine, folder, args):
    from jaxllm.engine.async_engine import AsyncLLMEngine
    from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
    app = build_app(AsyncLLMEngine(engine), engine.config)
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
    print(f"serve (client in another process), wall {t:.1f} s")
    print("\n".join(line for line in out.stdout.splitlines() if line.startswith(keep)))
    if out.returncode:
        print(out.stderr[-800:])


if __name__ == "__main__":
    main()
