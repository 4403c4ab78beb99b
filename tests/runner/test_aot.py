"""Compiling for a GPU this machine lacks (jaxllm.runner.aot): the code that picks a
GPU path while tracing follows the platform being lowered for (an abstract GPU mesh in
context), not the machine's; compiled modules' kernels are read from their text."""
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.layers.quantization import linear
from jaxllm.runner import aot, step_fn
from pallas_kernels import common


def gpu_mesh(platform="gpu"):
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType
    return AbstractMesh((1,), ("tp",), (AxisType.Explicit,),
                        abstract_device=AbstractDevice("NVIDIA H200", 132, platform))


def test_gpu_choices_follow_the_platform_lowered_for():
    fp8 = [jnp.ones((4, 4), jnp.float8_e4m3fn)]
    assert common.target_platform() == "cpu"
    assert not linear.on_gpu() and not linear.native_dot()
    assert step_fn.step_compiler_options(fp8, 16) is None
    with jax.sharding.use_abstract_mesh(gpu_mesh()):
        assert common.target_platform() == "gpu"
        assert linear.on_gpu() and linear.native_dot()
        assert step_fn.step_compiler_options(fp8, 16) == {"xla_gpu_dot_merger_threshold_mb": 0}
        assert common.num_sms() == 132
        # What the layer then traces: the weight-only f16 dot of an fp8 decode step.
        assert linear.weight_only_dot_dtype(jnp.bfloat16, jnp.float8_e4m3fn) == jnp.float16
    assert linear.weight_only_dot_dtype(jnp.bfloat16, jnp.float8_e4m3fn) == jnp.bfloat16
    with jax.sharding.use_abstract_mesh(gpu_mesh("cuda")):      # a device named by vendor
        assert common.target_platform() == "gpu" and linear.on_gpu()


# Lines of a module XLA compiled for the H200 without one (scripts/aot_step.py),
# metadata and most backend configs cut; a cuBLAS call added as XLA writes them.
HLO = """\
%fused_select (p0: bf16[8,4096]) -> bf16[8,4096] {
  %inner = bf16[8,4096]{1,0} fusion(%p0), kind=kLoop, calls=%other
}

ENTRY %main.24 (leaves_0_.1: bf16[128256,4096], inputs_packed.1: s32[1100]) -> (f32[8,128256]) {
  %leaves_0_.1 = bf16[128256,4096]{1,0} parameter(0)
  %loop_select_fusion = bf16[8,1,4096]{2,1,0} fusion(%leaves_0_.1, %inputs_packed.1), kind=kLoop, calls=%fused_select
  %fusion.115 = f16[8,4096]{1,0} fusion(%loop_select_fusion, %leaves_1_.1), kind=kCustom, calls=%fused_computation.96, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton"}}
  %bitcast.5.0 = s32[8,128]{1,0} bitcast(%wrapped_slice)
  %constant_66_0 = f32[64]{0} constant({...})
  %gemm_fusion_dot.7 = f32[8,8,4096]{2,1,0} fusion(%bitcast.112.0, %bitcast.166.0), kind=kCustom, calls=%gemm_fusion_dot.7_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %pallas_call.12 = (bf16[65536,128]{1,0}, bf16[65536,128]{1,0}) custom-call(%wrapped_slice.2, %bitcast.11.0), custom_call_target="__gpu$xla.gpu.triton", operand_layout_constraints={s32[8]{0}, bf16[384,128]{1,0}}
  %pallas_call.16.0 = f32[4,256]{1,0} get-tuple-element(%pallas_call.15), index=1
  %cublas-lt-matmul.1 = (bf16[256,4096]{1,0}, s8[33554432]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"
  ROOT %tuple.5 = (f32[8,128256]{1,0}) tuple(%gemm_fusion_dot_general.17)
}
"""


def test_entry_kernels_reads_the_entry_computation_in_order():
    assert aot.entry_kernels(HLO) == [
        ("loop_select_fusion", "kLoop"), ("fusion.115", "__triton"),
        ("gemm_fusion_dot.7", "__triton_nested_gemm_fusion"),
        ("pallas_call.12", "__gpu$xla.gpu.triton"),
        ("cublas-lt-matmul.1", "__cublas$lt$matmul$f8")]
    assert aot.kernel_counts(HLO)["kLoop"] == 1


def test_entry_kernels_refuses_what_it_cannot_follow():
    loop = HLO.replace("  ROOT %tuple.5", "  %while.1 = (s32[]) while(%t), condition=%c, body=%b\n"
                       "  ROOT %tuple.5")
    with pytest.raises(ValueError, match="while in the entry computation"):
        aot.entry_kernels(loop)


def test_entry_kernels_of_a_compiled_cpu_module():
    text = jax.jit(lambda x: jnp.tanh(x @ x) + 1).lower(jnp.ones((8, 8))).compile().as_text()
    kernels = aot.entry_kernels(text)
    assert kernels and not any(k in aot.NOT_KERNELS for _, k in kernels)


def test_arguments_move_onto_the_target_mesh():
    a, b = Mesh(jax.devices()[:1], ("tp",)), Mesh(jax.devices()[-1:], ("tp",))
    x = jax.device_put(jnp.ones((4, 2)), NamedSharding(a, PartitionSpec("tp")))
    shape = jax.ShapeDtypeStruct((3,), jnp.int32, sharding=NamedSharding(a, PartitionSpec()))
    moved = aot.on_mesh((x, [shape, 7], NamedSharding(a, PartitionSpec())), b)
    assert isinstance(moved[0], jax.ShapeDtypeStruct) and moved[0].shape == (4, 2)
    assert moved[0].sharding.mesh is b and moved[0].sharding.spec == PartitionSpec("tp")
    assert moved[1][0].sharding.mesh is b and moved[1][1] == 7
    assert moved[2].mesh is b and moved[2].spec == PartitionSpec()


def test_target_mesh_is_the_described_gpu_or_an_error_naming_the_plugin():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "configs/gpu_targets/h200.txtpb")) as f:
        config = f.read()
    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match=r"CUDA plugin \(pip install \"jax\[cuda13\]\"\)"):
            aot.target_mesh(config)
        return
    device = aot.target_mesh(config).devices.flat[0]     # where the plugin is installed
    assert (device.platform, device.core_count) == ("gpu", 132)
