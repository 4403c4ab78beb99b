"""The model step's XLA options: W8A8 weights on a GPU leave XLA's dot merger out (it
copied the merged projections' quantized weights every step), and XLA's Triton GEMMs
out of steps larger than WEIGHT_ONLY_ROWS (their autotuning stalled an fp8 engine's
start on the H200); smaller steps keep them, as their layers run weight-only. Other
models keep XLA's defaults."""
import jax
import jax.numpy as jnp
import pytest

from jaxllm.layers.quantization.linear import WEIGHT_ONLY_ROWS
from jaxllm.runner import step_fn


@pytest.mark.parametrize("dtype,kind", [(jnp.float8_e4m3fn, "fp8"), (jnp.int8, "int8")])
def test_quantized_weights_on_a_gpu_leave_triton_gemms_out_of_large_steps(monkeypatch, dtype,
                                                                         kind):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    leaves = [jnp.ones((4, 4), jnp.bfloat16), jnp.ones((4, 4), dtype)]
    no_merger = {"xla_gpu_dot_merger_threshold_mb": 0}
    rows = WEIGHT_ONLY_ROWS[kind]
    assert step_fn.step_compiler_options(leaves, rows + 1) == {
        "xla_gpu_enable_triton_gemm": False, **no_merger}
    if rows:
        assert step_fn.step_compiler_options(leaves, rows) == no_merger
    # fp8 runs weight-only from the smallest bucket; int8 keeps W8A8 (cuBLASLt) at all.
    assert (step_fn.step_compiler_options(leaves, 16) == no_merger) == (kind == "fp8")


@pytest.mark.parametrize("tokens", [16, WEIGHT_ONLY_ROWS["fp8"] + 1])
def test_the_options_are_xla_debug_options(monkeypatch, tokens):
    """XLA parses them (a misspelt option fails compilation, here on the CPU)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    options = step_fn.step_compiler_options([jnp.ones((4, 4), jnp.float8_e4m3fn)], tokens)
    monkeypatch.undo()
    f = jax.jit(lambda a, b: (a @ b, a @ (b + 1)), compiler_options=options)
    x = jnp.ones((4, 4), jnp.float32)
    out = f.lower(x, x).compile()(x, x)
    assert float(out[1][0, 0]) == 8.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.uint8])
def test_float_and_packed_4bit_weights_keep_xla_defaults(monkeypatch, dtype):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for tokens in (16, 8192):
        assert step_fn.step_compiler_options([jnp.ones((4, 4), dtype)], tokens) is None


def test_cpu_keeps_defaults():
    assert step_fn.step_compiler_options([jnp.ones((4, 4), jnp.int8)], 16) is None


def test_step_jits_one_jit_per_option_set(monkeypatch):
    """Steps of sizes with the same options share one jit (one trace per shape);
    the two sides of WEIGHT_ONLY_ROWS get their own."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jits = step_fn.StepJits(lambda *a: a, [jnp.ones((4, 4), jnp.float8_e4m3fn)], None)
    rows = WEIGHT_ONLY_ROWS["fp8"]
    assert jits(16) is jits(rows)
    assert jits(16) is not jits(rows + 1)
    assert jits(16, prompt=True) is not jits(16)
    assert "'xla_gpu_enable_triton_gemm': False" in jits.describe((16, 8192))
