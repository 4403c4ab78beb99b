"""What Triton makes of a kernel for sm90, on a machine without a GPU: SASS instruction
counts and shared memory, from the `triton` package's own compiler (its wheel carries
ptxas and cuobjdump; `pip install triton`, not a jaxllm dependency).

Two subjects:

- ``gemm``: a weight-only GEMM as XLA's Triton emitter writes one (x [M, K] 16-bit,
  an fp8 e4m3 weight [N, K] widened in registers, f32 sums), once per dot dtype
  (bf16, f16): what each widening costs per weight value. The conversion pipe
  (F2F, I2F: ~16 results per clock per SM) bounds a weight stream that needs one
  scalar conversion per value at ~3.7 TB/s on the H200.
- ``quant_matmul``: pallas_kernels.quant_matmul as jax lowers it for CUDA (its Triton
  IR), compiled with the kernel's own warps and stages: its shared memory against
  the H200's 227 KB, and its instruction mix.

    python3 scripts/triton_sass.py gemm [--m 16] [--bk 128] [--bn 128]
    python3 scripts/triton_sass.py quant_matmul --m 16 --n 28672 --k 4096 [--x bf16]
        [--group 128]     (block FP8: a scale per row and group of columns)

The Triton the wheel brings may not be the one XLA bundles: counts are indicative
(what an instruction costs per value), not the GPU's final code.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

H200_SMEM = 227 * 1024
# Opcodes worth a column: conversions, shared-memory and global traffic, the MMAs.
SHOWN = ("F2F", "F2FP", "I2F", "HADD2", "PRMT", "LDS", "LDSM", "STS", "LDG", "LDGSTS",
         "HGMMA", "HMMA")


def sass_counts(cubin: bytes) -> collections.Counter:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text, re.M)
    return collections.Counter(ops)


def compile_for_sm90(src, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def report(label: str, kernel, values: int | None = None) -> None:
    counts = sass_counts(kernel.asm["cubin"])
    smem = kernel.metadata.shared
    print(f"{label}: shared memory {smem} B ({'fits' if smem <= H200_SMEM else 'OVER'} "
          f"the H200's {H200_SMEM})")
    for op in SHOWN:
        if counts[op]:
            per = f"  ({counts[op] / values:.3f} per value of a thread's tile)" if values else ""
            print(f"  {op:<7} {counts[op]:>5}{per}")


def gemm(args) -> None:
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    @triton.jit
    def weight_only(x_ptr, w_ptr, o_ptr, N, K, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, DT: tl.constexpr):
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rm, rk = tl.arange(0, BM), tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            x = tl.load(x_ptr + rm[:, None] * K + (k + rk)[None, :])
            w = tl.load(w_ptr + rn[:, None] * K + (k + rk)[None, :])     # [BN, BK]
            acc += tl.dot(x.to(DT), tl.trans(w.to(DT)))
        tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc)

    # Unrolled loop body: each thread converts BN * BK / threads weight values a step.
    values = args.bn * args.bk // (32 * args.warps)
    for name, dt in (("bf16", tl.bfloat16), ("f16", tl.float16)):
        src = ASTSource(weight_only, signature={
            "x_ptr": "*bf16" if name == "bf16" else "*fp16", "w_ptr": "*fp8e4nv",
            "o_ptr": "*fp32", "N": "i32", "K": "i32", "BM": "constexpr", "BN": "constexpr",
            "BK": "constexpr", "DT": "constexpr"},
            constexprs={"BM": args.m, "BN": args.bn, "BK": args.bk, "DT": dt})
        report(f"weight-only fp8 GEMM, {name} dots, tile {args.m}x{args.bn}x{args.bk}",
               compile_for_sm90(src, args.warps, args.stages), values)


def quant_matmul(args) -> None:
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as registration
    from pallas_kernels import quant_matmul as qmm

    captured = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = lower(*a, **k)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result
    registration.lowering.lower_jaxpr_to_triton_module = capture
    x_dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16}[args.x]
    sd = jax.ShapeDtypeStruct
    scales = (args.n, args.k // args.group) if args.group else (args.n,)
    shapes = (sd((args.m, args.k), x_dtype), sd((args.n, args.k), jnp.float8_e4m3fn),
              sd(scales, jnp.float32))
    fn = jax.jit(lambda x, w, ws: qmm.quant_matmul(x, w, None, ws))
    try:
        from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
        mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                            abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    except (ImportError, TypeError):      # jax 0.10 lowers for CUDA without one
        fn.trace(*shapes).lower(lowering_platforms=("cuda",))
    else:
        with use_abstract_mesh(mesh):
            fn.trace(*shapes).lower(lowering_platforms=("cuda",))
    st = qmm.default_settings(args.m, args.n, args.k, 8, 2, group=args.group or None)
    with tempfile.NamedTemporaryFile("w", suffix=".ttir") as f:
        f.write(captured[-1])
        f.flush()
        kernel = compile_for_sm90(f.name, st["num_warps"], st["num_stages"])
    values = st["bn"] * st["bk"] // (32 * st["num_warps"])
    report(f"quant_matmul weight-only fp8, x {args.x}, M {args.m} N {args.n} K {args.k}"
           f"{f' G {args.group}' if args.group else ''}, settings {st}", kernel, values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("subject", choices=("gemm", "quant_matmul"))
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--bn", type=int, default=128)
    ap.add_argument("--bk", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--x", default="bf16", choices=("bf16", "f16"))
    ap.add_argument("--group", type=int, default=0, help="group scales of G columns")
    args = ap.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        print("needs the triton package (pip install triton)", file=sys.stderr)
        return 2
    gemm(args) if args.subject == "gemm" else quant_matmul(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
