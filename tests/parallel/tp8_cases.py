"""Tensor parallelism on 8 CPU devices: TP = 2, 4, 8 against TP = 1 through the real
engine (`LLM.generate`), plus the shardings of every weight, of the KV pool and of
the jitted step's outputs, and the step's collectives.

Not collected on its own (the name has no `test_` prefix): test_tensor_parallel.py
runs it with pytest in a child process whose XLA_FLAGS give it 8 host devices.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest

if "device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    pytest.skip("needs 8 host devices (run through test_tensor_parallel.py)",
                allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxllm import LLM  # noqa: E402
from jaxllm.config import ConfigError  # noqa: E402
from jaxllm.layers.attention import AttentionMetadata, AttentionSpec, paged_attention  # noqa: E402
from jaxllm.models import loader  # noqa: E402
from jaxllm.parallel import mesh as mesh_lib  # noqa: E402
from tp_util import ENGINE, generate_greedy, make_tp_model  # noqa: E402

ARCHS = ["llama", "qwen3"]
TPS = [2, 4, 8]


@dataclass
class Run:
    llm: LLM
    tokens: list[list[int]]
    logits: list[np.ndarray]    # per step: the gathered logits the sampler saw [S, V]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(arch, tp) -> Run: greedy generation, cached per (arch, tp)."""
    folders, runs = {}, {}

    def get(arch: str, tp: int) -> Run:
        if arch not in folders:
            folders[arch] = make_tp_model(str(tmp_path_factory.mktemp(arch)), arch)
        if (arch, tp) not in runs:
            llm = LLM(folders[arch], tensor_parallel_size=tp, **ENGINE)
            runs[arch, tp] = Run(llm, *generate_greedy(llm))
        return runs[arch, tp]

    return get


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_tokens_match_tp1(run, arch, tp):
    ref, ours = run(arch, 1), run(arch, tp)
    assert ours.tokens == ref.tokens
    assert len(ours.logits) == len(ref.logits)
    for step, (a, b) in enumerate(zip(ours.logits, ref.logits)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=f"step {step}")


def _expected_spec(name: str, arch, tp: int) -> P:
    """Every weight's layout, written out: heads and MLP columns split, the residual
    stream whole; a dimension that `tp` does not divide stays whole."""
    t = "tp"
    vocab = t if arch.vocab_size % tp == 0 else None
    kv = t if arch.num_kv_heads % tp == 0 else None
    leaf = name.split(".")[-1]
    table = {
        "embed_tokens": P(vocab, None), "lm_head": P(None, vocab),
        "q_proj": P(None, t, None), "kv_proj": P(None, None, kv, None),
        "o_proj": P(t, None, None), "gate_up_proj": P(None, None, t), "down_proj": P(t, None),
        "weight": P(None),    # the RMSNorm scales, q_norm and k_norm included
    }
    return table[leaf]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("arch", ARCHS)
def test_weight_and_kv_pool_shardings(run, arch, tp):
    engine = run(arch, tp).llm.llm_engine
    mesh, a = engine.executor.mesh, engine.arch
    assert mesh.shape == {"tp": tp}
    flat = nnx.to_flat_state(engine.runner.state)
    assert len(flat) > 0
    for path, var in flat:
        name = loader.param_path(path)
        value = var.get_value()
        want = NamedSharding(mesh, _expected_spec(name, a, tp))
        assert value.sharding.is_equivalent_to(want, value.ndim), (name, value.sharding.spec)
        split = [i for i, ax in enumerate(want.spec) if ax == "tp"]
        for shard in value.addressable_shards:   # each device holds only its slice
            shape = list(value.shape)
            for i in split:
                shape[i] //= tp
            assert shard.data.shape == tuple(shape), name
    heads = max(a.num_kv_heads, tp)       # replicated KV heads: one per device
    for k, v in engine.runner.kv_caches:
        for pool in (k, v):
            assert pool.shape[0] == heads
            assert pool.sharding.is_equivalent_to(NamedSharding(mesh, P("tp")), 4)
            assert pool.addressable_shards[0].data.shape[0] == heads // tp


def _collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for m in re.finditer(r"= \w+\[([\d,]*)\][^ ]* (all-reduce|all-gather|all-to-all|"
                         r"collective-permute|reduce-scatter)(?:-start)?\(", hlo):
        out.append((m.group(2), tuple(int(x) for x in m.group(1).split(",") if x)))
    return out


@pytest.mark.parametrize("arch,tp", [("llama", 4), ("qwen3", 8)])
def test_step_outputs_and_collectives(run, arch, tp):
    """The decode step, compiled: logits replicated, the pool split by head, and only
    Megatron's collectives: an all-reduce of the [T, E] residual after each attention
    and MLP (and after the vocab-split embedding lookup), one all-gather of the
    [S, V] logits. Nothing gathers a weight."""
    runner = run(arch, tp).llm.llm_engine.runner
    a, s = runner.arch, 4
    arrays = dict(input_ids=np.zeros(s, np.int32), positions=np.zeros(s, np.int32),
                  slot_mapping=np.full(s, -1, np.int32),
                  block_tables=np.zeros((s, runner.max_blocks_per_seq), np.int32),
                  seq_lens=np.zeros(s, np.int32), query_start_loc=np.zeros(s + 1, np.int32),
                  logits_indices=np.zeros(s, np.int32))
    compiled = runner.lower_step(arrays, True).compile()
    logits_sharding, kv_shardings = compiled.output_shardings
    assert logits_sharding.is_fully_replicated
    for sh in jax.tree.leaves(kv_shardings):
        assert sh.is_equivalent_to(NamedSharding(runner.mesh, P("tp")), 4)
    vocab_split = a.vocab_size % tp == 0
    want = [("all-reduce", (s, a.hidden_size))] * (2 * a.num_layers + vocab_split)
    want += [("all-gather", (s, a.vocab_size))] * vocab_split
    assert sorted(_collectives(compiled.as_text())) == sorted(want)


def test_dummy_weights_are_built_in_shards(monkeypatch):
    """`load_format=dummy` generates each device's slice only: no array in the build
    program is larger than the largest per-device shard."""
    from jaxllm.models.registry import ArchConfig
    arch = ArchConfig("LlamaForCausalLM", vocab_size=512, hidden_size=32, num_layers=1,
                      num_heads=8, num_kv_heads=2, head_dim=8, intermediate_size=64)
    mesh = mesh_lib.make_mesh(4)
    programs = []
    real_jit = jax.jit

    def spy(fun, **kw):    # compile the sharded build once, keeping its program text
        jitted = real_jit(fun, **kw)
        if "out_shardings" not in kw:
            return jitted

        def call(*args):
            compiled = jitted.lower(*args).compile()
            programs.append(compiled.as_text())
            return compiled(*args)
        return call

    monkeypatch.setattr(jax, "jit", spy)
    _, state = loader.dummy_state(arch, jnp.float32, mesh_lib.param_shardings(mesh))
    monkeypatch.undo()
    largest = max(int(np.prod(x.addressable_shards[0].data.shape)) for x in jax.tree.leaves(state))
    assert max(x.size for x in jax.tree.leaves(state)) > largest   # a full copy would show
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
             for dims in re.findall(r"\b(?:f32|u32|u64|s32|bf16)\[([\d,]+)\]", programs[0])]
    assert max(sizes) <= largest


def test_bad_tensor_parallel_size_names_the_flag(run):
    folder = run("llama", 1).llm.llm_engine.model_path
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 .* use one of 1, 2, 4, 8"):
        LLM(folder, tensor_parallel_size=3, **ENGINE)


@pytest.mark.parametrize("backend,tp", [("pallas", 4)])
def test_attention_per_shard_matches_unsharded(backend, tp):
    """paged_attention under shard_map (the pallas kernels in interpret mode) against
    the unsharded reference: outputs, and every KV write of every pool head."""
    rng = np.random.default_rng(0)
    t, hq, hkv, d, nb, bs = 16, 8, 2, 16, 12, 8
    q, k, v = (rng.standard_normal((t, h, d), np.float32) for h in (hq, hkv, hkv))
    k_cache, v_cache = (rng.standard_normal((hkv, nb, bs, d), np.float32) for _ in "kv")
    q_lens, seq_lens = [5, 3, 6], [10, 3, 20]
    tables = np.array([[3, 7, 0], [1, 0, 0], [2, 5, 9], [0, 0, 0]], np.int32)
    slots, qsl = [], [0]
    for row, (n, total) in enumerate(zip(q_lens, seq_lens)):
        pos = np.arange(total - n, total)
        slots += list(tables[row, pos // bs] * bs + pos % bs)
        qsl.append(qsl[-1] + n)
    slots += [-1] * (t - len(slots))
    md = AttentionMetadata(jnp.array(slots, jnp.int32), jnp.array(tables),
                           jnp.array(seq_lens + [0], jnp.int32),
                           jnp.array(qsl + [qsl[-1]], jnp.int32))
    attend = jax.jit(paged_attention, static_argnums=(6,))
    spec = AttentionSpec(sm_scale=d ** -0.5)
    ref_out, ref_k, ref_v = attend(q, k, v, k_cache, v_cache, md, spec)
    mesh = mesh_lib.make_mesh(tp)
    heads = mesh_lib.pool_kv_heads(hkv, tp)
    kv_of_pool_head = np.arange(heads) * hkv // heads
    pool = NamedSharding(mesh, P("tp"))
    out, new_k, new_v = attend(
        q, k, v, jax.device_put(k_cache[kv_of_pool_head], pool),
        jax.device_put(v_cache[kv_of_pool_head], pool), md,
        AttentionSpec(sm_scale=d ** -0.5, backend=backend, interpret=True, mesh=mesh))
    n = qsl[-1]
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(ref_out)[:n], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_k), np.asarray(ref_k)[kv_of_pool_head])
    np.testing.assert_array_equal(np.asarray(new_v), np.asarray(ref_v)[kv_of_pool_head])
