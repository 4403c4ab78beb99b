"""Constraints for the structured-output tests: fixed cases of every kind (regex,
choice, Lark and GBNF grammars with regex equivalents, a JSON schema), and a seeded
generator of random JSON schemas: objects, arrays with minItems/maxItems, enums and
consts, string patterns and lengths, integers and numbers with bounds, anyOf, nested
objects, required and optional properties.

Every random string, array and object is bounded, so a sampler that follows the
grammar can always finish: strings have a maxLength (or a bounded pattern), arrays a
maxItems and objects additionalProperties false.
"""
from __future__ import annotations

import random

from structured_helpers import constrained

LARK = '''start: greeting " " name "!"
greeting: "hello" | "hi"
name: /[A-Z][a-z]{1,8}/
'''
LARK_REGEX = r"(hello|hi) [A-Z][a-z]{1,8}!"
GBNF = '''root ::= "[" item ("," item)? ("," item)? "]"
item ::= [0-9] | [1-9] [0-9]
'''
GBNF_REGEX = r"\[(\d|[1-9]\d)(,(\d|[1-9]\d)){0,2}\]"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}

# (prompt, constraint, regex equivalent of a grammar). Every one of them is finite, so
# a sampler that follows it always finishes well within max_tokens.
CASES = [
    ("Call me at ", dict(regex=r"\d{3}-\d{4}"), None),
    ("Pets: ", dict(regex=r"(cat|dog)s? (run|sleep)s?\."), None),
    ("Email: ", dict(regex=r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"), None),
    ("Is the sky blue? ", dict(choice=["yes", "no", "maybe", "maybe not"]), None),
    ("Colour: ", dict(choice=["red", "green", "blue", "東京", "a \"quoted\" one"]), None),
    ("Greet someone: ", dict(grammar=LARK), LARK_REGEX),
    ("A list: ", dict(grammar=GBNF), GBNF_REGEX),
    ("A person: ", dict(json=SCHEMA, disable_any_whitespace=True), None),
]

PATTERNS = [r"^[a-z]{1,6}$", r"^[A-Z][a-z]{0,4}$", r"^\d{3}-\d{2}$", r"^(ab|cd){1,3}x?$",
            r"^[0-9a-f]{2,4}$", r"^(yes|no|maybe)$"]
WORDS = ["red", "green", "blue", "cat", "dog", "a b", "x\"y", "naïve", "東京", ""]
NAMES = ["name", "id", "age", "tags", "score", "kind", "item", "meta", "flag", "code",
         "size", "note"]


def random_schemas(seed: int, count: int) -> list[dict]:
    """`count` random top-level object schemas (what structured outputs mostly ask for)."""
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(count)]


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "pattern", "integer", "number", "boolean", "enum", "const",
             "null_or"]
    if depth < 2:
        kinds += ["object", "array", "array", "any_of"]
    return _MAKERS[rng.choice(kinds)](rng, depth)


def _string(rng, depth):
    lo = rng.choice([0, 0, 1, 2])
    return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 8)}


def _pattern(rng, depth):
    return {"type": "string", "pattern": rng.choice(PATTERNS)}


def _integer(rng, depth):
    lo = rng.randint(-1000, 1000)
    schema = {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([0, 1, 9, 100, 5000])}
    if rng.random() < 0.3:
        del schema[rng.choice(["minimum", "maximum"])]
    return schema


def _number(rng, depth):
    lo = rng.choice([-1.5, 0, 0.25, 3, -100])
    schema = {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1, 10, 1000])}
    if rng.random() < 0.3:
        schema["exclusiveMaximum"] = schema.pop("maximum")
    return schema


def _boolean(rng, depth):
    return {"type": "boolean"}


def _enum(rng, depth):
    pool = WORDS + [0, 1, -7, 2.5, True, None]
    return {"enum": rng.sample(pool, rng.randint(1, 4))}


def _const(rng, depth):
    return {"const": rng.choice(WORDS + [42, False])}


def _null_or(rng, depth):
    inner = rng.choice([_string, _integer, _boolean])(rng, depth)
    inner["type"] = [inner["type"], "null"]
    return inner


def _any_of(rng, depth):
    return {"anyOf": [_value(rng, depth + 1) for _ in range(rng.randint(2, 3))]}


def _array(rng, depth):
    lo = rng.randint(0, 2)
    return {"type": "array", "items": _value(rng, depth + 1), "minItems": lo,
            "maxItems": lo + rng.randint(0, 2)}


def _object(rng, depth):
    names = rng.sample(NAMES, rng.randint(1, 4 if depth == 0 else 3))
    props = {name: _value(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.6]
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


_MAKERS = {"string": _string, "pattern": _pattern, "integer": _integer, "number": _number,
           "boolean": _boolean, "enum": _enum, "const": _const, "null_or": _null_or,
           "any_of": _any_of, "array": _array, "object": _object}


def mixed_constrained(n: int, seed: int, max_tokens: int = 60):
    """n seeded constrained requests: the CASES' constraints and random schemas."""
    kinds = [c for _, c, _ in CASES] + [dict(json=s, disable_any_whitespace=True)
                                       for s in random_schemas(seed, 4)]
    return [constrained(seed=seed + i, max_tokens=max_tokens, **kinds[i % len(kinds)])
            for i in range(n)]


def grammar_regex(params) -> str | None:
    """The regex equivalent of a CASES grammar constraint (None for other kinds)."""
    for _, c, regex in CASES:
        if c.get("grammar") is not None and c["grammar"] == params.structured_outputs.grammar:
            return regex
    return None
