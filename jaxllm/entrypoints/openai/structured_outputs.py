"""A request's structured-output constraint -> ``StructuredOutputsParams``.

Clients spell a constraint three ways: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` object, and vLLM's legacy ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` (with
``guided_whitespace_pattern``). A request gives at most one constraint. It is checked
by the grammar library here, in the front end (about a millisecond, no tokenizer), so
a bad schema, regex or grammar is a 400 naming the field as the client spelled it and
never reaches the engine.
"""
from __future__ import annotations

from typing import Any

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output import validate

KINDS = ("json", "regex", "choice", "grammar")   # the guided_* constraints
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def structured_outputs_params(request) -> StructuredOutputsParams | None:
    """The constraint of a chat or completion request (protocol.py), validated; None if
    it has none. APIError (400) if it has more than one, options without one, or one
    the grammar library rejects."""
    given = _constraints(request)
    options, names = _options(request)
    if len(given) > 1:
        raise bad_request("A request takes one structured-output constraint; got "
                          f"{' and '.join(repr(p) for p, _, _ in given)}.", param=given[1][0])
    if not given:
        if request.structured_outputs is None and not names:
            return None
        param = "structured_outputs" if request.structured_outputs is not None \
            else names["whitespace_pattern"]
        raise bad_request(f"'{param}' needs a constraint: one of structured_outputs.json, "
                          "regex, choice, grammar or json_object (or response_format, or "
                          "guided_json, guided_regex, guided_choice, guided_grammar).",
                          param=param)
    param, kind, value = given[0]
    names[kind] = param
    if "whitespace_pattern" in options:   # alone first: else a bad one is blamed on the schema
        _checked({"regex": options["whitespace_pattern"]}, {"regex": names["whitespace_pattern"]})
    return _checked({kind: value, **options}, names)


def _constraints(request) -> list[tuple[str, str, Any]]:
    """(param as sent, StructuredOutputsParams field, value) of each constraint given."""
    out = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        out.append(("response_format", "json_object", True))
    elif fmt is not None and fmt.type == "json_schema":
        out.append(("response_format.json_schema.schema", "json", fmt.json_schema.json_schema))
    so = request.structured_outputs
    if so is not None:
        values = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                  "grammar": so.grammar, "json_object": so.json_object}
        out += [(f"structured_outputs.{kind}", kind, value) for kind, value in values.items()
                if value not in (None, False)]
    for kind in KINDS:
        value = getattr(request, f"guided_{kind}")
        if value is not None:
            out.append((f"guided_{kind}", kind, value))
    return out


def _options(request) -> tuple[dict[str, Any], dict[str, str]]:
    """The options that are set ({field: value}) and where they came from ({field: param})."""
    options, names = {}, {}
    so = request.structured_outputs
    for name in OPTIONS:
        if so is not None and getattr(so, name) is not None:
            options[name], names[name] = getattr(so, name), f"structured_outputs.{name}"
    if request.guided_whitespace_pattern is not None:
        if "whitespace_pattern" in options:
            raise bad_request("Give 'guided_whitespace_pattern' or "
                              "'structured_outputs.whitespace_pattern', not both.",
                              param="guided_whitespace_pattern")
        options["whitespace_pattern"] = request.guided_whitespace_pattern
        names["whitespace_pattern"] = "guided_whitespace_pattern"
    return options, names


def _checked(fields: dict[str, Any], names: dict[str, str]) -> StructuredOutputsParams:
    """StructuredOutputsParams(**fields), validated by the grammar library; its errors
    name their field (``structured_outputs.regex``), renamed here to the param the
    client sent (``names``: field -> param, e.g. ``guided_regex``)."""
    try:
        params = StructuredOutputsParams(**fields)
        validate(params)
        return params
    except ValueError as e:
        message = str(e).removeprefix("SamplingParams.")
        for field, param in names.items():
            prefix = f"structured_outputs.{field}"
            if message.startswith(prefix) and message[len(prefix):][:1] in (" ", ":"):
                raise bad_request(param + message[len(prefix):], param=param) from e
        raise bad_request(message) from e
