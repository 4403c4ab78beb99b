"""Incremental detokenization and stop strings, as vLLM does it.

Decoding one token at a time is wrong for most tokenizers: a SentencePiece "▁the"
decodes to "the" at the start of a string but " the" after other text, and a
byte-level token may carry half of a UTF-8 character. So, like vLLM, we decode a
short window twice -- ``ids[prefix_offset:read_offset]`` (text already emitted)
and ``ids[prefix_offset:]`` (the same plus new tokens) -- and emit only the
difference. Text ending in U+FFFD is held back: it is probably an incomplete
UTF-8 sequence that the next token completes.

Stop strings may span tokens, so after each token we search the tail of the text
that could contain a newly completed stop string.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jaxllm.sampling_params import SamplingParams

# Prompt tokens decoded in front of the first output token, as in vLLM, so the
# first output token gets the spacing it has in context.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, and checks stop strings.

    ``tokenizer`` is a ``transformers`` tokenizer (a fast one is decoded through its
    Rust backend) or a raw ``tokenizers.Tokenizer``. ``spaces_between_special_tokens``
    only matters for slow tokenizers; fast ones ignore it, as in vLLM.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.skip_special_tokens = params.skip_special_tokens
        self._decode, self._vocab_size = _decoder(tokenizer, self.skip_special_tokens)
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = params.stop_buffer_length
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._last_output_text_offset = 0
        tail = prompt_token_ids[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2):]
        self._ids = [t for t in tail if 0 <= t < self._vocab_size]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)

    def update(self, new_token_ids: Iterable[int]) -> str | None:
        """Consume new tokens; return the stop string that matched, else None.

        On a match ``output_text`` is cut before the stop string (or after it, with
        include_stop_str_in_output) and the remaining new tokens are not consumed,
        so ``output_token_ids`` ends with the token that completed the stop string.
        Stop strings are not checked until more than min_tokens tokens exist.
        """
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            new_text = self._decode_next(token_id)
            self.output_text += new_text
            if new_text and self.stop and len(self.output_token_ids) > self.min_tokens:
                stop_str = self._check_stop_strings(len(new_text))
                if stop_str is not None:
                    return stop_str
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to stream: all of it, or (delta) only what is new since the last call.

        Until finished, the last ``stop_buffer_length`` chars are held back, since
        they may be the start of a stop string that must not be shown.
        """
        buffer = 0 if finished else self.stop_buffer_length
        end = len(self.output_text) - buffer
        if not delta:
            return self.output_text[:end] if buffer else self.output_text
        start = self._last_output_text_offset
        if start >= end:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]

    def _decode_next(self, token_id: int) -> str:
        """Append one token to the window; return the newly stable text."""
        if not 0 <= token_id < self._vocab_size:
            return ""  # e.g. an id from the padded part of the model's vocab
        ids, decode, start = self._ids, self._decode, self._prefix_offset
        ids.append(token_id)
        prefix_text = decode(ids[start:self._read_offset])
        new_text = decode(ids[start:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing new yet (a skipped special token) or a partial UTF-8 char: keep
            # the offsets so the next token is decoded together with this one.
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return new_text[len(prefix_text):]

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        """Find the earliest stop string completed by the last ``new_char_count``
        chars, truncate ``output_text`` at it, and return it."""
        text = self.output_text
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            # Only a match that ends inside the new text is new.
            start = max(len(text) - new_char_count - len(stop_str) + 1, 0)
            index = text.find(stop_str, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        if best is None:
            return None
        index, stop_str = best
        if self.include_stop_str_in_output:
            index += len(stop_str)
        self.output_text = text[:index]
        return stop_str


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> tuple[Callable[[list[int]], str], int]:
    """(decode(ids) -> str, vocab size incl. added tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(backend, "get_vocab_size") and hasattr(backend, "decode"):
        # The Rust tokenizer directly: no Python wrapper cost per token, and no
        # clean_up_tokenization_spaces, which vLLM's incremental path skips too. A
        # partial of the bound method: no Python frame per call (two calls a token).
        size = backend.get_vocab_size(with_added_tokens=True)
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens), size
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens), \
        len(tokenizer)
