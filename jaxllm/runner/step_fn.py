"""The model runner's jitted functions: one model step, and sampling into the device's
buffer of the last step's tokens.

Letter legend: T padded tokens, S padded sequences, E hidden size, K top logprobs,
M the largest sequence bucket.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.layers.quantization.linear import WEIGHT_ONLY_ROWS
from jaxllm.runner.sampler import compute_logprobs, sample
from jaxllm.runner.step_inputs import StepInputs
from jaxllm.sampling_params import MAX_LOGPROBS
from pallas_kernels.common import target_platform


def forward(graphdef, treedef, spec, hidden_layers, leaves, kv_caches, token_buf,
            inputs: StepInputs, logits_buf=None, target_ids=None):
    """One step: (logits [S, V], kv_caches), the logits written into `logits_buf`
    f32[S, V] when given (donated: see LogitsBuffers), then with target_ids i32[T] (each token's
    successor) the raw prompt logprobs (logprob [T], rank [T], top ids [T, K], top
    logprobs [T, K]), then with `hidden_layers` not None (an EAGLE head drafts) the
    states it reads, one row per input token: () the final hidden state [T, E] (after
    the norm; EAGLE-1), else the residual streams entering those layers [T, n*E]
    (EAGLE-3). input_ids < 0 name rows of token_buf i32[M] (the previous step's
    samples)."""
    input_ids, positions, md, logits_indices = inputs.unpack()
    input_ids = jnp.where(input_ids < 0, token_buf[jnp.maximum(-input_ids - 1, 0)], input_ids)
    # The step takes the parameters as a flat list: flattening an NNX State and
    # hashing a static graphdef on every call cost milliseconds of host time per step.
    model = nnx.merge(graphdef, treedef.unflatten(leaves))     # (or a PackedLayout)
    if hidden_layers:
        hidden, kv_caches, states = model(input_ids, positions, kv_caches, md, spec,
                                          aux_layers=hidden_layers)
    else:
        hidden, kv_caches = model(input_ids, positions, kv_caches, md, spec)
        states = hidden
    logits = model.compute_logits(hidden[logits_indices])
    if logits_buf is not None:
        logits = jax.lax.dynamic_update_slice(logits_buf, logits, (0, 0))
    out = (logits, kv_caches)
    if target_ids is not None:
        out += (compute_logprobs(model.compute_logits(hidden), target_ids, MAX_LOGPROBS),)
    if hidden_layers is not None:
        out += (states,)
    return out


def sample_into(logits, md, flags, token_buf, bitmask=None):
    """(token_buf with the sampled ids, SamplerOutput): the ids stay on the device for
    the next step's inputs. token_buf is donated (the same buffer every step, see
    LogitsBuffers) and comes first: jax gives a donated buffer to the first output of
    its shape, and the sampled ids of a full-width step have token_buf's."""
    out = sample(logits, md, flags, bitmask)
    return jax.lax.dynamic_update_slice(token_buf, out.token_ids, (0,)), out


class LogitsBuffers:
    """The model step's logits, written in place: one f32[S, V] buffer per sequence
    bucket, donated to the bucket's next step (the sampler reads it before then; both
    run in order on the device), as the sampler's token buffer is donated to the next
    sampler. XLA runs each program as a CUDA graph and, before a launch, records again
    every command that reads a buffer whose address changed. On the H200, with a new
    logits and token buffer every step, every launch of the engine's decode step
    recorded all its commands again (424: 0.57 ms of host time at batch 1; 360: 1.1 ms
    at 256 rows); with these buffers and InputStager's, none at batch 1, and still most
    at 256 rows, where one allocation still moves, likely the step's temporary buffer
    (scripts/cmdbuf_updates.py --vlog). The buffers beside the largest bucket's (which
    the step's compiled peak holds) are counted in the KV sizing (extra_bytes)."""

    def __init__(self, vocab_size: int, sharding, plan):     # plan: a BucketPlan
        self.vocab_size, self.sharding = vocab_size, sharding
        self.seq_buckets = plan.seq_buckets
        self.buffers: dict[int, jax.Array] = {}

    def spec(self, s: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((s, self.vocab_size), jnp.float32, sharding=self.sharding)

    def take(self, s: int) -> jax.Array:
        """The bucket's buffer, for a step to donate (zeros the first time)."""
        buf = self.buffers.pop(s, None)
        if buf is None:     # made by the runtime (an upload may be host memory it keeps)
            buf = jnp.zeros((s, self.vocab_size), jnp.float32, device=self.sharding)
        return buf

    def put(self, s: int, logits: jax.Array) -> None:
        self.buffers[s] = logits

    def extra_bytes(self) -> int:
        """Device bytes of every bucket's buffer but the largest."""
        return self.total_bytes() - 4 * self.vocab_size * max(self.seq_buckets)

    def total_bytes(self) -> int:
        """Device bytes of every bucket's buffer (per device: they are replicated)."""
        return 4 * self.vocab_size * sum(self.seq_buckets)


def dummy_arrays(t: int, s: int, max_blocks_per_seq: int) -> dict:
    """Padding inputs of one step shape: no KV slot written, no sequence read."""
    return dict(
        input_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
        slot_mapping=np.full(t, -1, np.int32),
        block_tables=np.zeros((s, max_blocks_per_seq), np.int32),
        seq_lens=np.zeros(s, np.int32), query_start_loc=np.zeros(s + 1, np.int32),
        logits_indices=np.zeros(s, np.int32))


def step_compiler_options(leaves, tokens: int) -> dict | None:
    """XLA options for the model step of `tokens` padded tokens. With fp8 / int8
    weights on a GPU, XLA's dot merger is left out: merging the q and k/v projections
    (they share their input) concatenates their quantized weights on every step,
    which cuBLASLt cannot read in place (on the H200 a 21 us copy per layer of the fp8
    decode step, 0.68 of its 4.2 ms). Steps larger than WEIGHT_ONLY_ROWS (for the
    weights' dtype) also leave out XLA's Triton GEMMs: their autotuning took 2-21 s
    per fp8 / int8 dot on the H200, minutes per engine start, while cuBLASLt alone
    compiles each in ~0.2 s and runs them at 1,000-1,120 TFLOP/s at 4,096 tokens.
    Smaller steps run the layers weight-only (linear.use_weight_only): 16-bit dots
    whose Triton GEMMs widen the narrow weight in registers."""
    if target_platform() != "gpu":
        return None
    kinds = {_QUANTIZED.get(str(x.dtype)) for x in jax.tree.leaves(leaves)} - {None}
    if not kinds:
        return None
    if tokens <= max(WEIGHT_ONLY_ROWS[k] for k in kinds):
        return {"xla_gpu_dot_merger_threshold_mb": 0}
    return {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}


_QUANTIZED = {"float8_e4m3fn": "fp8", "int8": "int8"}


class StepJits:
    """The jitted model step, one jit per set of XLA options (step_compiler_options
    picks them by the step's padded token count)."""

    def __init__(self, forward, leaves, out_shardings):
        self.forward, self.leaves, self.out_shardings = forward, leaves, out_shardings
        self.jits: dict = {}          # (prompt, options) -> jit
        self.by_size: dict = {}       # (tokens, prompt) -> jit: a step's lookup, no scan

    def __call__(self, tokens: int, prompt: bool = False):
        """The jit for a step of `tokens`. `prompt`: for the rare steps with
        prompt_logprobs requests, which return a new logits array instead of writing
        the donated LogitsBuffers one."""
        jitted = self.by_size.get((tokens, prompt))
        if jitted is None:
            options = step_compiler_options(self.leaves, tokens)
            key = (prompt, tuple(sorted(options.items())) if options else None)
            if key not in self.jits:
                kw = (dict(donate_argnums=(1,)) if prompt else  # the pool (, LogitsBuffers)
                      dict(donate_argnums=(1, 4), out_shardings=self.out_shardings))
                self.jits[key] = jax.jit(self.forward, compiler_options=options, **kw)
            jitted = self.by_size[(tokens, prompt)] = self.jits[key]
        return jitted

    def describe(self, token_buckets) -> str:
        """The options of each bucket's step (part of the executable store's key)."""
        options = [step_compiler_options(self.leaves, t) for t in token_buckets]
        return f"step compiler options {options}"
