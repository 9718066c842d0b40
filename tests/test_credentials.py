"""The credential rule shared by the result cache and the recorder, and its redaction."""

from __future__ import annotations

import ast
import base64
import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import cache
from dispatcher import Dispatcher, Registry, Status, Tool, ToolCall, _credentials, replay
from dispatcher._credentials import (
    carries_credentials,
    credential_values,
    echoes_credentials,
    is_credential_name,
    is_credential_parameter,
    is_marker,
    redact,
    redact_arguments,
    redact_collecting,
    redact_json_text,
    redact_text,
    url_credentials,
)

SECRET = "hunter2-Secret"
MARK = redact(SECRET)


# --- names, by words ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["Authorization", "authorization", "Proxy-Authorization", "Cookie", "Set-Cookie", "DPoP",
     "X-Api-Key", "X-Auth-Token", "Api-Key", "Private-Token", "X-Goog-Api-Key",
     "Ocp-Apim-Subscription-Key", "X-Author-Token", "apiKey", "APIKey", "api_key", "apikey",
     "SessionId", "session", "PHPSESSID", "JSESSIONID", "x-amz-signature", "X-Hub-Signature-256",
     "XAuthToken", "OAuth", "client_secret", "password", "db_passwd", "token2", "X-CSRFToken",
     "credentials", "X-Amz-Credential", "bearer"],
)  # fmt: skip
def test_credential_names(name: str) -> None:
    """A standard credential header, or a name with a secret's word in it, is a credential."""
    assert is_credential_name(name)


@pytest.mark.parametrize(
    "name",
    ["Monkey", "monkey", "Keyboard", "keyword", "Author", "author_name", "Design", "Accept",
     "User-Agent", "Content-Type", "max_tokens", "keys", "tokens", "Passage", "code", "path", "q",
     "Sessions", "X-Request-Id", "Signed", ""],
)  # fmt: skip
def test_names_that_only_look_like_credentials(name: str) -> None:
    """Judged by whole words: a secret's word inside a longer word (Monkey, Author) is not one."""
    assert not is_credential_name(name)


@pytest.mark.parametrize(
    ("name", "secret"),
    [("code", True), ("CODE", True), ("sig", True), ("access_token", True), ("id_token", True),
     ("refresh_token", True), ("client_secret", True), ("api_key", True), ("X-Amz-Signature", True),
     ("country_code", False), ("zip_code", False), ("codes", False), ("q", False), ("page", False)],
)  # fmt: skip
def test_query_parameters_add_the_oauth_names(name: str, secret: bool) -> None:
    """A query parameter is judged by the name rule, and `code`, `sig` and the OAuth names count whole."""
    assert is_credential_parameter(name) is secret


# --- carries_credentials ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        {"url": "https://e.com", "headers": {"X-Api-Key": "x"}},
        {"url": "https://e.com", "headers": {"Ocp-Apim-Subscription-Key": "x"}},
        {"url": "https://e.com", "headers": [["Private-Token", "x"]]},
        {"url": "https://e.com/?code=abc"},
        {"url": "https://e.com/?a=1&sig=abc"},
        {"url": "https://e.com/?access_token="},
        {"url": "https://user:pass@e.com/"},
        {"url": "https://token@e.com/"},
        {"href": "https://e.com/?id_token=x"},
        {"url": "https://e.com", "params": {"code": "x"}},
    ],
)
def test_credentials_are_carried(args: dict[str, Any]) -> None:
    """A credential header, query parameter, `params` entry or URL user info is noticed."""
    assert carries_credentials(args)


@pytest.mark.parametrize(
    "args",
    [
        {"url": "https://e.com", "headers": {"Monkey": "x", "Author": "y", "Keyboard": "z"}},
        {"url": "https://e.com/?country_code=US&keyword=cats"},
        {"url": "https://e.com/path/code"},
        {"api_key": "x"},  # an argument, not a request part: the recorder hides it, the cache may keep it
        {"url": "http://[::1"},
    ],
)
def test_requests_without_credentials(args: dict[str, Any]) -> None:
    """Names that only look like credentials, and plain URLs, carry none."""
    assert not carries_credentials(args)


def test_the_cache_uses_the_kernel_rule() -> None:
    """`cache.carries_credentials` answers as the kernel's rule does."""
    for args in ({"headers": {"X-Goog-Api-Key": "k"}}, {"url": "https://e.com/?code=1"}, {"q": "x"}):
        assert cache.carries_credentials(args) is carries_credentials(args)


def test_url_credentials_are_the_decoded_values() -> None:
    """A URL's password and credential query values come back percent-decoded; others do not come back."""
    found = url_credentials("https://me:p%40ss@e.com/x?q=cats&api_key=a%2Bb&code=&page=2")
    assert found == ["p@ss", "a+b", ""]
    assert url_credentials("https://ghp_token@github.com/x") == ["ghp_token"]
    assert url_credentials("https://e.com/?q=1") == []


# --- the marker ---------------------------------------------------------------------------------


def test_the_marker_keeps_length_and_hash_only() -> None:
    """A marker records the value's length and xxh3-64, never the value; it uses URL-safe characters."""
    digest = xxhash.xxh3_64_hexdigest(SECRET.encode())
    assert redact(SECRET) == f"redacted.len-{len(SECRET)}.xxh3-{digest}"
    assert SECRET not in MARK and re.fullmatch(r"[A-Za-z0-9._~-]+", MARK)
    assert redact("héllo!") == f"redacted.len-6.xxh3-{xxhash.xxh3_64_hexdigest('héllo!'.encode())}"


def test_the_same_secret_gives_the_same_marker_and_another_a_different_one() -> None:
    """Markers are deterministic, distinguish secrets, and are never redacted again."""
    assert redact(SECRET) == MARK and redact(SECRET + "x") != MARK
    assert redact(MARK) == MARK and is_marker(MARK) and not is_marker(SECRET)


# --- redact_arguments ---------------------------------------------------------------------------


def test_credential_headers_are_redacted_and_others_kept() -> None:
    """Credential header values become markers, as mapping or as pairs; other headers stay."""
    args = {"headers": {"X-Api-Key": SECRET, "Monkey": "banana", "Accept": "text/html"}}
    assert redact_arguments(args) == {
        "headers": {"X-Api-Key": MARK, "Monkey": "banana", "Accept": "text/html"}
    }
    pairs = {"headers": [["Cookie", SECRET], ["Accept", "x"]]}
    assert redact_arguments(pairs) == {"headers": [["Cookie", MARK], ["Accept", "x"]]}


def test_a_url_keeps_every_byte_but_its_credentials() -> None:
    """In a URL only the password and the credential query values change; escapes, order, fragment stay."""
    url = "https://me:hunter2@e.com/a%20b?q=a+b&api_key=x%2By&code=c0de&page=2#top"
    redacted = redact_arguments({"url": url})["url"]
    assert redacted == (
        f"https://me:{redact('hunter2')}@e.com/a%20b?q=a+b&api_key={redact('x+y')}&code={redact('c0de')}&page=2#top"
    )
    assert redact_arguments({"url": "https://e.com/?q=1#x"})["url"] == "https://e.com/?q=1#x"


def test_a_url_without_a_host_is_redacted_where_it_carries_credentials() -> None:
    """A `url` argument is redacted whenever the cache would see credentials in it, host or not."""
    args = {"url": "mailto:me@e.com?subject=hi&token=abc123"}
    assert carries_credentials(args)
    assert redact_arguments(args) == {"url": f"mailto:me@e.com?subject=hi&token={redact('abc123')}"}


def test_a_lone_user_name_in_a_url_is_redacted() -> None:
    """`https://<token>@host` puts the secret in the user name: it is hidden too."""
    assert redact_arguments({"url": "https://ghp_abc123@github.com/r"}) == {
        "url": f"https://{redact('ghp_abc123')}@github.com/r"
    }


def test_arguments_named_like_credentials_are_redacted_at_any_depth() -> None:
    """`api_key`, `password`, nested `auth` objects, URLs in lists are hidden; a `code` argument is not."""
    args = {
        "api_key": SECRET,
        "code": "print(1)",
        "options": {"password": "pw-123456", "verbose": True, "links": ["https://e.com/?sig=abc"]},
        "auth": {"user": "me", "pin": 4321, "on": True, "none": None},
        "session_token": "",
    }
    assert redact_arguments(args) == {
        "api_key": MARK,
        "code": "print(1)",
        "options": {"password": redact("pw-123456"), "verbose": True, "links": [f"https://e.com/?sig={redact('abc')}"]},
        "auth": {"user": redact("me"), "pin": 1000, "on": True, "none": None},
        "session_token": "",
    }  # fmt: skip


def test_params_use_the_query_rule() -> None:
    """In `params`, `code` and `sig` are credentials, as in a URL; a number becomes a marker too."""
    args = {"params": {"code": "abc", "sig": 17, "country_code": "US"}}
    assert redact_arguments(args) == {"params": {"code": redact("abc"), "sig": 10, "country_code": "US"}}


def test_bodies_are_redacted_by_field_or_whole() -> None:
    """A JSON body by field, a form body by parameter, any other body of a credentialed request whole."""
    as_json = redact_arguments({"body": json.dumps({"user": "me", "password": SECRET})})["body"]
    assert json.loads(as_json) == {"user": "me", "password": MARK}
    form = redact_arguments({"body": f"grant_type=client_credentials&client_secret={SECRET}"})["body"]
    assert form == f"grant_type=client_credentials&client_secret={MARK}"
    raw = {"headers": {"Authorization": "Bearer t"}, "body": "free text " + SECRET}
    assert redact_arguments(raw)["body"] == redact("free text " + SECRET)
    plain = {"body": "free text, no credentials"}
    assert redact_arguments(plain) == plain
    nested = {"body": {"client": {"secret": SECRET}}}
    assert redact_arguments(nested) == {"body": {"client": {"secret": MARK}}}


@pytest.mark.parametrize(
    ("value", "redacted"),
    [
        ("\n" + json.dumps({"password": SECRET}) + "\n", "\n" + json.dumps({"password": MARK}) + "\n"),
        ("\t\r [" + json.dumps({"api_key": SECRET}) + "] ", "\t\r [" + json.dumps({"api_key": MARK}) + "] "),
        (" https://bob:" + SECRET + "@h.example/", " https://bob:" + MARK + "@h.example/"),
        ("\n\thttps://h.example/?token=" + SECRET, "\n\thttps://h.example/?token=" + MARK),
    ],
)
def test_json_or_a_url_after_whitespace_is_redacted_keeping_the_whitespace(value: str, redacted: str) -> None:
    """A text holding JSON or a URL after whitespace is redacted as one; its whitespace stays."""
    assert redact_arguments({"content": value}) == {"content": redacted}
    assert redact_arguments({"content": redacted}) == {"content": redacted}


def test_redaction_leaves_the_arguments_alone() -> None:
    """`redact_arguments` returns a copy: the caller's arguments are not changed."""
    args = {"headers": {"Authorization": SECRET}, "url": "https://e.com/?token=abc"}
    before = copy.deepcopy(args)
    redact_arguments(args)
    assert args == before


_names = st.sampled_from(
    ["api_key", "Authorization", "url", "headers", "params", "body", "q", "code", "auth"]
)
_leaves = st.one_of(
    st.text(max_size=12),
    st.integers(),
    st.booleans(),
    st.none(),
    st.sampled_from(["https://u:p@e.com/?code=1&q=2", "a=1&password=2", '{"token": "t"}', "Bearer xyz"]),
)
_values = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_names, inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_names, _values, max_size=4))
def test_redaction_is_idempotent_and_keeps_credentials_noticeable(args: dict[str, Any]) -> None:
    """Redacting twice is redacting once (replay relies on it); a redacted call still carries credentials."""
    once = redact_arguments(args)
    assert redact_arguments(once) == once
    assert carries_credentials(once) is carries_credentials(args)
    assert credential_values(once) == frozenset()  # nothing left to hide


# --- secrets echoed in results ------------------------------------------------------------------


def test_credential_values_include_the_forms_a_server_echoes() -> None:
    """The secrets include a header's token without its scheme, both forms of a URL part, Basic's base64."""
    args = {
        "headers": {"Authorization": "Bearer tok-123456"},
        "url": "https://me:p%40ssword@e.com/?api_key=a%2Bb",
    }
    basic = base64.b64encode(b"me:p@ssword").decode()
    assert credential_values(args) >= {"Bearer tok-123456", "tok-123456", "p@ssword", "p%40ssword", basic,
                                       "a+b", "a%2Bb"}  # fmt: skip


def test_redact_text_replaces_echoed_secrets_of_six_characters_or_more() -> None:
    """An echoed secret of six characters or more becomes its marker; shorter ones would hit words."""
    text = f"echo: Bearer {SECRET}; pin abc"
    assert (
        redact_text(text, {f"Bearer {SECRET}", SECRET, "abc"})
        == f"echo: {redact('Bearer ' + SECRET)}; pin abc"
    )
    assert redact_text("nothing here", {SECRET}) == "nothing here"


# --- the module ---------------------------------------------------------------------------------


def test_the_cache_package_can_be_imported_first() -> None:
    """`cache` reaches the kernel's rule lazily, so importing it before `dispatcher` works."""
    code = "import cache; print(cache.carries_credentials({'headers': {'Api-Key': 'k'}}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr


def test_the_rule_imports_only_the_standard_library_xxhash_and_ahocorasick_rs() -> None:
    """The kernel's credential rule does no I/O and never imports the cache package."""
    tree = ast.parse(Path(_credentials.__file__).read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
        if not (isinstance(node, ast.ImportFrom) and node.level)
    }
    assert imported - {"__future__"} <= set(sys.stdlib_module_names) | {"xxhash", "ahocorasick_rs"}
    assert not imported & {"cache", "os", "io", "pathlib", "socket", "dispatcher"}


def test_every_credential_word_and_name_holds_a_part_the_quick_check_looks_for() -> None:
    """`may_hold_credentials` looks for parts of the words; every word and name has one."""
    from dispatcher._credentials import _MAY_HOLD, _PARAMETER_NAMES, _STANDARD_NAMES, _WORDS

    for word in _WORDS | _STANDARD_NAMES | _PARAMETER_NAMES:
        assert any(part in word for part in _MAY_HOLD), word


_PIECES = st.sampled_from(
    ["text", "path", "Api", "Key", "token", "url", "https://u:p@h/?code=1", "headers", "params", "body",
     "a=b&sig=c", "%74oken", "x", "Authorization", "Bearer abc", "mode", "é", "monkey", "1"]
)  # fmt: skip
_ARGS = st.recursive(
    st.one_of(_PIECES, st.integers(), st.none()),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_PIECES, inner, max_size=3),
    max_leaves=8,
)


@given(args=st.dictionaries(_PIECES, _ARGS, max_size=4))
def test_arguments_the_quick_check_clears_redact_to_themselves(args: dict[str, Any]) -> None:
    """What `may_hold_credentials` clears (as JSON text) redacts to itself, with no secret found."""
    from dispatcher._credentials import may_hold_credentials, redact_collecting

    redacted, secrets = redact_collecting(args)
    if not may_hold_credentials(json.dumps(args, ensure_ascii=False)):
        assert redacted == args and not secrets
    assert (redacted, secrets) == (redact_arguments(args), credential_values(args))


_TEXTS = st.one_of(_PIECES, st.text(max_size=12), st.text(alphabet='kKeyYtTo:/%@\\ "\n', max_size=8))
_JSON = st.recursive(
    st.one_of(_TEXTS, st.integers(), st.floats(allow_nan=False), st.booleans(), st.none()),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXTS, inner, max_size=3),
    max_leaves=10,
)


@given(args=st.dictionaries(_TEXTS, _JSON, max_size=4), ascii_only=st.booleans(), spaced=st.booleans())
def test_what_the_quick_check_clears_in_a_calls_text_it_clears_in_its_canonical_form(
    args: dict[str, Any], ascii_only: bool, spaced: bool
) -> None:
    """Arguments text `may_hold_credentials` clears holds nothing its canonical form could
    add (the recording scans a batch's canonical arguments only when a rewriter ran)."""
    from dispatcher._credentials import may_hold_credentials
    from dispatcher._plan import canonical_json

    text = json.dumps(args, ensure_ascii=ascii_only, separators=(", ", ": ") if spaced else (",", ":"))
    if not may_hold_credentials(text):
        assert not may_hold_credentials(canonical_json(json.loads(text)))


@pytest.mark.parametrize(
    ("value", "expected"), [(4321, 1000), (-73, -10), (0, 1), (7, 1), (10**20 + 5, 10**20)]
)
def test_a_number_under_a_credential_name_becomes_a_stand_in_of_its_length(value: int, expected: int) -> None:
    """A whole number under a credential's name is replaced by the smallest number of its
    length and sign (still a number for the schema), and a stand-in stays itself."""
    assert redact_arguments({"api_key": value}) == {"api_key": expected}
    assert redact_arguments({"api_key": expected}) == {"api_key": expected}


async def test_a_recording_with_a_numeric_credential_replays(tmp_path: Path) -> None:
    """A call whose credential-named argument is a number records without it and replays:
    the stand-in still satisfies the schema's type."""

    def handler(args: Any, ctx: Any) -> str:
        return "ok"

    schema = {"type": "object", "properties": {"Pwd": {"type": "integer"}}}
    reg = Registry([Tool("t", "T.", handler, schema, deferred=False)])
    path = tmp_path / "r.jsonl"
    s = Dispatcher(reg).session("s", record=path)
    [r] = await s.dispatch([ToolCall("1", "t", {"Pwd": 918273})])
    s.close()
    assert r.ok and "918273" not in path.read_text()
    report = await replay(path, Dispatcher(reg))
    assert report.ok, report


# --- arguments given as JSON text --------------------------------------------------------

TEXT_SECRET = "sk-live-abcdefghijklmnop123456"


@pytest.mark.parametrize(
    ("text", "seen"),
    [
        # a key given twice: json keeps the last, the first one's secret stays in the text
        ('{"headers": {"Authorization": "Bearer %s"}, "headers": {}}', False),
        ('{"body": "{\\"password\\": \\"%s\\", \\"password\\": 1}"}', False),
        # JSON that is not an object
        ('[{"api_key": "%s"}]', True),
        ('"https://user:%s@example.com/"', True),
        # text that does not parse
        ('{"api_key": "%s", ', True),
        ('{"api_key": "%s', True),
        ('{"url": "https://user:%s@example.com/?x=1", ', True),
        ('{"token": "%s", "n": 1 2}', True),
    ],
)
def test_json_text_never_keeps_a_secret(text: str, seen: bool) -> None:
    """Whatever the text, the secret is not in what is written; where it can be read, it is
    among the secrets found (for a result that echoes it). A key given twice loses its first
    value to json, which is not read then, but not written either."""
    redacted, found = redact_json_text(text % TEXT_SECRET)
    assert TEXT_SECRET not in redacted
    assert (TEXT_SECRET in found) is seen


@pytest.mark.parametrize(
    "text",
    ['{"api_key": "%s", ', '{"token": "%s", "n": 1 2}', '{"url": "https://u:%s@h/x" "y": 1}', '{"key": [1,'],
)
def test_text_that_does_not_parse_fails_where_it_did(text: str) -> None:
    """Stand-ins of a secret's length: reading the redacted text fails at the same place,
    so a replay of the call says what the live call said."""
    original = text % TEXT_SECRET if "%s" in text else text
    redacted, _ = redact_json_text(original)
    assert len(redacted) == len(original) and TEXT_SECRET not in redacted
    with pytest.raises(json.JSONDecodeError) as live:
        json.loads(original)
    with pytest.raises(json.JSONDecodeError) as again:
        json.loads(redacted)
    assert (again.value.msg, again.value.pos) == (live.value.msg, live.value.pos)


@pytest.mark.parametrize(
    "text", ['{"path": "a.txt"}', '{"a": 1, "a": 2}', '{"note": "key"}', '{"path": "a.txt", ', "[1, 2]"]
)
def test_json_text_without_a_secret_is_kept_byte_for_byte(text: str) -> None:
    assert redact_json_text(text) == (text, frozenset())


def test_a_key_given_twice_is_written_as_json_read_it() -> None:
    """Where a credential could be, a text that gives a key twice is written anew from what
    json read (the last value): what the first held is gone from the text, as from the call."""
    assert redact_json_text('{"note": "key", "note": "x"}') == ('{"note": "x"}', frozenset())


@pytest.mark.parametrize(
    "args",
    [
        {"content": '{"api_key": "%s", "n": 1}'},
        {"q": '[{"headers": {"Authorization": "Bearer %s"}}]'},
        {"outer": {"config": '{"password": "%s"}'}},
        {"content": '{"token": "x", "token": "%s"}'},
    ],
)
def test_a_text_argument_holding_json_is_read_as_what_it_holds(args: dict[str, Any]) -> None:
    """A config file's content, a query: JSON given as a text argument is redacted as a
    `body` is, and redacting the result again changes nothing."""

    def filled(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: filled(v) for k, v in value.items()}
        return value % TEXT_SECRET if isinstance(value, str) and "%s" in value else value

    redacted, found = redact_collecting(filled(args))
    assert TEXT_SECRET not in json.dumps(redacted) and TEXT_SECRET in found
    assert redact_arguments(redacted) == redacted


@pytest.mark.parametrize("text", ["{not json, key}", "[1, 2, 3]", '{"note": "a key"}', "{"])
def test_a_text_argument_that_only_looks_like_json_is_kept(text: str) -> None:
    assert redact_arguments({"content": text}) == {"content": text}


@pytest.mark.parametrize("item", [{"Jwt": 0}, {"api_key": "sk-live-0123456789abcdef"}, {"x": 1, "token": 42}])
async def test_an_unreadable_call_is_quoted_redacted_and_replays(
    tmp_path: Path, item: dict[str, Any]
) -> None:
    """A call of no known shape is refused quoting it redacted: its credential is not said back
    nor kept in the recording, which replays it (redacted) to the same words."""
    path = tmp_path / "s.jsonl"

    async def echo(args: Any, ctx: Any) -> str:
        return str(args)

    registry = Registry([Tool("echo", "Echo.", echo, {"type": "object"}, deferred=False)])
    s = Dispatcher(registry).session("unreadable", record=path)
    [result] = await s.dispatch([item])
    s.close()
    assert result.status is Status.invalid_arguments and "unreadable tool call" in result.content
    kept = path.read_text()
    assert repr(item) not in result.content and repr(item) not in kept  # as it was sent: not quoted
    assert all(v not in result.content + kept for v in item.values() if isinstance(v, str))
    report = await replay(path, Dispatcher(registry))
    assert report.ok, report


@pytest.mark.parametrize(
    ("args", "text", "echoes"),
    [
        ({"api_key": "sk-abcdef123"}, "the key sk-abcdef123 works", True),
        ({"api_key": "sk-abcdef123"}, "42 degrees", False),  # cached as before: nothing shown
        ({"config": {"Authorization": "Bearer tok-987654"}}, "sent Bearer tok-987654", True),
        ({"items": [{"password": "hunter2-long"}]}, "hunter2-long", True),
        ({"text": "sk-abcdef123"}, "sk-abcdef123", False),  # no name says it is one
        ({"api_key": "abc"}, "abc", False),  # shorter than an echo is looked for
    ],
)
def test_a_result_echoing_a_credential_named_as_an_argument_is_told(
    args: dict[str, Any], text: str, echoes: bool
) -> None:
    """A result that shows a credential its call gave under a credential's name is told
    apart (kept out of the result cache); one that shows none is not."""
    assert echoes_credentials(args, text) is echoes


def test_a_result_of_arguments_the_redactor_cannot_read_counts_as_echoing() -> None:
    """Arguments whose names cannot be read as text are taken to echo (kept out of the
    result cache), rather than raising in pass 3."""

    class Unreadable:
        def __str__(self) -> str:
            raise RuntimeError("no text")

    assert echoes_credentials({"api_key": "sk-abcdef123", Unreadable(): 1}, "anything") is True
