"""deepseek_r1: reasoning until </think>; its template puts <think> in the prompt."""
from __future__ import annotations

import pytest
from reasoning_stream_helpers import check_streaming

from jaxllm.reasoning import ReasoningParserManager

PARSER = ReasoningParserManager.get_reasoning_parser("deepseek_r1")


@pytest.mark.parametrize("text, reasoning, content", [
    ("Okay, the user wants the derivative of x^2. That is 2x.\n</think>\n\nThe derivative is "
     "$2x$.", "Okay, the user wants the derivative of x^2. That is 2x.", "The derivative is $2x$."),
    ("<think>\nHmm, 9.11 vs 9.9: 9.9 is larger.\n</think>\n\n9.9 is larger.",
     "Hmm, 9.11 vs 9.9: 9.9 is larger.", "9.9 is larger."),
    ("</think>\n\nJust the answer.", None, "Just the answer."),
    ("<think>\n\n</think>\n\nEmpty thoughts.", None, "Empty thoughts."),
    ("Still reasoning when the tokens ran out", "Still reasoning when the tokens ran out", None),
    ("<think>\nalso cut", "also cut", None),
    ("思考：東京 😀 < 大阪?\n</think>\n答え：はい", "思考：東京 😀 < 大阪?", "答え：はい"),
    ("a</think>b</think>c", "a", "b</think>c"),
    ("", None, None),
])
def test_reasoning_until_the_closing_tag(text, reasoning, content):
    assert PARSER().extract_reasoning(text) == (reasoning, content)
    check_streaming(PARSER, text)


def test_reasoning_streams_at_once():
    parser = PARSER()
    assert parser.extract_reasoning_streaming("", "Okay, ", "Okay, ") == ("Okay,", None)
    assert parser.extract_reasoning_streaming("Okay, ", "Okay, so</thi", "so</thi") == (" so", None)
    assert parser.extract_reasoning_streaming("Okay, so</thi", "Okay, so</think>\n\nHi",
                                              "nk>\n\nHi") == (None, "Hi")
