"""llguidance, the grammar library behind structured outputs: a request's constraint as
an llguidance grammar, its validation, the engine tokenizer wrapped for token masks, and
a matcher per request.

Why llguidance: no torch at import (xgrammar's Python package imports torch, which
jaxllm never loads), JSON schema, regex, Lark and GBNF in one library, schemas compile
in about a millisecond without a tokenizer pass, and masks come from Rust threads that
drop the GIL (`LLExecutor`). outlines-core is regex-only and took ~1.7 s per schema
at the Qwen vocabulary.
"""
from __future__ import annotations

import json

import llguidance
import llguidance.numpy
import numpy as np

from jaxllm.sampling_params import StructuredOutputsParams


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        options: dict = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        if params.disable_additional_properties:
            schema = _no_additional_properties(schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.json: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # JSON string literals are valid Lark string literals (same escapes).
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice))
    try:      # Lark, or GBNF (llama.cpp's), which llguidance converts
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


def validate(params: StructuredOutputsParams, tokenizer=None) -> str:
    """The grammar of a constraint; ValueError naming the field when llguidance rejects
    it (a bad schema, regex or grammar). About a millisecond. With the engine's
    llguidance `tokenizer` it also catches what only the vocabulary can reject (a
    grammar naming a special token the model does not have)."""
    if params.whitespace_pattern is not None:
        _check(llguidance.LLMatcher.grammar_from_regex(params.whitespace_pattern),
               "whitespace_pattern", "regular expression")
    spec = grammar_spec(params)
    _check(spec, params.kind, _WHAT[params.kind], tokenizer)
    return spec


def _check(spec: str, field: str, what: str, tokenizer=None) -> None:
    error = llguidance.LLMatcher.validate_grammar(spec, tokenizer)
    if error:
        # The first line says where; a regex's reason is on an "error:" line below.
        lines = [x.strip() for x in error.strip().splitlines()] or [error]
        reason = " ".join([lines[0]] + [x for x in lines[1:] if x.startswith("error:")])
        raise ValueError(f"structured_outputs.{field} is not a valid {what}: {reason[:300]}")


def _no_additional_properties(schema):
    """The schema with additionalProperties false on every object schema that leaves
    it unset (vLLM's disable_additional_properties)."""
    if isinstance(schema, list):
        return [_no_additional_properties(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar (Lark or GBNF)"}


def make_tokenizer(hf_tokenizer, vocab_size: int,
                   eos_token_id: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of the engine tokenizer, masks `vocab_size` wide (the model's
    logits; ids the tokenizer lacks are never allowed). About a second at 150k tokens."""
    import llguidance.hf      # imports transformers: the engine's side only
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                        eos_token=eos_token_id)


def new_matcher(tokenizer: llguidance.LLTokenizer, spec: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(tokenizer, spec, log_level=0)
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher


class MaskFiller:
    """Masks of many rows at once on one LLExecutor of `threads` Rust threads: one call,
    so one GIL release and one reacquire per step however many rows. Python threads
    each with their own executor scaled as well on an idle host, but every one of them
    needs the GIL to start and to finish, and behind an engine thread busy in Python
    each such handoff waits up to the interpreter's switch interval: 256 rows took
    29 ms split over 16 Python threads against 14 ms in one call (5 ms switch
    interval, 2 cores). Rows must not share a compiled grammar's lexer (see
    StructuredOutputManager.new_request) or they serialize on its lock."""

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self.executor = llguidance.LLExecutor(self.threads)

    def fill(self, rows: list[tuple], bitmask: np.ndarray) -> None:
        """Each (matcher, row)'s allowed next tokens into bitmask i32[S, W]."""
        if rows:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, rows, bitmask)

    def consume(self, pairs: list[tuple]) -> list[bool]:
        """Each (matcher, token): the matcher advanced by the token; whether it was
        allowed (a rejected one leaves its matcher in an error state)."""
        return self.executor.consume_token_par(pairs)
