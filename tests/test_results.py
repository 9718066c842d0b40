"""The failure contract and output normalisation: what every result's content looks like."""

from __future__ import annotations

import json

import pytest

from dispatcher import Status
from dispatcher._results import (
    DEFAULT_MAX_OUTPUT_BYTES,
    failure_content,
    failure_result,
    normalize_output,
    well_formed,
)

FAILURES = [s for s in Status if s is not Status.ok]

# DESIGN.md, failure contract: status -> retryable by default
CONTRACT_RETRYABLE = {
    Status.failed: True,
    Status.rejected: False,
    Status.invalid_arguments: True,
    Status.schema_required: True,
    Status.denied: False,
    Status.timed_out: True,
    Status.expired: False,
}


# -- normalize_output -------------------------------------------------------------------


def test_str_output_is_kept() -> None:
    """A str is the content as it is, non-ASCII included."""
    assert normalize_output("héllo ☃\nline") == "héllo ☃\nline"


def test_bytes_output_is_decoded_as_utf8() -> None:
    """Bytes are decoded as UTF-8."""
    assert normalize_output("ünï".encode()) == "ünï"
    assert normalize_output(bytearray(b"abc")) == "abc"
    assert normalize_output(memoryview(b"xyz")) == "xyz"


def test_ill_formed_bytes_become_replacement_characters() -> None:
    """Ill-formed UTF-8 bytes become U+FFFD."""
    out = normalize_output(b"ok \xff\xfe end \xe2\x82")
    assert out.startswith("ok \ufffd")
    assert "end \ufffd" in out
    out.encode("utf-8")  # well-formed


def test_lone_surrogates_become_replacement_characters() -> None:
    """A lone surrogate in a str becomes U+FFFD, so the content encodes as UTF-8."""
    out = normalize_output("a\ud800b\udfffc")
    assert out == "a\ufffdb\ufffdc"
    assert out.encode("utf-8") == "a\ufffdb\ufffdc".encode()


def test_well_formed_leaves_good_text_alone() -> None:
    """Text that is already well-formed is returned unchanged."""
    text = "plain ascii"
    assert well_formed(text) is text
    assert well_formed("emoji 😀") == "emoji 😀"


def test_dict_output_is_json() -> None:
    """A dict becomes its JSON, non-ASCII kept as characters."""
    out = normalize_output({"b": 1, "a": "é"})
    assert json.loads(out) == {"b": 1, "a": "é"}
    assert "é" in out


def test_list_output_is_json() -> None:
    """A list becomes its JSON."""
    assert json.loads(normalize_output([1, "two", None])) == [1, "two", None]


def test_dict_with_lone_surrogate_is_well_formed() -> None:
    """A dict holding a lone surrogate becomes well-formed JSON text."""
    out = normalize_output({"k": "x\udc80"})
    out.encode("utf-8")
    assert json.loads(out) == {"k": "x\ufffd"}


def test_none_output_is_empty() -> None:
    """None becomes the empty string."""
    assert normalize_output(None) == ""


def test_other_values_are_json_with_str_fallback() -> None:
    """Values JSON cannot write directly fall back to str()."""
    assert normalize_output(42) == "42"
    assert normalize_output({"when": {1}}) == '{"when": "{1}"}'


def test_output_under_the_limit_is_not_cut() -> None:
    """Output at or under the limit is kept whole."""
    text = "é" * 50  # 100 bytes
    assert normalize_output(text, limit=100) == text


def test_output_over_the_limit_is_cut_with_a_marker() -> None:
    """Output over the limit is cut, with a marker naming its size and the limit."""
    text = "x" * 1000
    out = normalize_output(text, limit=100)
    kept, marker = out.split("\n", 1)
    assert kept == "x" * 100
    assert marker == "[output truncated: 1000 bytes, showing the first 100]"


def test_cut_falls_on_a_character_boundary() -> None:
    """A cut never splits a multi-byte character: it keeps only whole characters."""
    text = "é" * 100  # 200 bytes
    out = normalize_output(text, limit=51)
    kept = out.split("\n", 1)[0]
    assert kept == "é" * 25
    assert "\ufffd" not in out
    assert "200 bytes" in out
    assert len(kept.encode()) <= 51


def test_cut_applies_to_bytes_output() -> None:
    """Bytes output over the limit is cut the same way."""
    out = normalize_output(b"a" * 300, limit=10)
    assert out.startswith("a" * 10 + "\n[output truncated: 300 bytes")


def test_default_output_limit_is_256_kib() -> None:
    """The default output limit is 256 KiB."""
    assert DEFAULT_MAX_OUTPUT_BYTES == 256 * 1024
    exact = "x" * DEFAULT_MAX_OUTPUT_BYTES
    assert normalize_output(exact) == exact
    assert normalize_output(exact + "y").endswith(f"showing the first {DEFAULT_MAX_OUTPUT_BYTES}]")


# -- failure_content ----------------------------------------------------------------------


def test_failure_content_is_a_json_line_then_next() -> None:
    """A failure's content is the contract's JSON line, then a `next:` line."""
    content = failure_content(
        Status.rejected, "Tool not found: x", retryable=False, effect_uncertain=False, hint="call y"
    )
    head, tail = content.split("\n")
    assert json.loads(head) == {
        "error": "Tool not found: x",
        "status": "rejected",
        "retryable": False,
        "effect_uncertain": False,
    }
    assert list(json.loads(head)) == ["error", "status", "retryable", "effect_uncertain"]
    assert tail == "next: call y"


def test_failure_content_without_hint_is_one_line() -> None:
    """With no hint and no detail, the content is the JSON line alone."""
    content = failure_content(Status.failed, "boom", retryable=True, effect_uncertain=True)
    assert "\n" not in content
    assert json.loads(content)["effect_uncertain"] is True


def test_failure_content_detail_sits_between() -> None:
    """A detail block sits between the JSON line and the `next:` line."""
    content = failure_content(
        Status.invalid_arguments,
        "bad",
        retryable=True,
        effect_uncertain=False,
        detail="required: a, b",
        hint="fix it",
    )
    assert content.split("\n")[1:] == ["required: a, b", "next: fix it"]


def test_failure_content_is_well_formed() -> None:
    """Error, detail and hint with lone surrogates are made well-formed."""
    content = failure_content(
        Status.failed, "bad \ud800", retryable=True, effect_uncertain=False, detail="d\udfff", hint="h\ud801"
    )
    content.encode("utf-8")
    assert json.loads(content.split("\n")[0])["error"] == "bad \ufffd"


# -- failure_result -----------------------------------------------------------------------


@pytest.mark.parametrize("status", FAILURES)
def test_failure_result_default_retryable_follows_the_contract(status: Status) -> None:
    """Each failing status has DESIGN.md's default retryable, and effect_uncertain false."""
    r = failure_result("c1", "t", status, "why")
    assert r.retryable is CONTRACT_RETRYABLE[status]
    assert r.effect_uncertain is False
    assert r.status is status
    err = r.error()
    assert err is not None
    assert err["status"] == status.value
    assert err["retryable"] is CONTRACT_RETRYABLE[status]


def test_contract_table_covers_every_failing_status() -> None:
    """The table in this test names every status but ok."""
    assert set(CONTRACT_RETRYABLE) == set(FAILURES)


def test_failure_result_overrides() -> None:
    """retryable and effect_uncertain may be given; timings are kept."""
    r = failure_result(
        "c1", "t", Status.failed, "boom", retryable=False, effect_uncertain=True, started=5.0, duration=1.5
    )
    assert (r.retryable, r.effect_uncertain, r.started, r.duration) == (False, True, 5.0, 1.5)
    assert r.error() == {"error": "boom", "status": "failed", "retryable": False, "effect_uncertain": True}
    assert r.call_id == "c1" and r.name == "t"
    assert not r.ok


def test_failure_result_carries_the_hint() -> None:
    """failure_result puts the hint on a `next:` line."""
    r = failure_result("c1", "t", Status.rejected, "nope", hint="call find_tools")
    assert r.content.splitlines()[-1] == "next: call find_tools"


def test_failure_result_is_cut_at_the_limit() -> None:
    """A failure's content is held to the output limit too."""
    r = failure_result("c1", "t", Status.failed, "short", hint="h" * 500, limit=120)
    assert "[output truncated:" in r.content
    assert r.error() is not None  # the JSON line itself fits


def test_failure_over_the_limit_keeps_its_json_line() -> None:
    """A failure whose error is longer than the limit still opens with a valid JSON line."""
    r = failure_result("c1", "t", Status.invalid_arguments, "e" * 1000, limit=200)
    err = r.error()
    assert err is not None
    assert err["status"] == "invalid_arguments"
