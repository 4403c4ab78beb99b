"""qwen3: <think>...</think> as Qwen3 writes it, with thinking on, off, and opened by
the template in the prompt (Thinking-2507)."""
from __future__ import annotations

import pytest
from reasoning_stream_helpers import check_streaming

from jaxllm.reasoning import ReasoningParser, ReasoningParserManager

PARSER = ReasoningParserManager.get_reasoning_parser("qwen3")

THINKING = ("<think>\nThe user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.\n"
            "</think>\n\n17 × 23 = **391**.")
OPENED_IN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
THINKING_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
NO_TAGS_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_registered():
    assert issubclass(PARSER, ReasoningParser)
    with pytest.raises(KeyError, match="known: .*qwen3"):
        ReasoningParserManager.get_reasoning_parser("nope")


@pytest.mark.parametrize("text, reasoning, content", [
    (THINKING, "The user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.",
     "17 × 23 = **391**."),
    ("<think>\n\n</think>\n\nHello! How can I help?", None, "Hello! How can I help?"),
    ("<think>Short.</think>Answer with <b>tags</b> and x < y.", "Short.",
     "Answer with <b>tags</b> and x < y."),
    ("<think>a < b, and </thinking> is not the tag</think>ok", "a < b, and </thinking> is not "
     "the tag", "ok"),
    ("<think>one</think>two</think>three", "one", "two</think>three"),
    ("\n<think>\nЗдравствуйте 東京 😀\n</think>\n\nПривет 😀", "Здравствуйте 東京 😀", "Привет 😀"),
    ("<think>\nThinking about it...\n</think>", "Thinking about it...", None),
])
def test_think_block(text, reasoning, content):
    assert PARSER().extract_reasoning(text) == (reasoning, content)
    check_streaming(PARSER, text)
    check_streaming(PARSER, text, prompt=NO_TAGS_PROMPT)


def test_no_closing_tag_after_an_opening_one_is_all_reasoning():
    text = "<think>\nLet me count the letters: s, t, r, a, w"      # cut by max_tokens
    assert PARSER().extract_reasoning(text) == ("Let me count the letters: s, t, r, a, w", None)
    check_streaming(PARSER, text)


@pytest.mark.parametrize("text, held", [
    ("Paris is the capital of France.", ""), ("", ""), ("  \n", ""),
    ("No think block, but a </thinking> word.", ""),
    ("<thin", "<thin")])                    # may still become <think>
def test_no_tags_is_all_content(text, held):
    assert PARSER().extract_reasoning(text) == (None, text.strip() or None)
    # Not told the prompt, the stream cannot know a </think> will not come: it holds
    # the text back to the end (the server sends it from the whole-reply parse).
    check_streaming(PARSER, text, held=text.strip())
    # Told that the template closed the block (enable_thinking false), or opened none.
    check_streaming(PARSER, text, prompt=THINKING_OFF, held=held)
    check_streaming(PARSER, text, prompt=NO_TAGS_PROMPT, held=held)


def test_block_opened_in_the_prompt():
    text = "The user greets me; reply briefly.\n</think>\n\nHello!"
    assert PARSER().extract_reasoning(text) == ("The user greets me; reply briefly.", "Hello!")
    check_streaming(PARSER, text)                       # held until </think>, then sent
    check_streaming(PARSER, text, prompt=OPENED_IN_PROMPT)
    cut = "Still thinking when max_tokens"
    parser = PARSER()
    parser.set_prompt(OPENED_IN_PROMPT)
    assert parser.extract_reasoning(cut) == (cut, None)
    check_streaming(PARSER, cut, prompt=OPENED_IN_PROMPT)


def test_told_the_prompt_the_stream_does_not_wait():
    parser = PARSER()
    parser.set_prompt(THINKING_OFF)
    assert parser.extract_reasoning_streaming("", "Hello", "Hello") == (None, "Hello")
    parser = PARSER()
    parser.set_prompt(OPENED_IN_PROMPT)
    assert parser.extract_reasoning_streaming("", "Hmm, ", "Hmm, ") == ("Hmm,", None)
    parser = PARSER()
    assert parser.extract_reasoning_streaming("", "Hello", "Hello") == (None, None)


def test_the_prompt_ends_inside_a_block_only_when_it_is_open():
    parser = PARSER()
    for prompt, inside in [(OPENED_IN_PROMPT, True), (THINKING_OFF, False),
                           (NO_TAGS_PROMPT, False),
                           ("<think>old</think> turn <|im_start|>assistant\n<think>\n", True)]:
        parser.set_prompt(prompt)
        assert parser.prompt_in_reasoning is inside
