"""What a quantized linear layer holds and computes, as static (hashable) settings;
no jax here, so the launcher can check a checkpoint without starting a backend.

A LinearScheme says how one jaxllm projection (q_proj, kv_proj or both as qkv_proj,
o_proj, gate_up_proj, down_proj) stores its weight and quantizes its input. A
QuantConfig maps every projection of the model to its scheme (None = left in the float
dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxllm.env_switch import env_switch
from jaxllm.layers.quantization.rotation import ROTATION_BLOCK

# Largest finite float8_e4m3fn value, and the int8 range used symmetrically (vLLM's
# scaled_int8_quant divides by 127 and clamps to [-128, 127]).
FP8_MAX = 448.0
INT8_MAX = 127.0

WEIGHT_DTYPES = ("fp8", "int8", "uint4", "uint8")
# Weight-only integer kinds (AWQ, GPTQ, compressed-tensors pack-quantized): unsigned
# values with a zero point per group, dequantized as (q - zero) * scale.
GROUPED = ("uint4", "uint8")

# Online quantization (--quantization on a float checkpoint) and the methods a
# checkpoint's quantization_config may name.
ONLINE_METHODS = ("fp8", "int8")
CHECKPOINT_METHODS = ("compressed-tensors", "fp8", "awq", "gptq")
# vLLM's other names for what jaxllm runs: its Marlin-kernel forms of AWQ and GPTQ
# checkpoints, and its per-token / per-channel online FP8 (jaxllm's online fp8 scheme).
CHECKPOINT_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
ONLINE_ALIASES = {"ptpc_fp8": "fp8"}


@dataclass(frozen=True)
class ActScheme:
    """How a layer's input is quantized before the matmul."""
    dtype: str                  # fp8 | int8
    dynamic: bool = True        # per token (or token group) in the layer; else a stored scale
    group_size: int | None = None   # dynamic scales per token and K group (block FP8)
    # int8 per token only: False = a zero point per token as well (vLLM's azp), so a
    # token's range [min, max] takes all 256 levels instead of [-amax, amax].
    symmetric: bool = True


@dataclass(frozen=True)
class LinearScheme:
    """weight: fp8 | int8, stored [N..., K...] (contracting K on both sides is what
    reaches cuBLASLt's fp8/int8 GEMMs). Scales: one per output channel (a checkpoint's
    per-tensor scale is broadcast to its channels, which is exact), or per
    block (bn, bk) of the 2-D [N, K] weight, stored repeated per row: [N..., K/bk].
    act: None = weight only (the weight is dequantized for a float matmul).
    uint4 / uint8 (weight only): scales and zero points per `group` columns of the
    flattened K, [N..., K/group]; uint4 packed two to a byte along K; `g_idx`: a
    stored column -> group map (GPTQ's act order) instead of column // group.
    zero_point: True only for compressed-tensors pack-quantized asymmetric weights,
    whose weight_zero_point tensors are then required (GPTQ and AWQ always store
    theirs; symmetric pack-quantized weights take the midpoint).
    rotate: the largest block of the Hadamard rotation applied to the weight's K at
    load and to the input in the layer (rotation.py; online int8), 0 = none.
    packed: uint4 group scales and zero points stored as one bf16 [2 K/G, N] for the
    Mosaic W4A16 kernel where it takes the projection's shape (int4_kernels.py)."""
    weight: str
    block: tuple[int, int] | None = None
    act: ActScheme | None = None
    group: int | None = None
    g_idx: bool = False
    rotate: int = 0
    zero_point: bool = False
    packed: bool = False

    def __post_init__(self):
        if self.weight not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype {self.weight!r}")

    def describe(self) -> str:
        if self.group is not None:
            per = "per channel" if self.group >= 1 << 30 else f"in groups of {self.group}"
            order = ", act order" if self.g_idx else ""
            return f"{self.weight[4:]}-bit weights {per}{order}, float activations"
        w = (f"{self.weight} weights per {self.block[0]}x{self.block[1]} block" if self.block
             else f"{self.weight} weights per channel")
        a = self.act
        if a is None:
            return w + ", float activations"
        how = (f"per token and {a.group_size}-group" if a.group_size else
               "per token" if a.dynamic else "static per tensor")
        how += "" if a.symmetric else ", asymmetric"
        how += f", K rotated in Hadamard blocks of up to {self.rotate}" if self.rotate else ""
        return f"{w}, {a.dtype} activations {how}"


@dataclass(frozen=True)
class QuantConfig:
    """method: the --quantization name; online: quantize float weights at load.
    schemes: (jaxllm module path, scheme) for every quantized projection, e.g.
    ("layers.0.self_attn.q_proj", LinearScheme("fp8", ...))."""
    method: str
    online: bool
    schemes: tuple[tuple[str, LinearScheme], ...]
    # How uint4 / uint8 weights are packed: awq, gptq (zeros stored minus one),
    # gptq_v2, or pack (compressed-tensors pack-quantized); "" for the 8-bit formats.
    layout: str = ""
    # compressed-tensors kv_cache_scheme: each layer's self_attn.k_scale / v_scale, the
    # per-tensor scales of an fp8 KV cache (used with --kv-cache-dtype fp8).
    kv_scales: bool = False

    def scheme(self, path: str) -> LinearScheme | None:
        return dict(self.schemes).get(path)

    def describe(self) -> str:
        kinds = sorted({s.describe() for _, s in self.schemes})
        how = "quantized at load" if self.online else "from the checkpoint"
        # The checkpoint's linear layers (q, k and v three), in the matmuls they run as.
        hf = sum(next((len(v) for k, v in HF_PARTS.items() if m.endswith("." + k)), 1)
                 for m, _ in self.schemes)
        return (f"{self.method}, {how}: {hf} linear layers in {len(self.schemes)} matmuls, "
                f"{'; '.join(kinds)}")


# jaxllm projection -> (HF module names it is made of, relative to model.layers.{i}).
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "self_attn.q_proj": ("self_attn.q_proj",),
    "self_attn.kv_proj": ("self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


# Quantized q and k/v projections of one scheme are one matmul, as vLLM's qkv_proj:
# they share their input, and XLA's dot merger would otherwise copy both weights into
# one array every step (cuBLASLt and the 4-bit kernel cannot read the pieces in place)
# or, without the merger, run two GEMMs and two kernels to read their outputs.
QKV = "self_attn.qkv_proj"
HF_PARTS: dict[str, tuple[str, ...]] = {
    **PROJECTIONS, QKV: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}


def fuse_qkv(schemes) -> tuple[tuple[str, LinearScheme], ...]:
    """(module, scheme) pairs with each layer's q_proj and kv_proj, where their schemes
    are equal, replaced by one qkv_proj."""
    by_module = dict(schemes)
    out = []
    for module, scheme in schemes:
        layer, _, proj = module.partition(".self_attn.")
        if proj not in ("q_proj", "kv_proj") or by_module.get(
                f"{layer}.self_attn.q_proj") != by_module.get(f"{layer}.self_attn.kv_proj"):
            out.append((module, scheme))
        elif proj == "q_proj":
            out.append((f"{layer}.{QKV}", scheme))
    return tuple(out)


def unfuse_qkv(schemes) -> tuple[tuple[str, LinearScheme], ...]:
    """fuse_qkv undone: each qkv_proj back to q_proj and kv_proj."""
    out = []
    for module, scheme in schemes:
        layer, _, proj = module.partition(".self_attn.")
        out += ([(f"{layer}.self_attn.q_proj", scheme), (f"{layer}.self_attn.kv_proj", scheme)]
                if proj == "qkv_proj" else [(module, scheme)])
    return tuple(out)


def uniform_config(method: str, num_layers: int, scheme: LinearScheme,
                   online: bool) -> QuantConfig:
    """Every projection of every layer in one scheme."""
    return QuantConfig(method, online, fuse_qkv(
        [(f"layers.{i}.{p}", scheme) for i in range(num_layers) for p in PROJECTIONS]))


def online_scheme(method: str) -> LinearScheme:
    """vLLM's online FP8 (and its int8 twin): per-channel weights quantized at load,
    per-token activation scales computed in the layer. int8 activations also get a
    zero point per token (vLLM's asymmetric W8A8 int8): the inputs of q/k/v and
    gate/up carry one-signed outlier channels (amax ~20x the rms in SmolLM2), and a
    symmetric range wastes half the levels on the side they do not reach; on
    SmolLM2-135M that took int8 from +4.3% perplexity to +2.2% (docs/benchmarks.md).
    fp8 has no zero point: its error is the e4m3 mantissa's, whatever the scale.
    int8 also rotates each layer's K in Hadamard blocks (rotation.py: +2.07% -> +0.37%
    there); fp8 does not (rotated, it lost more). JAXLLM_INT8_ROTATION=0 turns it off."""
    int8 = method == "int8"
    rotated = int8 and env_switch("JAXLLM_INT8_ROTATION", True)
    return LinearScheme(method, None, ActScheme(method, dynamic=True, symmetric=not int8),
                        rotate=ROTATION_BLOCK if rotated else 0)
