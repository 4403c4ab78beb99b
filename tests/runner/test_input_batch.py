"""input_batch.prepare_inputs: when a one-token step may run as decode-only with the
decode kernel writing the step's keys itself (no row may read another row's new key),
and the scheduler's mark on the rows it admits."""
from jaxllm.engine.scheduler import ScheduledRequest
from jaxllm.runner import input_batch
from jaxllm.runner.buckets import BucketPlan

PLAN = BucketPlan.build(max_num_batched_tokens=64, max_num_seqs=8)


def _row(rid, pos, table=(1, 2), admitted=False):
    return ScheduledRequest(rid, [5], pos, list(table), True, 1, admitted=admitted)


def _decode_only(rows, prev, own_keys_only):
    _, decode_only, _ = input_batch.prepare_inputs(rows, PLAN, 16, 4, prev,
                                                   rows_read_own_keys_only=own_keys_only)
    return decode_only


def test_continuing_rows_stay_decode_only():
    rows = [_row("a", 20), _row("b", 7, (3,))]
    assert _decode_only(rows, {"a": 0, "b": 1}, True)
    assert _decode_only(rows, {"a": 0, "b": 1}, False)


def test_a_row_admitted_this_step_takes_the_mixed_path():
    """'b' is admitted now: its prefix-cache hit may be a block that 'a' fills in this
    very step."""
    rows = [_row("a", 31), _row("b", 31, admitted=True)]   # same table: a full hit
    assert not _decode_only(rows, {"a": 0, "b": 1}, True)  # (even with 'b' in prev_rows)
    assert _decode_only(rows, {"a": 0}, False)       # the separate KV write: no matter


def test_speculative_verify_rows_take_the_mixed_path():
    rows, spec = input_batch.expand_spec_rows(
        [ScheduledRequest("a", [5, 6, 7], 20, [1, 2], True, 1, spec_token_ids=[6, 7])])
    assert spec is not None and len(rows) == 3
    assert not input_batch.decode_rows_independent(rows)
    assert not _decode_only(rows, {"a": 0}, True)
    assert _decode_only(rows, {"a": 0}, False)


def test_the_scheduler_marks_the_rows_it_admits():
    from jaxllm.engine.request import Request
    from jaxllm.engine.scheduler import Scheduler
    from jaxllm.sampling_params import SamplingParams
    sched = Scheduler(block_size=16, num_gpu_blocks=64, max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=256)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4)))
    first = sched.schedule().scheduled
    assert [r.admitted for r in first] == [True]
    sched.add_request(Request("b", [4, 5], SamplingParams(max_tokens=4)))
    second = sched.schedule().scheduled
    assert {r.request_id: r.admitted for r in second} == {"a": False, "b": True}
