"""Lowering for CUDA on this CPU machine, for the tests that check what the GPU path
compiles to (Triton IR of the kernels, the quantized dots)."""
from __future__ import annotations

import jax


def lower_for_cuda(fn, *args) -> str:
    """Lowered text of jit(fn) for CUDA. jax >= 0.11 wants an abstract GPU mesh in
    context to lower for a platform this machine does not have; 0.10 takes either."""
    try:
        from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
        mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                            abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    except (ImportError, TypeError):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
