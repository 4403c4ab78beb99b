"""The model step's XLA options: W8A8 weights on a GPU leave XLA's Triton GEMMs out
(their autotuning stalled an fp8 engine's start on the H200) and its dot merger (it
copied the merged projections' quantized weights every step), others keep XLA's
defaults."""
import jax
import jax.numpy as jnp
import pytest

from jaxllm.runner import step_fn


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8])
def test_quantized_weights_on_a_gpu_leave_triton_gemms_out(monkeypatch, dtype):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    leaves = [jnp.ones((4, 4), jnp.bfloat16), jnp.ones((4, 4), dtype)]
    assert step_fn.step_compiler_options(leaves) == {"xla_gpu_enable_triton_gemm": False,
                                                     "xla_gpu_dot_merger_threshold_mb": 0}


def test_the_options_are_xla_debug_options(monkeypatch):
    """XLA parses them (a misspelt option fails compilation, here on the CPU)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    options = step_fn.step_compiler_options([jnp.ones((4, 4), jnp.float8_e4m3fn)])
    monkeypatch.undo()
    f = jax.jit(lambda a, b: (a @ b, a @ (b + 1)), compiler_options=options)
    x = jnp.ones((4, 4), jnp.float32)
    out = f.lower(x, x).compile()(x, x)
    assert float(out[1][0, 0]) == 8.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.uint8])
def test_float_and_packed_4bit_weights_keep_xla_defaults(monkeypatch, dtype):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert step_fn.step_compiler_options([jnp.ones((4, 4), dtype)]) is None


def test_cpu_keeps_defaults():
    assert step_fn.step_compiler_options([jnp.ones((4, 4), jnp.int8)]) is None
