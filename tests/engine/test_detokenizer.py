"""Incremental detokenization and stop strings with small tokenizers trained in-test."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.sampling_params import SamplingParams

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there",
    "Stop here. The end is near.",
    "héllo wörld and some more text to merge",
] * 20
SPECIALS = ["<eos>", "<|im_start|>", "<|im_end|>"]


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece-like: "▁word" tokens whose space vanishes at string start."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200,
                                                        special_tokens=["<unk>"] + SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def byte_tok():
    return _byte_level()


@pytest.fixture(scope="module")
def meta_tok():
    return _metaspace()


def _run(tok, prompt_ids, out_ids, **params):
    """Feed out_ids one at a time; return (detokenizer, pieces, stop_str)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params))
    pieces, stop = [], None
    for tid in out_ids:
        before = detok.output_text
        stop = detok.update([tid])
        pieces.append(detok.output_text[len(before):])
        if stop is not None:
            break
    return detok, pieces, stop


TEXTS = ["the quick brown fox", "hello  world,\nhello there", "emoji 😀 and 你好 and ünïcödé",
         "ends in a multibyte €"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("which", ["byte", "meta"])
def test_incremental_text_equals_full_decode(byte_tok, meta_tok, which, text):
    tok = byte_tok if which == "byte" else meta_tok
    prompt = tok.encode("<|im_start|>user hi<|im_end|>")
    ids = tok.encode(text)
    detok, pieces, _ = _run(tok, prompt, ids)
    # The output's text is what the whole sequence adds to the prompt's text (for
    # Metaspace that includes the first word's leading space).
    full = tok.decode(prompt + ids, skip_special_tokens=True)
    assert detok.output_text == full[len(tok.decode(prompt, skip_special_tokens=True)):]
    without_prompt, _, _ = _run(tok, [], ids)
    assert without_prompt.output_text == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)


def test_metaspace_keeps_spaces_that_single_token_decode_loses(meta_tok):
    ids = meta_tok.encode("the quick brown fox")
    assert "".join(meta_tok.decode([i]) for i in ids) != "the quick brown fox"
    prompt = meta_tok.encode("jumps over")
    detok, pieces, _ = _run(meta_tok, prompt, ids)
    # After a prompt, the first word keeps its leading space, as in the full decode.
    full = meta_tok.decode(prompt + ids)
    assert detok.output_text == full[len(meta_tok.decode(prompt)):] == " the quick brown fox"


def test_multibyte_char_split_across_tokens_comes_out_whole(byte_tok):
    ids = byte_tok.encode("😀")  # not in the corpus: one token per UTF-8 byte
    assert len(ids) == 4
    detok, pieces, _ = _run(byte_tok, [], ids)
    assert pieces == ["", "", "", "😀"]
    assert detok.output_text == "😀"


def test_skip_special_tokens(byte_tok):
    ids = byte_tok.encode("hello<|im_end|> world<eos>")
    assert "<eos>" in byte_tok.convert_ids_to_tokens(ids)
    kept, _, _ = _run(byte_tok, [], ids, skip_special_tokens=False)
    assert kept.output_text == "hello<|im_end|> world<eos>"
    skipped, pieces, _ = _run(byte_tok, [], ids)
    assert skipped.output_text == "hello world" and pieces[-1] == ""
    assert skipped.output_token_ids == ids


def _spanning_stop(tok, text):
    """A stop string that starts in one token and ends in the next."""
    ids = tok.encode(text)
    ends = [len(tok.decode(ids[: i + 1])) for i in range(len(ids))]
    for i in range(1, len(ends) - 1):
        if ends[i] - ends[i - 1] >= 2 and ends[i - 1] >= 2:
            start = ends[i - 1] - 1
            return ids, text[start:start + 3], start, i  # token i completes it
    raise AssertionError("no suitable token boundary")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(byte_tok, include):
    text = "the quick brown fox jumps over the lazy dog"
    ids, stop, start, completing = _spanning_stop(byte_tok, text)
    detok, _, hit = _run(byte_tok, [], ids, stop=[stop], include_stop_str_in_output=include)
    assert hit == stop
    assert detok.output_token_ids == ids[: completing + 1]
    assert detok.output_text == (text[: start + len(stop)] if include else text[:start])


def test_earliest_stop_string_wins_and_later_tokens_are_not_consumed(byte_tok):
    text = "hello world, hello there"
    ids = byte_tok.encode(text)
    detok = IncrementalDetokenizer(byte_tok, [], SamplingParams(stop=["there", "o w", "ld"]))
    assert detok.update(ids) == "o w"
    assert detok.output_text == "hell"
    assert len(detok.output_token_ids) < len(ids)


def test_stop_strings_ignored_below_min_tokens(byte_tok):
    ids = byte_tok.encode("hello world, hello there")
    detok, _, hit = _run(byte_tok, [], ids, stop=["hello"], min_tokens=2, max_tokens=100)
    assert hit == "hello"
    assert detok.output_text == "hello world, "


def test_streaming_holds_back_possible_stop_prefix(byte_tok):
    ids = byte_tok.encode("hello world")
    detok = IncrementalDetokenizer(byte_tok, [], SamplingParams(stop=["STOP!"]))
    streamed = ""
    for tid in ids:
        assert detok.update([tid]) is None
        streamed += detok.get_next_output_text(finished=False, delta=True)
        assert len(detok.output_text) - len(streamed) <= 4
    assert detok.get_next_output_text(finished=False, delta=False) == "hello w"
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == "hello world" == detok.get_next_output_text(finished=True, delta=False)
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_out_of_vocab_ids_decode_to_nothing(byte_tok):
    ids = byte_tok.encode("hello")
    detok, _, _ = _run(byte_tok, [], ids[:1] + [len(byte_tok) + 5] + ids[1:])
    assert detok.output_text == "hello"


def test_raw_tokenizers_tokenizer_is_accepted(byte_tok):
    raw = byte_tok.backend_tokenizer
    ids = raw.encode("emoji 😀 here").ids
    detok, _, _ = _run(raw, [], ids)
    assert detok.output_text == "emoji 😀 here"
