"""The step's packed inputs unpack to the arrays they were made from."""
from __future__ import annotations

import jax
import numpy as np

from jaxllm.runner.step_inputs import StepInputs


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(0)
    t, s, w = 16, 4, 7
    arrays = dict(
        input_ids=rng.integers(-5, 300, t).astype(np.int32),
        positions=rng.integers(0, 99, t).astype(np.int32),
        slot_mapping=rng.integers(-1, 500, t).astype(np.int32),
        block_tables=rng.integers(0, 60, (s, w)).astype(np.int32),
        seq_lens=rng.integers(0, 99, s).astype(np.int32),
        query_start_loc=np.sort(rng.integers(0, t, s + 1)).astype(np.int32),
        logits_indices=rng.integers(0, t, s).astype(np.int32))
    inputs = StepInputs.pack(arrays, True, jax.devices()[0])
    assert inputs.packed.shape == (3 * t + s * w + 3 * s + 1,)
    input_ids, positions, md, logits_indices = jax.jit(lambda x: x.unpack())(inputs)
    got = dict(input_ids=input_ids, positions=positions, slot_mapping=md.slot_mapping,
               block_tables=md.block_tables, seq_lens=md.seq_lens,
               query_start_loc=md.query_start_loc, logits_indices=logits_indices)
    for k, v in arrays.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)
    assert md.decode_only is True
    # The static layout is part of the tree structure: another bucket is another program.
    other = StepInputs.pack(dict(arrays, block_tables=arrays["block_tables"][:2]), True,
                            jax.devices()[0])
    assert jax.tree.structure(other) != jax.tree.structure(inputs)


def test_put_replicated_matches_device_put_without_it(monkeypatch):
    """The step's upload is jax.device_put's result, reached without device_put's Python
    layers (a fallback to device_put would hide a broken fast path: it is disabled)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxllm.runner.step_inputs import put_replicated
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("tp",)), P())
    x = np.arange(37, dtype=np.int32)
    want = jax.device_put(x, sharding)

    def no_device_put(*a, **k):
        raise AssertionError("put_replicated fell back to jax.device_put")

    monkeypatch.setattr(jax, "device_put", no_device_put)
    got = put_replicated(x, sharding)
    assert got.sharding == want.sharding and got.committed and got.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(got), x)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a * 2)(got)), 2 * x)


def test_put_replicated_leaves_other_dtypes_to_device_put(monkeypatch):
    """Only int32 takes the direct call; another dtype gets device_put's own handling
    (dtype canonicalization), so the array is exactly device_put's."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxllm.runner import step_inputs
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("tp",)), P())
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or real(*a, **k))
    got = step_inputs.put_replicated(np.arange(4, dtype=np.int64), sharding)
    assert calls and got.dtype == real(np.arange(4, dtype=np.int64), sharding).dtype
