"""The scheduler's checks: its settings, requests that could never run, whether a
request has finished (vLLM's check_stop) or reaches its length cap with the tokens in
flight, and how many draft tokens a step may verify."""
from __future__ import annotations

from jaxllm.engine.kv_cache_manager import cdiv
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.request_queue import SCHEDULING_POLICIES

PREEMPTION_MODES = ("recompute", "swap")


def validate_request(scheduler, request: Request) -> None:
    """Why `request` can never run on `scheduler`, as a ValueError."""
    n = request.num_prompt_tokens
    if request.request_id in scheduler.requests:
        raise ValueError(f"request id {request.request_id!r} is already in use")
    if n == 0:
        raise ValueError(f"request {request.request_id!r}: the prompt is empty")
    if n > scheduler.max_model_len:
        raise ValueError(f"request {request.request_id!r}: the prompt ({n} tokens) is longer "
                         f"than max_model_len={scheduler.max_model_len}")
    if not scheduler.enable_chunked_prefill and n > scheduler.max_num_batched_tokens:
        raise ValueError(
            f"request {request.request_id!r}: the prompt ({n} tokens) exceeds "
            f"max_num_batched_tokens={scheduler.max_num_batched_tokens} and chunked prefill is "
            f"off; raise --max-num-batched-tokens or pass --enable-chunked-prefill")
    # The KV the request can ever need: every token but the last sampled one.
    max_tokens = request.max_tokens
    final_len = (scheduler.max_model_len if max_tokens is None
                 else min(n + max_tokens, scheduler.max_model_len))
    num_blocks = cdiv(max(n, final_len - 1), scheduler.block_size)
    usable = scheduler.block_pool.num_usable_blocks
    if num_blocks > usable:
        raise ValueError(
            f"request {request.request_id!r} can need {num_blocks} KV blocks but the cache "
            f"has {usable}; lower max_tokens or --max-model-len, or give the KV cache "
            f"more memory (--gpu-memory-utilization)")


def validate_args(block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, max_num_seqs: int,
                   max_num_batched_tokens: int, max_model_len: int, preemption_mode: str,
                   policy: str = "fcfs") -> None:
    positive = dict(block_size=block_size, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    if num_gpu_blocks < 2:
        raise ValueError(f"num_gpu_blocks={num_gpu_blocks}: need >= 2 (block 0 is reserved)")
    if num_cpu_blocks < 0:
        raise ValueError(f"num_cpu_blocks={num_cpu_blocks}: must be >= 0")
    if preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode={preemption_mode!r}: use one of {PREEMPTION_MODES}")
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"policy={policy!r}: use one of {SCHEDULING_POLICIES}")


def check_stop(request: Request, max_model_len: int) -> bool:
    """vLLM v1 order: length cap, then (after min_tokens) EOS and stop_token_ids, then a
    completed grammar. Sets the request's finished status and stop_reason."""
    # Lists and lengths read once, not through Request's properties: this runs for
    # every sampled token.
    params, outputs = request.sampling_params, request.output_token_ids
    num_outputs, max_tokens = len(outputs), request.max_tokens
    if len(request.all_token_ids) >= max_model_len or (
            max_tokens is not None and num_outputs >= max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if num_outputs < (getattr(params, "min_tokens", 0) or 0):
        return False
    last = outputs[-1]
    if (not getattr(params, "ignore_eos", False) and request.eos_token_id is not None
            and last == request.eos_token_id):
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in (getattr(params, "stop_token_ids", None) or ()):
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    grammar = request.structured_output_request
    if grammar is not None and grammar.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED   # the grammar is complete
        return True
    return False


def append_tokens(request: Request, tokens, max_model_len: int) -> bool:
    """Append a step's tokens up to the first that ends the request; True if one did.
    A list of tokens (speculation) is cut to those appended: the caller reads it back."""
    grammar = request.structured_output_request
    for n, token in enumerate(tokens, 1):
        request.append_output_token(token)
        if grammar is not None:
            grammar.accept(token)
        if check_stop(request, max_model_len):
            if isinstance(tokens, list):
                del tokens[n:]
            return True
    return False


def reaches_length_cap(request: Request, max_model_len: int) -> bool:
    """The tokens in flight already end the request by length: schedule no more."""
    pending = request.num_output_placeholders
    if not pending:
        return False
    max_tokens = request.max_tokens
    return len(request.all_token_ids) + pending >= max_model_len or (
        max_tokens is not None and len(request.output_token_ids) + pending >= max_tokens)


def spec_tokens_to_verify(request: Request, num_new: int, budget: int,
                          max_model_len: int) -> list[int]:
    """The drafts a step verifies for a decoding request (taken off the request): as
    many as fit the budget, the context and max_tokens once the step's own token is
    added, since every draft may be accepted."""
    spec, request.spec_token_ids = request.spec_token_ids, []
    if not spec or num_new != 1 or request.num_output_placeholders:
        return []
    room = min(budget, max_model_len - request.num_tokens) - 1
    if request.max_tokens is not None:
        room = min(room, request.max_tokens - request.num_output_tokens - 1)
    return spec[:max(room, 0)]
