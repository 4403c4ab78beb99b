"""Random replies of think tags, near-tags and text: the stream does not depend on how
the text is split and is a prefix of the whole-reply split, for every prompt state."""
from __future__ import annotations

import random

import pytest
from reasoning_stream_helpers import stream

from jaxllm.reasoning import ReasoningParserManager

PIECES = ["<think>", "</think>", "<thi", "</thi", "nk>", "\n", " ", "\n\n", "abc", "東京 😀",
          "<", ">", "/", "think", "<b>", "x < y"]
PROMPTS = [None, "<|im_start|>assistant\n<think>\n", "<think>\n\n</think>\n\n", ""]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_random_replies(name):
    parser_cls = ReasoningParserManager.get_reasoning_parser(name)
    rng = random.Random(name)
    for _ in range(400):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        prompt = rng.choice(PROMPTS)
        results = []
        for pieces in (list(text), [text[:len(text) // 3], text[len(text) // 3:]]):
            parser = parser_cls()
            if prompt is not None:
                parser.set_prompt(prompt)
            results.append(stream(parser, pieces))
        assert results[0] == results[1], text
        want_r, want_c = parser.extract_reasoning(text)
        assert (want_r or "").startswith(results[0][0]), text
        assert (want_c or "").startswith(results[0][1]), text
