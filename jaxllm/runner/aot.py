"""The model step compiled for a GPU this machine does not have: XLA's deviceless
ahead-of-time compilation, given the GPU's target description (a
``stream_executor.GpuTargetConfigProto`` in text form, configs/gpu_targets/). It shows
what XLA makes of a step for that GPU (its fusions, Triton GEMMs, Pallas calls: the
kernels one launch runs) on a CPU-only machine. Needs jax's CUDA plugin installed
(``pip install "jax[cuda13]==<jax's version>"``); no driver, no device. XLA's autotuner cannot run
without the device, so GEMM tilings (and split-K) are XLA's defaults, not the tuned ones.

    mesh = aot.target_mesh(open("configs/gpu_targets/h200.txtpb").read())
    compiled = aot.lower_step(runner, mesh, arrays, decode_only).compile()
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter

import jax
from jax.sharding import NamedSharding

from jaxllm.parallel.mesh import TP
from jaxllm.runner.step_fn import StepJits, forward

# Entry-computation instructions that run no kernel (views, tuples, constants; an async
# copy is a memcpy).
NOT_KERNELS = frozenset({"parameter", "bitcast", "get-tuple-element", "tuple", "constant",
                         "copy-start", "copy-done", "after-all"})
# Instructions whose kernels are in another computation: counted there, not here.
NESTED = ("while", "conditional", "call", "async-start", "async-update", "async-done")


def target_mesh(target_config: str) -> jax.sharding.Mesh:
    """A one-device mesh of the GPU `target_config` describes, on its own topology (its
    device is not addressable: compile only). Raises RuntimeError naming the plugin
    when jax has no CUDA plugin to describe it."""
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                                topology="1x1x1")
    except (NotImplementedError, RuntimeError) as e:
        raise RuntimeError("deviceless GPU compilation needs jax's CUDA plugin "
                           f"(pip install \"jax[cuda13]\"): {e}") from None
    return topologies.make_mesh(topology, (1,), (TP,))


def lower_step(runner, mesh, arrays: dict, decode_only: bool):
    """`runner`'s step for host `arrays`, lowered for `mesh`'s devices: its arguments'
    shapes with their shardings moved onto `mesh`, attention through the Pallas kernels
    (compiled, not interpreted), every choice made for the target's platform
    (pallas_kernels.common.target_platform)."""
    if runner.mesh.size != 1:
        raise ValueError("deviceless lowering takes a one-device runner (tensor_parallel_size 1)")
    spec = dataclasses.replace(runner.spec, backend="pallas", interpret=False, mesh=mesh)
    args = on_mesh(runner.step_args(arrays, decode_only), mesh)
    step = functools.partial(forward, runner.graphdef, runner.param_layout, spec,
                             runner.hidden_layers)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        jits = StepJits(step, runner.params, on_mesh(runner.out_shardings(), mesh))
        return jits(len(arrays["input_ids"])).lower(*args)


def on_mesh(tree, mesh):
    """Arrays and shapes as shapes, shardings as shardings, each moved onto `mesh` (an
    array without a NamedSharding: whole on every device)."""
    def move(x):
        if isinstance(x, NamedSharding):
            return NamedSharding(mesh, x.spec)
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            spec = getattr(x.sharding, "spec", jax.sharding.PartitionSpec())
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        return x
    return jax.tree.map(move, tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def entry_kernels(hlo_text: str) -> list[tuple[str, str]]:
    """(instruction name, kind) of each kernel the compiled module's entry computation
    launches, in order: kind is the fusion's backend kind ("__triton_nested_gemm_fusion",
    "__triton", "kLoop", ...), a custom call's target ("__gpu$xla.gpu.triton" for a
    Pallas kernel, "__cublas$lt$matmul$f8", ...), else the op. Raises ValueError on a
    loop, conditional, call or async op, whose kernels this does not follow."""
    out = []
    for line in hlo_text[hlo_text.index("\nENTRY"):].splitlines()[2:]:
        if line.strip() == "}":
            break
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*? ([\w-]+)\(", line)
        if not m or m.group(2) in NOT_KERNELS:
            continue
        kind = m.group(2)
        if kind in NESTED:
            raise ValueError(f"{kind} in the entry computation ({m.group(1)}): its kernels "
                             "are not counted")
        if kind == "fusion":
            backend = re.search(r'"kind":"([^"]+)"', line)
            kind = backend.group(1) if backend else re.search(r"kind=(\w+)", line).group(1)
        elif kind == "custom-call":
            kind = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        out.append((m.group(1), kind))
    return out


def kernel_counts(hlo_text: str) -> Counter:
    """How many kernels of each kind entry_kernels finds."""
    return Counter(kind for _, kind in entry_kernels(hlo_text))
