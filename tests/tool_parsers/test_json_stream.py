"""JsonStreamer: any JSON text, fed in any pieces, comes out as
json.dumps(json.loads(text), ensure_ascii=False); what is not JSON is an error."""
from __future__ import annotations

import json
import random

import pytest

from jaxllm.entrypoints.openai.tool_parsers.json_stream import (
    CallObject, JsonStreamer, canonical_json)


def _value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "lit"] + (["list", "dict"] * 2 if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        alphabet = 'ab "\\/\n\t\x01é東😀\u2028<>{}[],:'
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.choice([0, -1, 7, 10 ** 30, -123456])
    if kind == "float":
        return rng.choice([0.5, -1.25e-7, 1e300, 3.0, -0.0, 0.1])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {_value(rng, 3) if rng.random() < 0.3 else f"k{i}": _value(rng, depth + 1)
            for i in range(rng.randint(0, 4))}


def _write(rng: random.Random, value) -> str:
    """The value as some model might write it."""
    style = rng.randint(0, 3)
    if style == 0:
        return json.dumps(value)
    if style == 1:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if style == 2:
        return json.dumps(value, indent=2)
    return json.dumps(value, ensure_ascii=False, indent="\t", separators=(" ,", " : "))


def _feed(pieces) -> tuple[str, str, JsonStreamer]:
    streamer, out, rest = JsonStreamer(), [], ""
    for piece in pieces:
        if streamer.done:
            rest += piece
            continue
        text, after = streamer.feed(piece)
        out.append(text)
        rest += after
    return "".join(out), rest, streamer


@pytest.mark.parametrize("seed", range(60))
def test_any_split_gives_the_canonical_text(seed):
    rng = random.Random(seed)
    value = {"v": _value(rng)} if seed % 2 else [_value(rng)]
    raw = _write(rng, value)
    want = json.dumps(value, ensure_ascii=False)
    assert canonical_json(raw) == want
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(raw) + 1), min(len(raw) + 1, rng.randint(1, 12))))
        pieces = [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]
        out, rest, streamer = _feed(pieces + [" tail"])
        assert streamer.done and out == want and rest == " tail"
    out, _, _ = _feed(list(raw))
    assert out == want


@pytest.mark.parametrize("raw", [
    '"\\ud83d\\ude00"', '"\\ud83d"', '"\\ud83d\\n"', '"a\\u00e9b"', '"\\/"',
    '{"a":"x\ny"}',                     # a raw newline in a string: read leniently
])
def test_escapes(raw):
    want = json.dumps(json.loads(raw, strict=False), ensure_ascii=False)
    for k in range(len(raw) + 1):
        assert _feed([raw[:k], raw[k:]])[0] == want


@pytest.mark.parametrize("raw", [
    "{'a': 1}", '{"a": 1,}', '[1 2]', '{"a" 1}', '{"a": tru}', '{"a": 01}', '{"a": NaN}',
    '{"a": 1e999}', '"\\x41"', '"\\u12G4"', '{"a": 1]', "[-]", '{1: 2}',
])
def test_not_json(raw):
    assert canonical_json(raw) is None
    _, _, streamer = _feed(list(raw + "  "))
    assert streamer.error or not streamer.done


def test_incomplete_is_not_done():
    assert canonical_json('{"a": [1, 2') is None
    assert canonical_json('{"a": "b"} extra') is None
    out, _, streamer = _feed(['{"a": 12'])
    assert out == '{"a": ' and not streamer.done      # 12 may go on: 123


def test_call_object_any_split():
    raw = '{"name": "f", "arguments": {"x": [1, {"y": "z"}]}, "id": "abc"} rest'
    for k in range(len(raw) + 1):
        call, events, rest = CallObject(), [], ""
        for piece in (raw[:k], raw[k:]):
            rest += call.feed(piece) if not call.done else piece
            events += call.events
            call.events.clear()
        assert call.done and rest == " rest"
        assert events[0] == ("name", "f")
        assert "".join(v for kind, v in events[1:]) == '{"x": [1, {"y": "z"}]}'
