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
