"""The credential rule: which parts of a call are secrets, and how a recording hides them.

One rule serves both the result cache (a call that carries a credential is never cached)
and the recorder (a credential's value never reaches the file).

Names, by words
    A name is split into words at anything that is not a letter or digit, at camelCase
    humps and between letters and digits: `X-Api-Key` is x/api/key, `apiKey` api/key,
    `SessionId` session/id, `PHPSESSID` phpsessid, `token2` token/2. A header or argument
    name is a credential when it is a standard one (`Authorization`, `Cookie`,
    `Set-Cookie`, `DPoP`, ...) or one of its words is in `_WORDS` (key, token, secret,
    auth, authorization, session, signature, password, cookie, credential and a few
    more). Whole words only: `Monkey`, `Keyboard`, `Author` and `Design` are not
    credentials; `X-Author-Token` is (token). A query parameter (in a URL, in `params`,
    in a form body) is judged the same way, and `code`, `sig`, `access_token`,
    `id_token`, `refresh_token` and `client_secret` count whole, so `?code=` (an OAuth
    authorisation code) is one while `?country_code=` is not. URL user info is a credential.

The marker
    `redact(value)` is the text `redacted.len-N.xxh3-H`: N is the value's length in
    characters and H the 16 hex digits of xxh3-64 of its UTF-8 bytes. It is one string
    scheme everywhere (header values, arguments, URL parts, result text) because a
    recording is replayed through schema validation: a header's value must stay a
    string, and inside a URL the marker uses only characters that need no escaping.
    The same secret gives the same marker, so a replayed call keys and dedupes as it
    did; a different secret gives a different one. A marker is never redacted again.
    The hash is fast, not a password hash: a guessable secret can be confirmed from it.

What `redact_arguments` replaces, at any depth
    - the value of a key that is a credential name (`{"api_key": ...}`, `headers`
      `{"X-Api-Key": ...}`, `[["Cookie", ...]]` pairs); a mapping or list under such a
      key has every text and number inside replaced;
    - in `params`, the values of credential parameters;
    - in `url`, `uri` and `href`, and in any other text that is a URL (`scheme://...`,
      whitespace before it or not, kept):
      the values of credential query parameters, the password of its user info, and a
      user name that stands alone (`https://<token>@host`); every other byte of the URL
      is kept as written (tabs and line breaks, which URL parsing drops, are dropped);
    - a text `body`: a JSON object or array is redacted field by field, a form
      (`a=1&password=x`) parameter by parameter; any other text body of a call that
      carries credentials is replaced whole (the rule cannot see names in it), and in
      the body of one that carries none, JSON that does not parse is read as below;
    - any other text that holds a JSON object or array (a config file's content, a
      query) is read as what it holds, field by field, and written anew if that changes
      (the JSON whitespace around it kept as it was).
    Booleans and nulls are kept (they hide nothing), and so are empty texts. A number
    under a credential's name becomes a marker too: its secret outweighs a replay that
    then fails the tool's `integer` schema. `code` is a credential only as a query
    parameter: as an argument it is usually a program.

What `redact_json_text` replaces in text that does not parse
    It is read token by token: a name's escapes are undone before it is judged
    (`"\\u0074oken"` is `token`), an object or array under a credential's name is
    hidden whole, the second of a pair whose first is a credential name too, and a
    text's URLs, form and JSON are read with their escapes undone (`https:\\/\\/u:p@host`);
    a URL that ends the cut text may have lost the `@` of its user info, so what follows
    its colon is hidden. Each secret becomes a stand-in of its length (digits for a
    number; a bad escape or control character inside kept in its place), so the text
    fails to read where and as it did, and its call's error replays the same.

`credential_values(args)` are the secrets themselves, with the forms a server may echo
(a header's token without its scheme word, the percent-decoded and raw forms of a URL
part, the base64 of user info as Basic authentication sends it); `redact_text` replaces
each of at least `MIN_ECHO_LENGTH` characters in a result's text.

Nothing here does I/O. It imports the standard library, xxhash and ahocorasick_rs only;
never `cache`.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final
from urllib.parse import unquote, unquote_plus, urlsplit

import ahocorasick_rs
import xxhash

__all__ = [
    "MIN_ECHO_LENGTH",
    "carries_credentials",
    "echoes_credentials",
    "credential_values",
    "is_credential_name",
    "is_credential_parameter",
    "is_marker",
    "may_hold_credentials",
    "redact",
    "redact_arguments",
    "redact_call_arguments",
    "redact_collecting",
    "redact_json_text",
    "redact_text",
    "url_credentials",
]

# Headers that are credentials by name, whatever their words.
_STANDARD_NAMES: Final = frozenset(
    {"authorization", "proxy-authorization", "cookie", "set-cookie", "dpop", "x-csrftoken"}
)
_WORDS: Final = frozenset(
    {"key", "apikey", "token", "secret", "password", "passwd", "pwd", "passphrase", "signature",
     "sig", "auth", "oauth", "authorization", "authentication", "credential", "credentials",
     "session", "sessionid", "sessid", "phpsessid", "jsessionid", "sid", "jwt", "bearer",
     "cookie", "cookies", "hmac", "otp"}
)  # fmt: skip
# Query parameters that are credentials as a whole name (not as a word: `country_code` is not).
_PARAMETER_NAMES: Final = frozenset(
    {"code", "sig", "access_token", "id_token", "refresh_token", "client_secret"}
)
_WORD: Final = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_URL_START: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_FORM: Final = re.compile(r"[^=&\s]+=[^&\s]*(?:&[^=&\s]+=[^&\s]*)*")
_MARKER: Final = re.compile(r"redacted\.len-[0-9]+\.xxh3-[0-9a-f]{16}")
_URL_DROPPED: Final = re.compile(r"[\t\r\n]")
_JSON_SPACE: Final = " \t\r\n"  # what json reads around a value
_URL_KEYS: Final = ("url", "uri", "href")
_CARRIER_KEYS: Final = frozenset({"headers", "params", *_URL_KEYS})  # what `carries_credentials` reads

MIN_ECHO_LENGTH: Final = 6
"""Shorter secrets are not searched for in result text: they would match ordinary words."""


@functools.lru_cache(maxsize=4096)  # argument names repeat call after call
def is_credential_name(name: str) -> bool:
    """True if a header or argument named `name` holds a credential: a standard name, or
    one of its words is a secret's (`X-Api-Key`, `apiKey`, `Set-Cookie`), by whole words
    (`Monkey`, `Keyboard` and `Author` are not)."""
    if name.lower() in _STANDARD_NAMES:
        return True
    return any(word.lower() in _WORDS for word in _WORD.findall(name))


def is_credential_parameter(name: str) -> bool:
    """True if a query parameter named `name` holds a credential: by the name rule, or
    `code`, `sig`, `access_token`, `id_token`, `refresh_token`, `client_secret`."""
    return name.lower() in _PARAMETER_NAMES or is_credential_name(name)


def is_marker(value: object) -> bool:
    """True if `value` is a marker `redact` made."""
    return isinstance(value, str) and _MARKER.fullmatch(value) is not None


def redact(value: str) -> str:
    """The marker that stands for `value`: its length and xxh3-64; a marker stays itself."""
    if is_marker(value):
        return value
    digest = xxhash.xxh3_64_hexdigest(value.encode("utf-8", "surrogatepass"))
    return f"redacted.len-{len(value)}.xxh3-{digest}"


def stand_in(value: int) -> int:
    """A whole number that stands for `value` where a marker could not: the smallest with as
    many digits and the same sign (a PIN's range stays a PIN's range; 1 for one digit). It
    tells no more than a marker's length, and standing in for a stand-in changes nothing,
    so a recording replays; two secrets of one length are not told apart."""
    digits = len(str(abs(value)))
    number = 10 ** (digits - 1) if digits > 1 else 1
    return -number if value < 0 else number


# Any text a credential could be found in holds one of these, in lower case: a part of
# every word and name above (tests/test_credentials.py checks that each holds one), a
# URL, an escape or percent-encoding (either could spell a word in other letters), or
# user info. Text without any of them holds no credential: it need not be walked.
_MAY_HOLD: Final = (
    "key", "token", "secret", "pass", "pwd", "sig", "auth", "credential", "session", "sid", "jwt",
    "bearer", "cookie", "hmac", "otp", "dpop", "code", "://", "\\", "%", "@",
)  # fmt: skip
# The parts are sought all at once, in one pass over the text's bytes (a Rust Aho-Corasick
# automaton, `_SCANNER`). Its call costs ~0.3 us whatever the text; short text is
# gated first, since each part holds one of `_GATE_CHARACTERS` (tests/test_credentials_scan.py
# checks it): letters that short argument text often lacks (`{"text": "hello 17"}` has none),
# found in one `bytes.translate` into `_GATE` (a gate character becomes `x`, any other byte
# a space). Longer text nearly always holds one of them: gating it would cost a pass for
# nothing.
_SCANNER: Final = ahocorasick_rs.BytesAhoCorasick(
    [part.encode("ascii") for part in _MAY_HOLD], matchkind=ahocorasick_rs.MatchKind.LeftmostFirst
)
_GATE_CHARACTERS: Final = "bcjkpsu/\\%@"
_GATE: Final = bytes(
    ord("x") if byte < 128 and chr(byte) in _GATE_CHARACTERS else ord(" ") for byte in range(256)
)
_GATED_UP_TO: Final = 64  # bytes


def may_hold_credentials(text: str) -> bool:
    """False only if `text` (JSON of arguments, say) cannot hold anything the redactor
    hides: then redacting what it encodes changes nothing and finds no secret."""
    # In lower case, as bytes: ASCII text as `bytes.lower` makes it, which is `str.lower` on
    # ASCII (A to Z only; `str.isascii` costs nothing: CPython knows it of every string);
    # any other as `str.lower` makes it (KELVIN SIGN becomes `k`), then UTF-8, where an
    # ASCII character is a byte that nothing else holds.
    low = text.encode().lower() if text.isascii() else text.lower().encode("utf-8", "surrogatepass")
    if len(low) <= _GATED_UP_TO and low.translate(_GATE).isspace():
        return False
    # leftmost-first finds a match wherever any part occurs; it lists every match, not only
    # the first, but text that holds one is redacted next, at far greater cost
    return _SCANNER.find_matches_as_indexes(low) != []


def _query_pieces(query: str) -> list[tuple[str, str, str]]:
    """(name as written, "=" or "", value as written) for each `&`-separated piece."""
    pieces = []
    for piece in query.split("&"):
        name, eq, value = piece.partition("=")
        pieces.append((name, eq, value))
    return pieces


def url_credentials(url: str) -> list[str]:
    """The credentials in a URL, percent-decoded: its user info's password (or its user
    name when that stands alone) and each credential query parameter's value, empty
    ones included. Empty when it carries none or cannot be parsed."""
    try:
        parts = urlsplit(url)
        username, password = parts.username, parts.password
    except ValueError:
        return []
    found: list[str] = []
    if password is not None:
        found.append(unquote(password))
    elif username is not None:
        found.append(unquote(username))
    if parts.query:
        for name, _, value in _query_pieces(parts.query):
            if is_credential_parameter(unquote_plus(name)):
                found.append(unquote_plus(value))
    return found


def _header_names(headers: object) -> Iterable[str]:
    if isinstance(headers, Mapping):
        return (str(name) for name in headers)
    if isinstance(headers, list | tuple):
        return (str(pair[0]) for pair in headers if isinstance(pair, list | tuple) and pair)
    return ()


def carries_credentials(args: Mapping[str, Any]) -> bool:
    """True if the arguments carry a credential: a credential header (mapping or pairs),
    a credential query parameter or user info in `url`/`uri`/`href`, or a credential
    parameter in `params`. Such a call's result is never written to the result cache."""
    if _CARRIER_KEYS.isdisjoint(args):  # the common call: none of the names looked at
        return False
    get = args.get
    headers = get("headers")
    if headers is not None and any(is_credential_name(name) for name in _header_names(headers)):
        return True
    for key in _URL_KEYS:
        value = get(key)
        if value is not None and isinstance(value, str) and url_credentials(value):
            return True
    params = get("params")
    return (
        params is not None
        and isinstance(params, Mapping)
        and any(is_credential_parameter(str(k)) for k in params)
    )


def echoes_credentials(args: Any, text: str) -> bool:
    """Whether `text` (a result's) holds a credential of `args` given under a name that
    says so, at any depth (`api_key`, `Authorization` as a plain argument: not a header,
    query or params, which keep a call out of the result cache whatever it returns).
    The common call, which names none, costs a cached lookup a name."""
    try:
        if not _names_a_credential(args):
            return False
        _, secrets = redact_collecting(args)
    except Exception:  # arguments the redactor cannot read (pass 3 must not raise): kept out
        return True
    return any(secret in text for secret in secrets if len(secret) >= MIN_ECHO_LENGTH)


def _names_a_credential(value: Any, depth: int = 0) -> bool:
    """Whether a mapping in `value` (`value` itself, or one inside it) has a key that names a
    credential (`is_credential_name`, cached)."""
    if depth > _MAX_NAME_DEPTH:
        return True  # deeper than arguments go: assume the worst
    if isinstance(value, Mapping):
        return any(
            is_credential_name(str(name)) or _names_a_credential(inner, depth + 1)
            for name, inner in value.items()
        )
    if isinstance(value, list | tuple):
        return any(_names_a_credential(inner, depth + 1) for inner in value)
    return False


_MAX_NAME_DEPTH = 64


class _Redactor:
    """One walk over a call's arguments: the redacted copy, and the secrets it hid."""

    def __init__(self) -> None:
        self.secrets: set[str] = set()

    def hide(self, value: str, *echoes: str) -> str:
        if not value or is_marker(value):
            return value
        self.secrets.add(value)
        self.secrets.update(e for e in echoes if e)
        return redact(value)

    def hide_all(self, value: Any) -> Any:
        """Everything under a credential's name: texts become markers, whole numbers stand-in
        numbers (see `stand_in`), so a schema that wants a number still finds one on replay."""
        if isinstance(value, str):
            _, _, token = value.partition(" ")  # "Bearer abc": a server may echo "abc" alone
            return self.hide(value, token.strip())
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, int):
            hidden = stand_in(value)
            if hidden != value:  # a stand-in already is not a secret
                self.secrets.add(str(value))
            return hidden
        if isinstance(value, float):
            return self.hide(json.dumps(value))
        if isinstance(value, Mapping):
            return {k: self.hide_all(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.hide_all(v) for v in value]
        return value

    def walk(self, value: Any) -> Any:
        if isinstance(value, Mapping):
            return self.mapping(value)
        if isinstance(value, list | tuple):
            return [self.walk(v) for v in value]
        if isinstance(value, str):
            # space before a URL or JSON (a config file's first line break, say) is kept
            start = len(value) - len(value.lstrip())
            if _URL_START.match(value, start):
                return value[:start] + self.url(value[start:])
            start = len(value) - len(value.lstrip(_JSON_SPACE))
            if value[start : start + 1] in ("{", "[") and may_hold_credentials(value):
                # a text argument that holds JSON (a config file's content, a query): read
                # as what it holds, as a `body` is; else a text like any other
                redacted = self.json_in(value)
                return value if redacted is None else redacted
            if "@" in value and "://" in value:
                # URLs inside a longer text (`git clone https://user:pass@host/...`): each
                # redacted in place, as in arguments that do not parse
                return _URL_IN_TEXT.sub(lambda found: self.url(found.group(0)), value)
        return value

    def json_in(self, text: str) -> str | None:
        """`text` redacted as the JSON object or array it holds, or None if it holds none;
        the JSON whitespace around it is kept as it was."""
        try:
            parsed, repeated = _loads_noting_repeats(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(parsed, dict | list):
            return None
        written = _written(text, parsed, self.walk(parsed), repeated)
        if written is text:
            return text
        inner = text.strip(_JSON_SPACE)
        lead = text[: len(text) - len(text.lstrip(_JSON_SPACE))]
        return lead + written + text[len(lead) + len(inner) :]

    def mapping(self, args: Mapping[Any, Any]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for key, value in args.items():
            name = str(key)
            if is_credential_name(name):
                out[key] = self.hide_all(value)
            elif name == "headers" and isinstance(value, list | tuple):
                out[key] = [self.header_pair(pair) for pair in value]
            elif name == "params" and isinstance(value, Mapping):
                out[key] = {
                    k: self.hide_all(v) if is_credential_parameter(str(k)) else self.walk(v)
                    for k, v in value.items()
                }
            elif name == "body" and isinstance(value, str):
                out[key] = self.body(value, args)
            elif name in _URL_KEYS and isinstance(value, str):  # what carries_credentials reads
                out[key] = self.url(value)
            else:
                out[key] = self.walk(value)
        return out

    def header_pair(self, pair: Any) -> Any:
        if isinstance(pair, list | tuple) and len(pair) == 2 and is_credential_name(str(pair[0])):
            return [pair[0], self.hide_all(pair[1])]
        return self.walk(pair)

    def query(self, query: str) -> str:
        pieces = []
        for name, eq, value in _query_pieces(query):
            if eq and is_credential_parameter(unquote_plus(name)):
                value = self.hide(unquote_plus(value), value)
            pieces.append(f"{name}{eq}{value}")
        return "&".join(pieces)

    def url(self, url: str) -> str:
        if _URL_DROPPED.search(url):  # urlsplit drops these, which would shift every offset
            url = _URL_DROPPED.sub("", url)
        try:
            parts = urlsplit(url)
            username = parts.username
        except ValueError:
            return url
        netloc = parts.netloc
        if username is not None:
            userinfo, _, host = netloc.rpartition("@")
            user, colon, secret = userinfo.partition(":")
            if colon:
                basic = f"{unquote(user)}:{unquote(secret)}".encode("utf-8", "surrogatepass")
                echo = base64.b64encode(basic).decode("ascii")
                secret = self.hide(unquote(secret), secret, echo)
            else:
                user = self.hide(unquote(user), user)
            netloc = f"{user}{colon}{secret}@{host}"
        query = self.query(parts.query) if parts.query else parts.query
        if netloc == parts.netloc and query == parts.query:
            return url
        # rebuilt by hand, not with urlunsplit, so that every other byte stays as written
        head = url[: url.index("//") + 2] if parts.netloc else ""
        rest = url[len(head) + len(parts.netloc) :]
        if query != parts.query:
            at = rest.index("?") + 1
            rest = rest[:at] + query + rest[at + len(parts.query) :]
        return head + netloc + rest

    def body(self, body: str, request: Mapping[Any, Any]) -> str:
        if (redacted := self.json_in(body)) is not None:
            return redacted
        if _FORM.fullmatch(body):
            return self.query(body)
        if is_marker(body):
            return body
        if carries_credentials(request):
            return self.hide(body)
        # JSON cut short, say: read as arguments text that does not parse is
        return _redact_unparsed(body, self) if may_hold_credentials(body) else body


def _written(text: str, parsed: Any, redacted: Any, repeated: bool) -> str:
    """JSON `text`, which read as `parsed`, once its credentials are `redacted`: as it stands
    if that changed nothing; else written anew from what was read (also when a key was
    given twice: what the first one held is in the text and nowhere in `parsed`)."""
    return text if redacted == parsed and not repeated else json.dumps(redacted, ensure_ascii=False)


def _loads_noting_repeats(text: str) -> tuple[Any, bool]:
    """`json.loads(text)`, and whether some object in it gives a key twice (json keeps the
    last: what the others held is in the text and nowhere in the value)."""
    repeated = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal repeated
        made = dict(items)
        if len(made) != len(items):
            repeated = True
        return made

    return json.loads(text, object_pairs_hook=pairs), repeated


# JSON text that does not parse, as tokens: a quoted text (perhaps cut short), a mark, or a
# bare word; the space between them is skipped
_JSON_TOKEN: Final = re.compile(r'"((?:[^"\\]|\\.)*)(?:"|\\?\Z)|[{}\[\],:]|[^\s,:{}\[\]"]+')
_JSON_NUMBER: Final = re.compile(r"-?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
# a URL in text: its scheme starts a word (so a long run of letters is not scanned again
# from each of them)
_URL_IN_TEXT: Final = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")


def redact_json_text(text: str) -> tuple[str, frozenset[str]]:
    """Arguments (or any JSON) given as text, with their credentials replaced, and the
    secrets hidden. Text that holds none comes back as it is, byte for byte. What parses is
    redacted as a value and written anew (also when a key is given twice, since json keeps
    only the last one's value and the earlier ones' would stay in the text; a JSON text
    holding an object or array, JSON encoded twice, is read as what it holds); what does
    not parse keeps every byte but the secrets the module's docstring lists for it."""
    if not may_hold_credentials(text):
        return text, frozenset()
    walker = _Redactor()
    try:
        parsed, repeated = _loads_noting_repeats(text)
    except (ValueError, RecursionError):
        return _redact_unparsed(text, walker), frozenset(walker.secrets)
    if isinstance(parsed, str) and parsed.lstrip()[:1] in ("{", "["):
        inner, found = redact_json_text(parsed)  # JSON given as a JSON text: encoded twice
        return (text, found) if inner == parsed else (json.dumps(inner, ensure_ascii=False), found)
    return _written(text, parsed, walker.walk(parsed), repeated), frozenset(walker.secrets)


def _decoded(inside: str) -> str:
    """What a quoted JSON text's inside reads as (escapes undone); as written if it cannot be read."""
    if "\\" not in inside:
        return inside
    try:
        value = json.loads(f'"{inside}"')
    except ValueError:
        return inside
    return value if isinstance(value, str) else inside


def _failing_alike(inside: str, stand_in_text: str) -> str:
    """`stand_in_text` (as long as the quoted text's `inside`) failing to read where `inside`
    does, if it does: the bad escape or control character kept in its place (and no hex
    digits after a kept `\\u`), so the arguments' error is the same on replay."""
    try:
        json.loads(f'"{inside}"')
    except ValueError as exc:
        at = getattr(exc, "pos", 1) - 1
    else:
        return stand_in_text
    if not 0 <= at < len(inside):
        return stand_in_text
    if at and inside[at - 1] == "\\" and inside[at] == "u":
        at -= 1  # a bad `\\uXXXX` is placed at its `u`: its backslash is kept too
    kept = inside[at : at + 2] if inside[at] == "\\" else inside[at]
    after = "x" * min(4, len(inside) - at - len(kept)) if kept == "\\u" else ""
    rest = at + len(kept) + len(after)
    return stand_in_text[:at] + kept + after + stand_in_text[rest:]


def _secrets_in_text(text: str, *, cut: bool = False) -> set[str]:
    """The secrets in a text that is not under a credential's name: those of the URLs in it,
    and those of the form or JSON it may be (a request body, say). `cut`: the text ends
    where the arguments were cut short, so a URL that ends it may have lost the `@` after
    its user info (`https://user:pass`): what follows its colon is taken for a password."""
    inside = _Redactor()
    for match in _URL_IN_TEXT.finditer(text):
        url = match.group(0)
        inside.url(url)
        if cut and match.end() == len(text):
            authority = url.partition("://")[2]
            if "@" not in authority and "/" not in authority and ":" in authority:
                inside.hide(authority.rpartition(":")[2])
    if _FORM.fullmatch(text):
        inside.query(text)
    if text.lstrip()[:1] in ("{", "[") and may_hold_credentials(text):
        inside.secrets.update(redact_json_text(text)[1])
    return inside.secrets


def _bounded(secret: str) -> re.Pattern[str]:
    """Where `secret` stands alone: not inside a longer run of letters and digits (a one
    letter password is not every such letter of its URL)."""
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])")


def _stood_in(text: str, secrets: Iterable[str]) -> str:
    """`text` with each secret, where it stands alone, replaced by its stand-in, longest first."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = _bounded(secret).sub(_same_length(secret), text)  # a stand-in has no backslash
    return text


def _number_stand_in(word: str) -> str:
    """A bare word with its leading number's digits stood in for (the first digit 1, the
    rest 0; a digit 0 stays 0) and the rest by letters: as long, and a number where it was
    one, so the text fails to read where it did."""
    match = _JSON_NUMBER.match(word)
    if match is None:
        return _same_length(word)
    number, rest = match.group(0), word[match.end() :]
    out: list[str] = []
    seen = False
    for char in number:
        if char in "123456789":
            out.append("0" if seen else "1")
            seen = True
        else:
            out.append(char)
    return "".join(out) + (_same_length(rest) if rest else "")


def _redact_unparsed(text: str, walker: _Redactor) -> str:
    """Text that is not JSON (cut short, say), read token by token: each value under a
    credential's name (its name's escapes undone; an object or array under it whole), the
    second of a pair whose first is one (`["Authorization", "Bearer x"]`), and the secrets
    of URLs and of JSON inside texts, replaced by stand-ins of the same length (a marker
    cut or padded to it, digits for a number); every other byte kept, so that reading it
    again fails where it did."""
    spans: list[tuple[int, int, str]] = []
    tokens = list(_JSON_TOKEN.finditer(text))
    # per open object or array: [is an array, all hidden, index in it, a pair's first is a name]
    frames: list[list[Any]] = []
    named = False  # the next value is under a credential's name
    for at, token in enumerate(tokens):
        piece = token.group(0)
        frame = frames[-1] if frames else None
        if piece in ("{", "["):
            hidden = named or (frame is not None and (frame[1] or (frame[0] and frame[2] == 1 and frame[3])))
            frames.append([piece == "[", hidden, 0, False])
            named = False
            continue
        if piece in ("}", "]"):
            if frames:
                frames.pop()
            named = False
            continue
        if piece == ",":
            if frame is not None:
                frame[2] += 1
            named = False
            continue
        if piece == ":":
            continue
        quoted = token.group(1) is not None
        start, end = token.span(1) if quoted else token.span()
        inside = text[start:end]
        value = _decoded(inside) if quoted else inside
        if quoted and at + 1 < len(tokens) and tokens[at + 1].group(0) == ":":
            named = is_credential_name(value)  # a name: the value after it is judged by it
            continue
        hidden = named or (frame is not None and (frame[1] or (frame[0] and frame[2] == 1 and frame[3])))
        if frame is not None and frame[0] and frame[2] == 0 and quoted and is_credential_name(value):
            frame[3] = True
        named = False
        if not inside:
            continue
        if hidden:
            if quoted:
                if _is_stand_in(inside):
                    continue  # hidden already: the text is being redacted again
                walker.hide(value, inside, value.partition(" ")[2].strip())
                spans.append((start, end, _failing_alike(inside, _same_length(inside))))
            elif inside not in ("true", "false", "null"):
                hidden_word = _number_stand_in(inside)
                if hidden_word != inside:  # else a stand-in already
                    walker.secrets.add(inside)
                    spans.append((start, end, hidden_word))
            continue
        found = _secrets_in_text(value, cut=end == len(text) or text[end] != '"')
        if not found:
            continue
        walker.secrets.update(found)
        replaced = _stood_in(inside, found)
        if any(_bounded(secret).search(_decoded(replaced)) for secret in found if not _is_stand_in(secret)):
            replaced = _same_length(inside)  # a secret spelled with escapes: the text whole
        spans.append((start, end, _failing_alike(inside, replaced)))
    for match in _URL_IN_TEXT.finditer(text):  # a URL outside any quotes
        url = match.group(0)
        found = _secrets_in_text(url, cut=match.end() == len(text))
        walker.secrets.update(found)
        url = _stood_in(url, found)
        if url != match.group(0):
            spans.append((match.start(), match.end(), url))
    out: list[str] = []
    at = 0
    for start, end, stand_in_text in sorted(spans):
        if start < at:
            continue  # inside one replaced already (a URL in a text replaced whole)
        out.append(text[at:start])
        out.append(stand_in_text)
        at = end
    out.append(text[at:])
    return "".join(out)


def _same_length(secret: str) -> str:
    """A stand-in for `secret` as long as it, of letters, digits, dots and dashes only: its
    marker cut or padded with `x` to its length; a stand-in stays itself."""
    if _is_stand_in(secret):
        return secret
    return (redact(secret) + "x" * len(secret))[: len(secret)]


_STAND_IN_TAIL: Final = re.compile(r"[0-9a-f]{16}x*|[0-9a-f]{0,16}")


def _is_stand_in(text: str) -> bool:
    """True if `text` is what `_same_length` makes of a text of its length, so that text
    redacted again keeps it (a marker's hash would change: it is not that text's)."""
    head = f"redacted.len-{len(text)}.xxh3-"
    if len(text) <= len(head):
        return text == head[: len(text)]
    return text.startswith(head) and _STAND_IN_TAIL.fullmatch(text, len(head)) is not None


def redact_arguments(args: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `args` with every credential replaced by its marker (the module's
    docstring lists what counts). Idempotent: redacting a redacted copy changes nothing."""
    return _Redactor().mapping(args)


def redact_collecting(args: Mapping[str, Any]) -> tuple[dict[str, Any], frozenset[str]]:
    """`redact_arguments(args)` and `credential_values(args)` from one walk."""
    walker = _Redactor()
    redacted = walker.mapping(args)
    return redacted, frozenset(walker.secrets)


def redact_call_arguments(arguments: Any) -> tuple[Any, frozenset[str]]:
    """A call's arguments as a recording (and a session snapshot) keeps them, and the
    secrets they hid: JSON text stays text, rewritten only when it holds a credential; a
    mapping is redacted (one the redactor cannot read is kept as a plain copy); anything
    else is left as it is."""
    if isinstance(arguments, str):
        return redact_json_text(arguments)
    if not isinstance(arguments, Mapping):
        return arguments, frozenset()
    try:
        return redact_collecting(arguments)
    except Exception:  # keys or values the redactor cannot read: the mapping as it came
        return dict(arguments), frozenset()


def credential_values(args: Mapping[str, Any]) -> frozenset[str]:
    """The secrets `redact_arguments(args)` hides, with the forms a server may echo them in."""
    walker = _Redactor()
    walker.mapping(args)
    return frozenset(walker.secrets)


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """`text` with each occurrence of a secret of `MIN_ECHO_LENGTH` characters or more
    replaced by the secret's marker, longest secrets first."""
    if not secrets:
        return text
    for secret in sorted((s for s in secrets if len(s) >= MIN_ECHO_LENGTH), key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, redact(secret))
    return text
