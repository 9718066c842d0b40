"""The compiled validator that decides validity on the hot path (jsonschema-rs).

jsonschema stays the authority: this module only ever answers "valid" when jsonschema is
sure to agree. A rejection here is never final: pass 1 then asks jsonschema for its
errors, and a call it finds none in is valid. So a place where jsonschema-rs is stricter
(its ECMA-262 regexes: `\\d` and `\\w` are ASCII, `$` does not match before a final
newline; it refuses NaN and infinities) changes no verdict, and what remains is to keep
it away from the places where it could be more lenient:

- schemas: a `pattern` beside a keyword that turns a refusal into an acceptance (`not`,
  `oneOf`, `if`, `maxContains`), `patternProperties`, a `pattern` outside a small regex
  subset whose meaning in Python's `re` is the same or wider (no `\\s`, negated classes,
  flags, lookarounds, `{,n}`, escapes other than `\\d`, `\\w` and punctuation), a
  `multipleOf` that is not an integer (float arithmetic differs), a `$ref` outside the
  document, a `$schema` other than 2020-12 or dynamic references are validated with
  jsonschema alone;
- instances: it reads a tuple as an array, where jsonschema does not, so arguments that
  did not come straight from JSON text are walked first; and an instance nested deeper
  than jsonschema can follow (it recurses in Python, and reports that) goes to jsonschema.

Nothing here imports from the rest of the kernel.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import jsonschema_rs

__all__ = ["compile_fast", "fast_verdict", "fast_safe"]

log = logging.getLogger("threepass.registry")

_DRAFT_2020_12 = frozenset(
    {"https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2020-12/schema#"}
)
# A regex whose every construct means the same in Python's `re` and in ECMA-262, or
# matches less in ECMA-262: literals (not a backslash, bracket, brace or parenthesis),
# `\d`, `\w`, `\n`, `\t`, `\r` and escaped punctuation, positive classes of those, groups
# `( )` and `(?: )`, `.`, `^`, `$`, `|` and the quantifiers `* + ? {n} {n,} {n,m}` (lazy too).
_ATOM = r"(?:[^\\\[\]{}()]|\\[dwntr]|\\[!-/:-@\[-`{-~])"
_CLASS_ITEM = r"(?:[^\\\]\[]|\\[dwntr]|\\[!-/:-@\[-`{-~])"
_SAFE_PATTERN = re.compile(
    rf"(?:{_ATOM}|\[(?!\^)(?!\]){_CLASS_ITEM}+\]|\((?:\?:|(?!\?))|\)|\{{\d+(?:,\d*)?\}})*"
)
_MAX_BRACKETS = 100
"""Arguments with more brackets than this in their JSON may nest deeper than jsonschema
(which recurses in Python) can follow: jsonschema alone says what they are."""


def _safe_pattern(pattern: str) -> bool:
    return _SAFE_PATTERN.fullmatch(pattern) is not None


# Keywords under which a subschema that refuses more makes the schema accept more: `not`,
# `oneOf` (one branch fewer may leave exactly one), `if` (the other branch applies) and
# `maxContains` (fewer items contained).
_TURNING = frozenset({"not", "oneOf", "if", "maxContains"})


def fast_safe(schema: Any) -> bool:
    """Whether jsonschema-rs accepts nothing under `schema` that jsonschema refuses. Its
    regexes match less, which refuses more, except where a keyword turns that around: a
    schema with a `pattern` and any of `_TURNING` (wherever each is: a `$ref` may join
    them), and one with `patternProperties` (a name its regex misses escapes the
    property's schema), are for jsonschema alone."""
    keys: set[str] = set()
    return _safe_parts(schema, keys) and not ("pattern" in keys and keys & _TURNING)


def _safe_parts(schema: Any, keys: set[str]) -> bool:
    """`fast_safe` of each part on its own; `keys` gathers every key met on the way."""
    if isinstance(schema, Mapping):
        keys.update(k for k in schema if isinstance(k, str))
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str) and not _safe_pattern(value):
                return False
            if key == "patternProperties":
                return False
            if key == "multipleOf" and isinstance(value, float | int) and type(value) is not int:
                return False
            if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
                return False
            if key == "$schema" and isinstance(value, str) and value not in _DRAFT_2020_12:
                return False
            if key in ("$dynamicRef", "$dynamicAnchor", "$recursiveRef"):
                return False
            if not _safe_parts(value, keys):
                return False
        return True
    if isinstance(schema, list):
        return all(_safe_parts(item, keys) for item in schema)
    return True


def compile_fast(schema: Mapping[str, Any], tool_name: str) -> Any | None:
    """A jsonschema-rs Draft 2020-12 validator for `schema`, or None where jsonschema
    alone must decide (a schema outside the safe subset, or one it cannot compile)."""
    if not fast_safe(schema):
        return None
    try:
        return jsonschema_rs.Draft202012Validator(dict(schema), validate_formats=False)
    except Exception as exc:  # a regex it reads differently, say: jsonschema decides alone
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.info(
            "tool %r: validated by jsonschema alone (jsonschema-rs cannot compile it: %s)", tool_name, reason
        )
        return None


def _plain_json(value: Any) -> bool:
    """Only what JSON text decodes to: dict (with str keys), list, str, int, float, bool, None."""
    kind = type(value)
    if kind is dict:
        return all(type(k) is str and _plain_json(v) for k, v in value.items())
    if kind is list:
        return all(_plain_json(v) for v in value)
    return kind is str or kind is int or kind is float or kind is bool or value is None


def fast_verdict(
    fast: Any, args: Mapping[str, Any], *, from_json: bool, canonical: str | None
) -> bool | None:
    """True: valid, jsonschema would agree. False: jsonschema-rs refuses (ask jsonschema for
    the errors; it may find none). None: this instance is for jsonschema alone.

    `from_json` says `args` came straight from JSON text; `canonical` is their JSON."""
    if canonical is None or (
        len(canonical) > _MAX_BRACKETS and canonical.count("[") + canonical.count("{") > _MAX_BRACKETS
    ):
        return None  # (text no longer than the limit cannot hold more brackets than it)
    if not from_json and not _plain_json(args):
        return None
    try:
        return bool(fast.is_valid(args))
    except (ValueError, UnicodeError, OverflowError):  # a lone surrogate, say
        return None
