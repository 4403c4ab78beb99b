"""pallas_kernels/rotate_quant.py on the GPU against its reference twin: random bf16
rows with three outlier channels (as online int8's q/k/v inputs) at the Llama-3.1-8B
widths, one line a shape: how many int8 values differ from the reference and by how
much, which rows differ by more than one level (none expected: the dot's order of
sums moves a value at a rounding boundary by one level at most), the largest
relative scale difference, and how many zero points differ.

    python3 scripts/check_rotate_quant.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.layers.quantization.rotation import hadamard
    from pallas_kernels.rotate_quant import ref_rotate_quantize, rotate_quantize
    h = jnp.asarray(hadamard(64))
    interpret = jax.default_backend() == "cpu"
    worst = 0
    for t, k in [(8, 4096), (256, 4096), (256, 14336), (1024, 4096)]:
        rng = np.random.default_rng(t + k)
        x = rng.standard_normal((t, k)).astype(np.float32)
        x[:, rng.choice(k, 3, replace=False)] += 20.0
        x = jnp.asarray(x, jnp.bfloat16)
        q, s, z = jax.block_until_ready(rotate_quantize(x, h, interpret=interpret))
        rq, rs, rz = ref_rotate_quantize(x, h)
        d = np.abs(np.asarray(q, np.int32) - np.asarray(rq, np.int32))
        worst = max(worst, int(d.max()))
        print(t, k, "q!=", int((d > 0).sum()), "max", int(d.max()),
              "rows>1:", np.flatnonzero(d.max(1) > 1)[:8].tolist(),
              "s rel", float(np.max(np.abs(np.asarray(s) / np.asarray(rs) - 1))),
              "z!=", int((np.asarray(z) != np.asarray(rz)).sum()), flush=True)
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
