"""The buffers a step reads and writes keep their device addresses from step to step,
so XLA records none of the step's CUDA-graph commands again for them (LogitsBuffers,
InputStager): the step writes its logits into its bucket's buffer, the sampler its
tokens into the same token buffer, and each step's inputs are copied into the buffer
the last step of their size read. Tiny Llama on the CPU, whose runtime donates
buffers as a GPU's does."""
from __future__ import annotations

from jaxllm import LLM, SamplingParams
from jaxllm.runner import kv_cache
from jaxllm.runner.executable_store import peak_bytes
from jaxllm.runner.model_runner import ModelRunner

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=16, max_num_batched_tokens=16,
              cpu_kv_cache_bytes=1 << 20, enforce_eager=True)
PROMPTS = [{"prompt_token_ids": [5, 9, 2, 7]}, {"prompt_token_ids": [17, 3]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_step_buffers_keep_their_addresses(tiny_model):
    folder, _ = tiny_model("llama")
    llm = LLM(folder, **ENGINE)
    runner = llm.llm_engine.runner
    first = tokens(llm)
    held = {"token": runner._token_buf, **{("logits", s): b for s, b in
                                            runner.logits_bufs.buffers.items()},
            **{("inputs", n): b for n, b in runner._stager.buffers.items()}}
    assert ("logits", 8) in held and any(k[0] == "inputs" for k in held if k != "token")
    where = {k: b.unsafe_buffer_pointer() for k, b in held.items()}
    assert tokens(llm) == first
    now = {"token": runner._token_buf, **{("logits", s): b for s, b in
                                           runner.logits_bufs.buffers.items()},
           **{("inputs", n): b for n, b in runner._stager.buffers.items()}}
    for k, old in held.items():
        # Donated to the later steps (deleted here), each written in place.
        assert old.is_deleted(), k
        assert now[k].unsafe_buffer_pointer() == where[k], k
    # A prompt-logprobs step takes its own program (a new logits array) and the
    # buffers go on as before.
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                   prompt_logprobs=1), use_tqdm=False)
    assert out[0].outputs[0].token_ids == first[0][:4] and out[0].prompt_logprobs
    assert tokens(llm) == first


def test_kv_sizing_counts_the_smaller_buckets_logits_buffers(tiny_model, monkeypatch):
    """The largest step's compiled peak holds its own logits buffer; the other
    buckets' stay on the device beside it and are added to the peak the pool is
    sized by."""
    folder, _ = tiny_model("llama")
    monkeypatch.setattr(ModelRunner, "device_limit", lambda self: 300 << 20)
    seen, real = [], kv_cache.fit_to_device

    def fit(*args, **kwargs):
        step_peak = args[7]

        def recorded(num_blocks):
            seen.append(step_peak(num_blocks))
            return seen[-1]
        return real(*args[:7], recorded, *args[8:], **kwargs)
    monkeypatch.setattr(kv_cache, "fit_to_device", fit)
    runner = LLM(folder, **ENGINE).llm_engine.runner
    # The largest step, compiled for the pool it checked last (the pool allocated).
    compiled = peak_bytes(runner.compilation.programs[("step", 16, 16, False)])
    extra = runner.logits_bufs.extra_bytes()
    assert extra == 4 * runner.arch.vocab_size * 8        # the 8-row bucket's buffer
    assert seen and seen[-1] == compiled + extra
