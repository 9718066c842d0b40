"""`may_hold_credentials`, the quick check, gives the verdicts of its plain form: the text in
lower case searched for each part, one after another."""

from __future__ import annotations

import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher._credentials import _GATE_CHARACTERS, _GATED_UP_TO, _MAY_HOLD, may_hold_credentials


def plain_may_hold_credentials(text: str) -> bool:
    """The quick check as it was first written (only the parts are read from the module)."""
    low = text.lower()
    for part in _MAY_HOLD:  # noqa: SIM110 - as it was written
        if part in low:
            return True
    return False


# Characters other than ASCII that lower case makes ASCII (the test below finds no others)
_LOWERED_TO_ASCII = "\u0130\u212a"  # LATIN CAPITAL LETTER I WITH DOT ABOVE, KELVIN SIGN


def test_only_two_characters_other_than_ascii_have_an_ascii_lower_case() -> None:
    """İ (to `i` and a combining dot) and KELVIN SIGN (to `k`) are all: the generated text
    below holds every character that could make a part appear in lower case."""
    others = "".join(map(chr, range(0x80, sys.maxunicode + 1)))
    assert len(re.findall(r"[\x00-\x7f]", others.lower())) == len(_LOWERED_TO_ASCII)
    assert all(re.search(r"[\x00-\x7f]", char.lower()) for char in _LOWERED_TO_ASCII)


def test_every_part_holds_a_gate_character() -> None:
    """Text with no gate character in lower case holds no part: the gate answers exactly."""
    for part in _MAY_HOLD:
        assert any(char in part for char in _GATE_CHARACTERS), part


# a letter of a part, or what may stand for it: the other case, or a character other than
# ASCII whose lower case is it (or looks like it, and is not)
_LOOKALIKES = {"k": "K\u212a", "i": "I\u0130\u0131", "s": "S\u017f", "a": "A\u00e5"}


def _spelled(part: str, choices: list[int]) -> str:
    out = []
    for char, choice in zip(part, choices + [0] * len(part), strict=False):
        spellings = char + _LOOKALIKES.get(char, char.upper())
        out.append(spellings[choice % len(spellings)])
    return "".join(out)


_PART = st.builds(_spelled, st.sampled_from(_MAY_HOLD), st.lists(st.integers(0, 3), max_size=10))
# pieces of parts, so that parts are made (and cut by "\x00") where pieces meet
_PIECE = st.builds(
    lambda part, at, left: part[:at] if left else part[at:], _PART, st.integers(1, 9), st.booleans()
)
# and others: long s, dotless i, ANGSTROM SIGN, fullwidth K, e acute, a combining dot, a
# surrogate, ...
_OTHERS = "\u017f\u0131\u212b\uff2b\u00e9\u0307\ud800\u4e2d\U0001f600"
_CHARACTERS = st.sampled_from(
    [
        *_LOWERED_TO_ASCII,
        *_GATE_CHARACTERS,
        *_GATE_CHARACTERS.upper(),
        *_OTHERS,
        "\x00",
        " ",
        '"',
        "{",
        ":",
        "e",
    ]
)
# mostly text without gate characters, so that what is added decides
_FILLER = st.text('hello 17{}":,\u00e9\u4e2d', max_size=12)
_TEXT = st.lists(st.one_of(_FILLER, _PART, _PIECE, _CHARACTERS, st.text(max_size=6)), max_size=8).map("".join)


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(_TEXT, min_size=1, max_size=4), long=st.booleans())
def test_the_verdict_is_the_plain_checks(texts: list[str], long: bool) -> None:
    """On any text (parts in any case, cut where texts are joined by "\\x00", characters
    whose lower case is ASCII, surrogates), the verdict is the plain check's."""
    text = "\x00".join(texts)
    if long:  # too long to be gated: the scanner alone decides
        text = "hello 17 " * (_GATED_UP_TO // 9 + 1) + text
    assert may_hold_credentials(text) is plain_may_hold_credentials(text)


@settings(max_examples=150, deadline=None)
@given(before=_FILLER, part=st.one_of(_PART, _PIECE), after=_FILLER, long=st.booleans())
def test_the_verdict_on_one_part_or_piece_is_the_plain_checks(
    before: str, part: str, after: str, long: bool
) -> None:
    """One part or a piece of one, spelled in any case or with a character whose lower case
    is its letter, among text without gate characters: the gate alone decides (when the
    text is short enough to be gated)."""
    text = before + ("hello 17 " * (_GATED_UP_TO // 9 + 1) if long else "") + part + after
    assert may_hold_credentials(text) is plain_may_hold_credentials(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", False),
        ('{"text": "hello 17"}', False),
        ('{"text": "r0-0"}\x00{"text": "r0-1"}', False),
        ('{"location": "Paris", "unit": "celsius"}', False),  # the gate opens: the scanner decides
        ('{"PASSWORD": 1}', True),
        ("\u212aey", True),  # KELVIN SIGN lower-cases to k
        ("s\u0130d", False),  # İ lower-cases to i and a combining dot: no `sid`
        ("ke\x00y", False),
        ("\ud800 token", True),
        ("中文 https://example.com", True),
        ("hello 17 " * 100 + "TOKEN", True),  # too long to be gated
        ("hello 17 " * 100 + "\x00Jwt", True),
        ("hello 17 " * 100, False),
    ],
)
def test_verdicts(text: str, expected: bool) -> None:
    """Known texts, each on a path through the check."""
    assert may_hold_credentials(text) is expected
    assert plain_may_hold_credentials(text) is expected
