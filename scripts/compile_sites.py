"""What N call sites of one W4A16 kernel cost to lower and compile for the H200, on a
machine without a GPU (XLA's deviceless ahead-of-time path, as scripts/aot_step.py):
a chain of N gate/up-shaped matmuls (28672 x 4096, 16 rows), each on its own weight,
as a model's layers call a projection. The kernels sit behind one `jax.jit` so that
identical call sites share a lowering; --no-jit calls the function under it, each
site on its own (what the engine's warm-up paid before).

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/j11/bin/python scripts/compile_sites.py \
        --sites 1,32 [--kernel mgpu_w4|pallas_w4] [--no-jit]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")     # compile only: no GPU runtime
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def kernel_fn(kind: str, jitted: bool, n: int, k: int):
    """(x [M, K] bf16, weight bytes, its scales...) -> [M, N] for the named kernel, and
    the shapes of a call's weight operands (the Mosaic kernel's scales packed)."""
    import jax
    import jax.numpy as jnp
    sd = jax.ShapeDtypeStruct
    if kind == "mgpu_w4":
        from pallas_kernels import w4a16_mgpu as w4
        fn = w4.w4a16_matmul if jitted else w4.w4a16_matmul.__wrapped__
        return (lambda x, wq, sz: fn(x, w4.as_int4(wq), sz),
                [sd((n, k // 2), jnp.uint8), sd((2 * k // 128, n), jnp.bfloat16)])
    from pallas_kernels import quant_matmul as qmm
    fn = qmm.quant_matmul_int4 if jitted else qmm.quant_matmul_int4.__wrapped__
    return (lambda x, wq, s, z: fn(x, wq, s, z, group=128),
            [sd((n, k // 2), jnp.uint8)] + [sd((n, k // 128), jnp.float32)] * 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", default="1,32", help="call-site counts, comma-separated")
    ap.add_argument("--kernel", default="mgpu_w4", choices=("mgpu_w4", "pallas_w4"))
    ap.add_argument("--no-jit", action="store_true", help="each call site on its own")
    ap.add_argument("--target", default=os.path.join(ROOT, "configs/gpu_targets/h200.txtpb"))
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jaxllm.runner import aot
    with open(args.target) as f:
        mesh = aot.target_mesh(f.read())
    n, k, m = 28672, 4096, 16
    mm, weight = kernel_fn(args.kernel, not args.no_jit, n, k)
    sd = jax.ShapeDtypeStruct
    per = len(weight)
    print(f"{args.kernel}, {'each site on its own' if args.no_jit else 'one jit'}, "
          f"jax {jax.__version__}")
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        for sites in (int(v) for v in args.sites.split(",")):
            def chain(x, *ws):
                for i in range(sites):
                    x = x + mm(x, *ws[per * i:per * (i + 1)])[:, :k].astype(x.dtype)
                return x
            shapes = aot.on_mesh([sd((m, k), jnp.bfloat16)] + weight * sites, mesh)
            t0 = time.perf_counter()
            lowered = jax.jit(chain).lower(*shapes)
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            print(f"{sites:>4} call sites: lower {t1 - t0:6.2f} s, compile {t2 - t1:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
