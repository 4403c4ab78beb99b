"""Shared by the structured-output tests: the engines' settings, prompts and
SamplingParams, and the checks: whether an output meets its constraint, its tokens
replayed through a fresh llguidance matcher, and JSON whitespace outside strings."""
from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import numpy as np

from jaxllm import SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output import backend_guidance

# The engines of conftest.py (buckets compiled on first use).
DEFAULT_ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128,
                      enforce_eager=True)
TINY_ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=16,
                   max_num_batched_tokens=64, enforce_eager=True)


def token_prompts(n: int, seed: int, max_len: int = 90, prefix: list[int] | None = None):
    """n prompts of 3 to max_len - 1 random ids of the tiny tokenizer's 303, after
    `prefix`."""
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": (prefix or []) + rng.integers(2, 303, k).tolist()}
            for k in rng.integers(3, max_len, n)]


_CONSTRAINT_FIELDS = {f.name for f in dataclasses.fields(StructuredOutputsParams)}


def constrained(seed: int | None = 0, max_tokens: int | None = 64, temperature: float = 1.0,
                **kwargs) -> SamplingParams:
    """SamplingParams with one constraint: StructuredOutputsParams' fields (json=,
    regex=, disable_any_whitespace=...) go to the constraint, the others (n=, stop=,
    logprobs=...) to SamplingParams."""
    constraint = {k: v for k, v in kwargs.items() if k in _CONSTRAINT_FIELDS}
    rest = {k: v for k, v in kwargs.items() if k not in _CONSTRAINT_FIELDS}
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint), **rest)


def meets(constraint: StructuredOutputsParams, text: str, grammar_regex: str | None = None):
    """Raise AssertionError unless `text` is a complete output of `constraint` (for a
    grammar, `grammar_regex` is its regex equivalent)."""
    kind = constraint.kind
    if kind == "json":
        jsonschema.validate(json.loads(text), constraint.json)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(constraint.regex, text), (constraint.regex, text)
    elif kind == "choice":
        assert text in constraint.choice, (constraint.choice, text)
    else:
        assert grammar_regex is not None and re.fullmatch(grammar_regex, text), text


_TOKENIZERS: dict[int, object] = {}


def replay(llm, constraint: StructuredOutputsParams, token_ids: list[int]):
    """(every token accepted, accepting at the end) for a fresh matcher of the
    constraint fed the output's tokens: what the masks allowed, checked afresh."""
    engine = llm.llm_engine
    if id(engine) not in _TOKENIZERS:
        _TOKENIZERS[id(engine)] = backend_guidance.make_tokenizer(
            engine.tokenizer, engine.arch.vocab_size, engine.eos_token_id)
    matcher = backend_guidance.new_matcher(_TOKENIZERS[id(engine)],
                                           backend_guidance.grammar_spec(constraint))
    for t in token_ids:
        if not matcher.consume_token(t):
            return False, False
    return True, matcher.is_accepting() or matcher.is_stopped()


def whitespace_outside_strings(text: str) -> list[str]:
    """The runs of whitespace between a JSON text's tokens (not inside strings)."""
    runs, current, in_string, escaped = [], "", False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch in " \t\n\r":
            current += ch
            continue
        if current:
            runs.append(current)
            current = ""
        in_string = ch == '"'
    return runs + ([current] if current else [])
