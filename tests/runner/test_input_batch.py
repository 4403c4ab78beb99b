"""input_batch.prepare_inputs: when a one-token step may run as decode-only with the
decode kernel writing the step's keys itself (no row may read another row's new key)."""
from jaxllm.engine.scheduler import ScheduledRequest
from jaxllm.runner import input_batch
from jaxllm.runner.buckets import BucketPlan

PLAN = BucketPlan.build(max_num_batched_tokens=64, max_num_seqs=8)


def _row(rid, pos, table=(1, 2)):
    return ScheduledRequest(rid, [5], pos, list(table), True, 1)


def _decode_only(rows, prev, own_keys_only):
    _, decode_only, _ = input_batch.prepare_inputs(rows, PLAN, 16, 4, prev,
                                                   rows_read_own_keys_only=own_keys_only)
    return decode_only


def test_continuing_rows_stay_decode_only():
    rows = [_row("a", 20), _row("b", 7, (3,))]
    assert _decode_only(rows, {"a": 0, "b": 1}, True)
    assert _decode_only(rows, {"a": 0, "b": 1}, False)


def test_a_row_admitted_this_step_takes_the_mixed_path():
    """'b' did not sample in the last step: admitted now, its prefix-cache hit may be a
    block that 'a' fills in this very step."""
    rows = [_row("a", 31), _row("b", 31)]             # same table: a full-prefix hit
    assert not _decode_only(rows, {"a": 0}, True)
    assert _decode_only(rows, {"a": 0}, False)       # the separate KV write: no matter


def test_speculative_verify_rows_take_the_mixed_path():
    rows, spec = input_batch.expand_spec_rows(
        [ScheduledRequest("a", [5, 6, 7], 20, [1, 2], True, 1, spec_token_ids=[6, 7])])
    assert spec is not None and len(rows) == 3
    assert not input_batch.decode_rows_independent(rows, {"a": 0})
    assert not _decode_only(rows, {"a": 0}, True)
    assert _decode_only(rows, {"a": 0}, False)
