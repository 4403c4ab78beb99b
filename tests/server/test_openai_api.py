"""The server driven by the official `openai` package: chat and completions, streaming
and not, n>1, logprobs, stop strings, seeds, usage; responses checked against
OpenAI's published schemas; greedy output equal to LLM.generate's."""
from __future__ import annotations

import dataclasses
import json
import logging
import time

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, MODEL, SERVED_NAMES, sse_events, validate

import jaxllm

from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
from jaxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, parse_request)
from jaxllm.sampling_params import SamplingParams

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello world"}]
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def reference(server_config):
    """Greedy outputs of LLM.generate / LLM.chat on its own engine, same settings."""
    from jaxllm import LLM
    c = server_config
    llm = LLM(c.model.model, max_model_len=c.model.max_model_len,
              max_num_seqs=c.scheduler.max_num_seqs,
              max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
              num_gpu_blocks_override=c.cache.num_gpu_blocks_override, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    chat = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
    return {"completion": completion, "chat": chat}


def test_greedy_completion_equals_llm_generate(client, reference):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, **GREEDY)
    validate("CreateCompletionResponse", json.loads(raw.text))
    completion = raw.parse()
    choice = completion.choices[0]
    assert choice.text == reference["completion"].text
    assert choice.finish_reason == "length"
    assert completion.model == MODEL and completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 12


def test_greedy_chat_equals_llm_chat(client, reference):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, **GREEDY)
    validate("CreateChatCompletionResponse", json.loads(raw.text))
    chat = raw.parse()
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == reference["chat"].text
    assert chat.usage.completion_tokens == len(reference["chat"].token_ids) == 12


def test_chat_stream_matches_whole_response(client, server_url):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    # The raw events, against the schema.
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "temperature": 0,
            "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
            "stream_options": {"include_usage": True}}
    for event in sse_events(httpx.post(f"{server_url}/v1/chat/completions", json=body,
                                       timeout=120)):
        validate("CreateChatCompletionStreamResponse", event)


def test_completion_stream_matches_whole_response(client, server_url):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage == whole.usage and chunks[-1].choices == []
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 4, "logprobs": 2}
    events = sse_events(httpx.post(f"{server_url}/v1/completions", json=body, timeout=120))
    for event in events:
        validate("CreateCompletionResponse", event, nullable_finish_reason=True)
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events) == 4


def test_usage_only_when_asked(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                            temperature=0, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)


def test_n_choices(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, n=3, temperature=1.0, seed=7, max_tokens=6,
        extra_body={"ignore_eos": True})
    validate("CreateChatCompletionResponse", json.loads(raw.text))
    chat = raw.parse()
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.completion_tokens == 18

    chunks = list(client.completions.create(
        model=MODEL, prompt=[PROMPT, "hello world"], n=2, max_tokens=5, stream=True,
        extra_body={"ignore_eos": True}))
    texts = {i: "" for i in range(4)}
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason == "length"]
    assert sorted(finished) == [0, 1, 2, 3]
    whole = client.completions.create(model=MODEL, prompt=[PROMPT, "hello world"], n=2,
                                      max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    # Greedy samples of one prompt agree; the second prompt's come after the first's.
    assert whole.choices[0].text == whole.choices[1].text
    assert whole.choices[2].text == whole.choices[3].text


def test_chat_logprobs(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True,
                                          top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True,
                                           **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY) \
        .choices[0].logprobs is None


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    # Up to 2 + the sampled token; byte tokens that decode alike share a key.
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(value) and value == pytest.approx(max(top.values()))


def _stop_candidate(text: str) -> tuple[int, str]:
    """A 2-char stop string first found at index >= 2 of ``text``."""
    for k in range(2, len(text) - 2):
        stop = text[k:k + 2]
        if "\ufffd" not in stop and text.find(stop) == k:
            return k, stop
    pytest.skip(f"no usable stop string in {text!r}")


def test_stop_strings(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                     max_tokens=24, extra_body={"ignore_eos": True}
                                     ).choices[0].text
    k, stop = _stop_candidate(text)
    kwargs = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24)
    choice = client.completions.create(stop=[stop], **kwargs,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (text[:k], "stop", stop)
    streamed = list(client.completions.create(stop=stop, stream=True, **kwargs,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == text[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"
    kept = client.completions.create(
        stop=stop, **kwargs,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert kept.text == text[:k + 2]


def test_seed_reproducible(client):
    def sample(seed):
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=12,
            extra_body={"ignore_eos": True}).choices[0].message.content
    assert sample(1234) == sample(1234)
    assert len({sample(1234), sample(1), sample(2)}) > 1


def test_prompt_forms(client, server_url):
    ids = httpx.post(f"{server_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    two = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], **GREEDY)
    assert two.usage.prompt_tokens == len(ids) + 2 and len(two.choices) == 2
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text


def test_request_fields_reach_sampling_params():
    chat = parse_request(ChatCompletionRequest, {
        "messages": MESSAGES, "n": 2, "temperature": 0.7, "top_p": 0.9, "stop": "x",
        "seed": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_k": 20,
        "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [5], "ignore_eos": True,
        "min_tokens": 2, "skip_special_tokens": False, "include_stop_str_in_output": True,
        "max_completion_tokens": 7, "max_tokens": 9, "logprobs": True, "top_logprobs": 4,
        "user": "someone"})
    params = chat.to_sampling_params()
    assert (params.n, params.temperature, params.top_p, params.stop, params.seed) == \
        (2, 0.7, 0.9, ["x"], 3)
    assert (params.presence_penalty, params.frequency_penalty, params.top_k, params.min_p,
            params.repetition_penalty) == (0.5, -0.5, 20, 0.05, 1.1)
    assert (params.stop_token_ids, params.ignore_eos, params.min_tokens,
            params.skip_special_tokens, params.include_stop_str_in_output) == \
        ([5], True, 2, False, True)
    assert (params.max_tokens, params.logprobs) == (7, 4)   # max_completion_tokens wins
    defaults = parse_request(ChatCompletionRequest, {"messages": MESSAGES}).to_sampling_params()
    assert (defaults.max_tokens, defaults.logprobs, defaults.temperature) == (None, None, 1.0)
    completion = parse_request(CompletionRequest, {"prompt": "x", "logprobs": 3})
    assert (completion.to_sampling_params().max_tokens,
            completion.to_sampling_params().logprobs) == (16, 3)   # OpenAI's default


def test_vllm_extras_over_http(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, user="someone",
        extra_body={"min_tokens": 6, "stop_token_ids": [5], "skip_special_tokens": False})
    assert out.usage.completion_tokens == 6   # min_tokens holds off every stop
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                          max_completion_tokens=3, temperature=0)
    assert chat.usage.completion_tokens <= 3
    # OpenAI fields we support only at their defaults are fine at their defaults.
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, tools=[],
                                   response_format={"type": "text"}, logit_bias={},
                                   temperature=0)


def test_models_and_aliases(client, server_url):
    body = httpx.get(f"{server_url}/v1/models").json()
    validate("ListModelsResponse", body)
    assert [m.id for m in client.models.list()] == list(SERVED_NAMES)
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    # Any served name works; responses carry the first, as vLLM's do.
    out = client.completions.create(model=SERVED_NAMES[1], prompt=PROMPT, max_tokens=1)
    assert out.model == MODEL


def test_utility_routes(server_url, async_engine):
    tok = httpx.post(f"{server_url}/tokenize",
                     json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(f"{server_url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok == {"prompt": PROMPT}
    chat_tok = httpx.post(f"{server_url}/tokenize", json={"messages": MESSAGES}).json()
    template = async_engine.engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert chat_tok["tokens"] == list(template)
    assert httpx.get(f"{server_url}/version").json() == {"version": jaxllm.__version__}
    assert httpx.get(f"{server_url}/health").status_code == 200


def test_stats_log_line(client, caplog):
    with caplog.at_level(logging.INFO, logger="jaxllm.stats"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
        time.sleep(1.2)   # the test server logs every 0.5 s
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxllm.stats"]
    assert any("Avg generation throughput" in line and "KV cache usage" in line
               for line in lines), lines


def test_chat_template_file(server_config, tmp_path):
    """--chat-template FILE replaces the tokenizer's template (a second engine on the
    same model: the compiled steps are shared, so it starts in about a second)."""
    from jaxllm.engine.async_llm import AsyncLLM
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                        "{% endfor %}[assistant]")
    config = server_config.replace(
        model=dataclasses.replace(server_config.model, chat_template=str(template)))
    engine = AsyncLLM.from_config(config, multiprocess=False)
    try:
        with serve_in_background(build_app(engine, config)) as url:
            tokens = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
            rendered = "[system] be brief\n[user] hello world\n[assistant]"
            assert httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json() == \
                {"prompt": rendered}
            chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}).json()
            assert chat["usage"]["prompt_tokens"] == len(tokens)
    finally:
        engine.shutdown()
