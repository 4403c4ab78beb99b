"""The kernels of one model step on an H200, counted on a machine without a GPU: the
bare step compiled by XLA's deviceless ahead-of-time path (jaxllm.runner.aot) for the
model cut to 2 and to 3 layers, so a layer's kernels and the step's fixed ones come
apart (not 1 and 2: with one layer, work its layers share, like RoPE's cos/sin table,
fuses into that layer); the whole model's count is fixed + layers x per layer. GEMM
tilings are XLA's untuned defaults (the autotuner needs the device), and cuBLASLt
chooses its kernels (and any split-K reduction) on the device, so steps with cuBLAS
GEMMs run more kernels there than counted here.

    python3.11 -m venv /tmp/aot && /tmp/aot/bin/pip install -e . \
        "jax[cuda13]==$(python -c 'import jax; print(jax.__version__)')"
    /tmp/aot/bin/python scripts/aot_step.py --shape decode:1:600 --shape decode:64:600
    /tmp/aot/bin/python scripts/aot_step.py --quantization fp8 --shape prefill:4:0:1024
    /tmp/aot/bin/python scripts/aot_step.py --quant-matmul w8a16_fp8,w8a16_int8_f16

The GPU machine's jax (0.11) installs here under Python 3.12 only (`PYENV_VERSION=3.12.1
python -m venv /tmp/j11`, then the same pip line with its version); Mosaic GPU kernels
lower differently between the two, so compile them with both.

--quant-matmul compiles bench_quant_matmul.py's kinds instead (its gate/up shape at 16
and 64 rows) and lists their kernels; --sampler ROWS the sampler's greedy, random and
logprobs variants at the 8B vocabulary (`--sampler 8,256`). --time prints each step's
lower and compile seconds; --mosaic-out-cols has the Mosaic W4A16 kernel write its
partials [S, N, Mp] (OUT_ROWS off). With $OUT set, writes each compiled step there
(``aot_<tag>-L<layers>.hlo.txt``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")     # compile only: no GPU runtime
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)                          # jaxllm
SHORT = {"__triton_nested_gemm_fusion": "gemm", "__triton_gemm": "gemm",
         "__triton": "triton", "kLoop": "loop", "kInput": "reduce",
         "__gpu$xla.gpu.triton": "pallas"}


def short(kind: str) -> str:
    """A kernel kind in a word: cuBLAS calls are "cublas", fusions by their emitter."""
    return "cublas" if kind.startswith("__cublas") else SHORT.get(kind, kind)


def compile_cut(args, layers: int, shapes: list) -> dict:
    """Each shape's entry kernels for the model cut to `layers` layers."""
    import jax
    import step_profile
    from step_hlo import cut_model

    from jaxllm import LLM
    from jaxllm.runner import aot
    from jaxllm.layers.quantization import int4_kernels
    from pallas_kernels.common import is_hopper
    with open(args.target) as f:
        mesh = aot.target_mesh(f.read())
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hopper = is_hopper()
    # the loader stores uint4 scales for the target's GPU (packed on Hopper), not this CPU
    int4_kernels.is_hopper = lambda: hopper
    llm = LLM(cut_model(args.model, layers), load_format="dummy", dtype="bfloat16",
              max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192,
              enforce_eager=True, num_gpu_blocks_override=512,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.llm_engine.runner
    out = {}
    for spec in shapes:
        label, batch, ctx, *q = spec.split(":")
        arrays, decode_only = step_profile.step_arrays(runner, int(batch), int(ctx),
                                                       int(q[0]) if q else 1)
        t0 = time.perf_counter()
        lowered = aot.lower_step(runner, mesh, arrays, decode_only)
        t1 = time.perf_counter()
        text = lowered.compile().as_text()
        if args.time:       # the host's cost of a program at warm-up, by stage
            print(f"{tag(args, spec)}-L{layers}: lower {t1 - t0:.2f} s, compile "
                  f"{time.perf_counter() - t1:.2f} s", file=sys.stderr)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"aot_{tag(args, spec)}-L{layers}"
                                   ".hlo.txt"), "w") as f:
                f.write(text)
        out[spec] = aot.entry_kernels(text)
    del llm
    jax.clear_caches()
    return out


def quant_matmul_kernels(args) -> int:
    """Each bench_quant_matmul kind's gate/up matmul (28672 x 4096) at 16 and 64 rows,
    compiled for the target: its kernels in order."""
    import jax
    import bench_quant_matmul

    from jaxllm.runner import aot
    with open(args.target) as f:
        mesh = aot.target_mesh(f.read())
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        for kind in args.quant_matmul.split(","):
            for m in (16, 64):
                fn, xs = bench_quant_matmul.case_args(kind, m, 28672, 4096,
                                                      jax.random.PRNGKey(0))
                shapes = aot.on_mesh(xs, mesh)
                text = jax.jit(fn).lower(*shapes).compile().as_text()
                print(f"{kind:>18} M={m:<3}", " ".join(short(k) for _, k in
                                                       aot.entry_kernels(text)))
    return 0


def sampler_kernels(args) -> int:
    """The sampler's variants (greedy, random, random with logprobs) for ROWS rows of
    the 128,256-token vocabulary, compiled for the target: their kernels."""
    import jax
    import jax.numpy as jnp

    from jaxllm.runner import aot
    from jaxllm.runner.sampler import NUM_COLUMNS, SamplerFlags, SamplingMetadata
    from jaxllm.runner.step_fn import sample_into
    with open(args.target) as f:
        mesh = aot.target_mesh(f.read())
    variants = {"greedy": SamplerFlags(all_greedy=True), "random": SamplerFlags(),
                "random+logprobs": SamplerFlags(num_logprobs=20)}
    sd = jax.ShapeDtypeStruct
    for rows in map(int, args.sampler.split(",")):
        md = SamplingMetadata(sd((rows, NUM_COLUMNS), jnp.int32),
                              *(sd((rows, 1), jnp.int32),) * 3)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            xs = aot.on_mesh((sd((rows, 128256), jnp.float32), md, sd((256,), jnp.int32)),
                             mesh)
            for name, flags in variants.items():
                fn = jax.jit(lambda lg, m, t, flags=flags: sample_into(lg, m, flags, t))
                kinds = aot.entry_kernels(fn.lower(*xs).compile().as_text())
                print(f"{name:>16} rows={rows:<4} {len(kinds):>3} kernels:",
                      " ".join(short(k) for _, k in kinds))
    return 0


def tag(args, spec: str) -> str:
    return spec.replace(":", "-") + (f"-{args.quantization}" if args.quantization else "") + (
        f"-kv{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "configs/models/llama-3.1-8b"))
    ap.add_argument("--target", default=os.path.join(ROOT, "configs/gpu_targets/h200.txtpb"),
                    help="the GPU's GpuTargetConfigProto (text)")
    ap.add_argument("--shape", action="append", default=[],
                    help="label:batch:ctx[:q_len], e.g. decode:1:600 or prefill:4:0:1024")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (online, dummy weights)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    ap.add_argument("--mosaic-out-cols", action="store_true",
                    help="the Mosaic W4A16 kernel writes its partials [S, N, Mp], "
                    "not [S, Mp, N] (w4a16_mgpu.OUT_ROWS off)")
    ap.add_argument("--time", action="store_true",
                    help="print each step's lower and compile seconds (stderr)")
    ap.add_argument("--quant-matmul", metavar="KINDS", default=None,
                    help="bench_quant_matmul.py kinds to compile instead of a step")
    ap.add_argument("--sampler", metavar="ROWS", default=None,
                    help="compile the sampler's variants for these row counts instead")
    args = ap.parse_args(argv)
    if args.mosaic_out_cols:
        from pallas_kernels import w4a16_mgpu
        w4a16_mgpu.OUT_ROWS = False
    if args.sampler:
        return sampler_kernels(args)
    if args.quant_matmul:
        return quant_matmul_kernels(args)
    shapes = args.shape or ["decode:1:600"]
    with open(os.path.join(args.model, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    two, three = compile_cut(args, 2, shapes), compile_cut(args, 3, shapes)
    rows = {}
    for spec in shapes:
        a, b = two[spec], three[spec]
        n = len(b) - len(a)
        rows[tag(args, spec)] = dict(
            kernels_2_layers=len(a), kernels_3_layers=len(b), per_layer=n,
            fixed=len(a) - 2 * n, model_layers=layers, predicted=len(a) + n * (layers - 2),
            layer_sequence=[short(k) for _, k in last_layer(a, b, n)])
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'step':<28} {'2 layers':>9} {'3 layers':>9} {'per layer':>10} {'fixed':>6} "
          f"{'model':>6}  a layer's kernels")
    for name, r in rows.items():
        print(f"{name:<28} {r['kernels_2_layers']:>9} {r['kernels_3_layers']:>9} "
              f"{r['per_layer']:>10} {r['fixed']:>6} {r['predicted']:>6}  "
              + " ".join(r["layer_sequence"]))
    return 0


def last_layer(a: list, b: list, n: int) -> list:
    """The 3-layer step's last layer: the n kernels before the tail it shares with the
    2-layer step (where a layer ends as the tail does, the window starts mid-layer:
    the same kernels, rotated)."""
    s = 0
    while s < len(a) and a[-1 - s][1] == b[-1 - s][1]:
        s += 1
    s = min(s, len(a) - n)
    return b[len(b) - s - n:len(b) - s] if n > 0 else []


if __name__ == "__main__":
    sys.exit(main())
