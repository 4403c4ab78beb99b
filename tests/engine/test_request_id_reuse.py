"""A request id used again, after its request was aborted while a step of it was in
flight (async scheduling), names a new request: that step's token is not the new
one's (Request.serial), so the new request's output is what it gives alone."""
from jaxllm import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}
SAMPLED = SamplingParams(temperature=1.5, seed=123, max_tokens=8, ignore_eos=True)


def _drain(engine, rid):
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                last = out
    return last.outputs[0].token_ids


def test_reused_id_after_an_abort_in_flight_gets_only_its_own_tokens(tiny_model):
    folder, _ = tiny_model("llama")
    llm = LLM(folder, enforce_eager=True, dtype="float32", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64)
    engine = llm.llm_engine
    assert engine.async_scheduling
    engine.add_request("ref", PROMPT, SAMPLED)
    alone = _drain(engine, "ref")
    engine.add_request("x", PROMPT, SamplingParams(temperature=0, max_tokens=50,
                                                   ignore_eos=True))
    engine.step()
    engine.step()            # a step of the greedy "x" is in flight now
    engine.abort_request("x")
    engine.add_request("x", PROMPT, SAMPLED)
    assert _drain(engine, "x") == alone
