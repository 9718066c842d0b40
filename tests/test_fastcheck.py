"""The compiled validator on the hot path: every verdict is jsonschema's."""

from __future__ import annotations

import json
import logging
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis_jsonschema import from_schema

from dispatcher import Registry, Status, Tool
from dispatcher._fastcheck import compile_fast, fast_safe
from dispatcher._registry import register_check

from ._fakes import done
from .test_plan import make_planner, run_pass1, tc

# Patterns both inside and outside the subset where jsonschema-rs matches no more than re.
PATTERNS = [
    r"^\d+$", r"^[a-z_]+$", r"\w", r"^a.c$", r"^(?:ab|cd)*$", r"x{2,}", r"^[0-9]{2,3}$", r"b$",
    r"^\s*$", r"[^a]", r"(?i)^k$", r"^\S+$", r"\bx", r"^\D", r"a{,2}",
]  # fmt: skip
NUMBERS = st.one_of(st.integers(-5, 5), st.sampled_from([0.5, 1.0, 2.5, -1.5, 2**53, 10**20]))
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, 1.0, 0.3, 2**64]), st.text(max_size=3)
)
TEXT = st.text(alphabet=st.sampled_from("aAbcdkx_1٢ \n\t\ufeff\x1cé\u0301\u212a😀"), max_size=5)

LEAF_SCHEMAS = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "array", "object"])}
    ),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
    st.fixed_dictionaries({}, optional={"minLength": st.integers(0, 3), "maxLength": st.integers(0, 4)}),
    st.fixed_dictionaries(
        {},
        optional={
            "minimum": NUMBERS,
            "maximum": NUMBERS,
            "exclusiveMinimum": NUMBERS,
            "exclusiveMaximum": NUMBERS,
            "multipleOf": st.sampled_from([2, 3, 0.5, 0.1]),
        },
    ),
    st.builds(lambda v: {"enum": v}, st.lists(SCALARS, min_size=1, max_size=3)),
    st.builds(lambda v: {"const": v}, SCALARS),
)


def _object(props: dict[str, Any], required: list[str], extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    if extra is not None:
        schema["additionalProperties"] = extra
    return schema


SCHEMAS = st.recursive(
    LEAF_SCHEMAS,
    lambda inner: st.one_of(
        st.builds(
            lambda items, most, unique: {
                "type": "array",
                "items": items,
                "maxItems": most,
                "uniqueItems": unique,
            },
            inner,
            st.integers(0, 3),
            st.booleans(),
        ),
        st.builds(
            _object,
            st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
            st.lists(st.sampled_from("abc"), max_size=2, unique=True),
            st.one_of(st.none(), st.just(False), inner),
        ),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda xs: {"oneOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda xs: {"allOf": xs}, st.lists(inner, min_size=1, max_size=2)),
        st.builds(lambda x: {"not": x}, inner),
    ),
    max_leaves=6,
)
ROOTS = st.builds(
    _object,
    st.dictionaries(st.sampled_from("abcd"), SCHEMAS, max_size=3),
    st.lists(st.sampled_from("abcd"), max_size=2, unique=True),
    st.one_of(st.none(), st.just(False)),
)
# Where the dialects part: Python's \s takes \x1c and not \ufeff (ECMA-262 the reverse),
# \d and \w take more than ASCII, $ matches before a final newline, (?i) folds the Kelvin
# sign, float multipleOf, and a tuple (an array to jsonschema-rs, not to jsonschema).
TRICKY = st.sampled_from(["\ufeff", "\x1c", "a\x1c", "12\n", "١٢", "\u212a", "é", "b\n", 0.3, 0.7, 1.5])
VALUES = st.recursive(
    TRICKY | st.one_of(SCALARS, TEXT, NUMBERS),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from("abc"), inner, max_size=3)
        | st.lists(inner, max_size=2).map(tuple)
    ),
    max_leaves=8,
)
JUNK_OBJECTS = st.dictionaries(st.sampled_from("abcd"), VALUES, max_size=4)


def _checked(schema: dict[str, Any]) -> Registry:
    """A registry of one tool, `checked`, that takes `schema`: registering it compiles the
    validators, so a test that asks about many calls under one schema builds it once."""
    return Registry([Tool("checked", "c", done, schema)])


def _verdict(schema: dict[str, Any] | Registry, args: Any) -> bool:
    """Whether pass 1 lets a call with these arguments through validation (the schema, or
    the `_checked` registry of it)."""
    registry = schema if isinstance(schema, Registry) else _checked(schema)
    planner = make_planner(registry, all_loaded=True)
    p = run_pass1(planner, [tc("checked", args)]).calls[0]
    return p.outcome is None or p.outcome.status is not Status.invalid_arguments


def _draw_instance(data: Any, schema: dict[str, Any]) -> Any:
    """An instance for an object schema: each property from hypothesis-jsonschema (valid
    values) or junk. Objects are built here, property by property: hypothesis-jsonschema
    0.23 cannot draw an object schema under this hypothesis (its `many` changed)."""
    instance = {}
    names = st.sampled_from(sorted(schema.get("properties", {})) or "abcd") | st.sampled_from("abcd")
    for name in data.draw(st.lists(names, max_size=4, unique=True), label="keys"):
        sub = schema.get("properties", {}).get(name)
        if sub is not None and sub.get("type") != "object" and data.draw(st.booleans(), label="valid"):
            try:
                instance[name] = data.draw(from_schema(sub), label=name)
                continue
            except (AttributeError, InvalidArgument):  # an object inside `sub`, or bounds none meet
                pass
        instance[name] = data.draw(VALUES, label=name)
    return instance


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=ROOTS, data=st.data())
def test_verdicts_equal_jsonschemas(schema: dict[str, Any], data: Any) -> None:
    """For generated schemas and instances (valid values from hypothesis-jsonschema, and junk),
    a call is valid exactly when jsonschema says so, sent as JSON text or as a dict."""
    instance = _draw_instance(data, schema)
    text = json.dumps(instance)
    authority = jsonschema.Draft202012Validator(schema)
    checked = _checked(schema)
    assert _verdict(checked, text) is authority.is_valid(json.loads(text))
    assert _verdict(checked, instance) is authority.is_valid(instance)


STRINGS = [
    "\ufeff",
    "\x1c",
    "a\x1c",
    "12\n",
    "١٢",
    "12",
    "\u212a",
    "k",
    "é",
    "e\u0301",
    "b\n",
    "xx",
    "ab",
    "a c",
]


def test_verdicts_equal_jsonschemas_for_every_pattern_and_string() -> None:
    """Every pattern above against every string where the regex dialects part: jsonschema's verdict."""
    for pattern in PATTERNS:
        schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
        authority = jsonschema.Draft202012Validator(schema)
        checked = _checked(schema)
        for text in STRINGS:
            verdict = _verdict(checked, json.dumps({"a": text}))
            assert verdict is authority.is_valid({"a": text}), (pattern, text)


def test_verdicts_equal_jsonschemas_for_multiple_of() -> None:
    """multipleOf, integer and float, against integers and floats: jsonschema's verdict."""
    for step in (2, 3, 0.1, 0.5, 0.01):
        schema = {"type": "object", "properties": {"a": {"multipleOf": step}}}
        authority = jsonschema.Draft202012Validator(schema)
        checked = _checked(schema)
        for number in (0, 1, 4, 9, 0.3, 0.7, 1.5, 2.0, 9.0, 1e20, 2**64, 0.07):
            assert _verdict(checked, json.dumps({"a": number})) is authority.is_valid({"a": number}), (
                step,
                number,
            )


@pytest.mark.parametrize("text", ["١٢", "12\n"])
def test_a_stricter_regex_dialect_never_refuses_what_jsonschema_accepts(text: str) -> None:
    """`^\\d+$` takes Arabic-Indic digits and a final newline in Python's re: the call is valid."""
    schema = {"type": "object", "properties": {"n": {"type": "string", "pattern": r"^\d+$"}}}
    assert register_check(Tool("digits", "d", done, schema)).fast is not None
    assert _verdict(schema, json.dumps({"n": text}))
    assert not _verdict(schema, json.dumps({"n": "12a"}))


def test_a_tuple_is_not_an_array() -> None:
    """A tuple in dict arguments fails `type: array` as jsonschema says, though jsonschema-rs takes it."""
    schema = {"type": "object", "properties": {"xs": {"type": "array"}}}
    assert register_check(Tool("arrays", "a", done, schema)).fast is not None
    assert not _verdict(schema, {"xs": (1, 2)})
    assert _verdict(schema, {"xs": [1, 2]})


@pytest.mark.parametrize(
    "schema",
    [
        {"properties": {"a": {"pattern": r"^\S+$"}}},
        {"properties": {"a": {"pattern": "(?i)k"}}},
        {"patternProperties": {"[^a]": {}}},
        {"properties": {"a": {"multipleOf": 0.1}}},
        {"properties": {"a": {"$ref": "https://example.com/a.json"}}},
        {"$schema": "http://json-schema.org/draft-07/schema#"},
    ],
)
def test_schemas_where_jsonschema_rs_could_accept_more_use_jsonschema_alone(schema: dict[str, Any]) -> None:
    """A pattern outside the safe subset, a float multipleOf, a remote $ref or another draft: no fast path."""
    assert not fast_safe(schema)
    assert compile_fast({"type": "object", **schema}, "t") is None


_DIGITS = {"type": "string", "pattern": r"^\d+$"}


@pytest.mark.parametrize(
    ("schema", "arguments"),
    [
        # "12\n" matches in Python (`$` before a final newline), not in jsonschema-rs: its
        # stricter regex leaves one branch of the oneOf, and jsonschema finds two
        ({"properties": {"b": {"oneOf": [{"type": "string"}, _DIGITS]}}}, {"b": "12\n"}),
        ({"properties": {"b": {"not": _DIGITS}}}, {"b": "12\n"}),
        ({"properties": {"b": {"if": _DIGITS, "then": {"maxLength": 1}}}}, {"b": "12\n"}),
        ({"properties": {"b": {"contains": _DIGITS, "maxContains": 1}}}, {"b": ["12\n", "3"]}),
        # a `$ref` joins the pattern to the `not` from elsewhere in the document
        ({"$defs": {"d": _DIGITS}, "properties": {"b": {"not": {"$ref": "#/$defs/d"}}}}, {"b": "12\n"}),
        # a name the stricter regex misses escapes the property's schema
        ({"patternProperties": {r"^\d+$": False}}, {"12\n": 1}),
    ],
)
def test_a_stricter_regex_that_a_keyword_turns_into_more_accepted_uses_jsonschema_alone(
    schema: dict[str, Any], arguments: dict[str, Any]
) -> None:
    """Where refusing more under a keyword means accepting more (not, oneOf, if,
    maxContains, patternProperties), jsonschema alone decides, and says invalid."""
    schema = {"type": "object", **schema}
    assert not fast_safe(schema)
    assert compile_fast(schema, "t") is None
    assert not jsonschema.Draft202012Validator(schema).is_valid(arguments)
    assert not _verdict(schema, json.dumps(arguments))


def test_a_schema_jsonschema_rs_cannot_compile_is_logged_once_and_still_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A regex Python compiles and jsonschema-rs refuses: one log line, and jsonschema validates."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(a{1000}){1000}|^b$"}}}
    with caplog.at_level(logging.INFO, logger="threepass.registry"):
        entry = register_check(Tool("huge", "h", done, schema))
    assert entry.fast is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("tool 'huge': validated by jsonschema alone"), lines
    assert not _verdict(schema, json.dumps({"a": 1}))
    assert _verdict(schema, json.dumps({"a": "b"}))
