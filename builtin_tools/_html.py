"""`html_to_text`: an HTML page as readable plain text, with the stdlib's `html.parser`.

Scripts, styles and other non-content elements are dropped; blocks become lines;
headings get `#` marks, list items `- `, links `[text](absolute url)`; `<pre>` keeps
its spacing. Pure: no I/O.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import urljoin

__all__ = ["html_to_text"]

_SKIPPED = frozenset(
    {"script", "style", "noscript", "template", "svg", "canvas", "iframe", "object", "head"}
)
_BLOCKS = frozenset(
    {
        "address", "article", "aside", "blockquote", "body", "dd", "details", "dialog", "div",
        "dl", "dt", "fieldset", "figcaption", "figure", "footer", "form", "header", "hr",
        "html", "main", "nav", "ol", "p", "section", "summary", "table", "tbody", "thead",
        "tfoot", "ul", "caption",
    }
)  # fmt: skip
_HEADINGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
_VOID = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
     "track", "wbr"}
)  # fmt: skip
_SPACES = re.compile(r"[ \t\r\f\v\u00a0]+")
_BLANK_LINES = re.compile(r"\n{3,}")


def html_to_text(html: str, base_url: str = "") -> tuple[str, str]:
    """Return (title, text) of an HTML document. Relative links resolve against `base_url`."""
    parser = _TextExtractor(base_url)
    parser.feed(html)
    parser.close()
    return parser.title.strip(), parser.text()


class _TextExtractor(HTMLParser):
    def __init__(self, base_url: str) -> None:
        super().__init__(convert_charrefs=True)
        self.base_url = base_url
        self.title = ""
        self._parts: list[str] = []
        self._skip_depth = 0
        self._in_title = False
        self._pre_depth = 0
        self._links: list[tuple[str | None, int]] = []  # (href, index of the text start)
        self._targets: dict[str, str] = {}  # href -> absolute URL: pages repeat their links

    # -- parser callbacks -------------------------------------------------------

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = True
            return
        if tag in _SKIPPED:
            if tag not in _VOID:
                self._skip_depth += 1
            return
        if self._skip_depth:
            return
        if tag in _HEADINGS:
            self._newline(2)
            self._parts.append("#" * _HEADINGS[tag] + " ")
        elif tag == "li":
            self._newline(1)
            self._parts.append("- ")
        elif tag in ("br", "tr"):
            self._newline(1)
        elif tag in ("td", "th"):
            self._parts.append(" ")  # cells of a row stay on its line
        elif tag == "pre":
            self._newline(2)
            self._pre_depth += 1
        elif tag == "a":
            # A link inside a link is not HTML: a browser ends the open one first. So do
            # we, which also keeps each label joined once (nested ones were re-joined by
            # every enclosing link, quadratic in the nesting depth).
            while self._links:
                self._close_link(*self._links.pop())
            href = dict(attrs).get("href")
            self._links.append((href, len(self._parts)))
        elif tag in _BLOCKS:
            self._newline(2)

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
            return
        if tag in _SKIPPED:
            if self._skip_depth:
                self._skip_depth -= 1
            return
        if self._skip_depth:
            return
        if tag in _HEADINGS or tag in _BLOCKS:
            self._newline(2)
        elif tag == "pre":
            self._pre_depth = max(0, self._pre_depth - 1)
            self._newline(2)
        elif tag == "a" and self._links:
            href, start = self._links.pop()
            self._close_link(href, start)

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
            return
        if self._skip_depth:
            return
        if self._pre_depth:
            self._parts.append("\x00" + data)  # marked: keep its spacing
        else:
            self._parts.append(_SPACES.sub(" ", data.replace("\n", " ")))

    # -- output ---------------------------------------------------------------------

    def text(self) -> str:
        lines: list[str] = []
        for raw in "".join(self._parts).split("\n"):
            if "\x00" in raw:
                lines.append(raw.replace("\x00", "").rstrip())
            else:
                lines.append(_SPACES.sub(" ", raw).strip())
        joined = "\n".join(lines)
        return _BLANK_LINES.sub("\n\n", joined).strip()

    def _newline(self, count: int) -> None:
        self._parts.append("\n" * count)

    def _close_link(self, href: str | None, start: int) -> None:
        label = "".join(self._parts[start:]).strip()
        if not href or not label or href.startswith(("#", "javascript:", "mailto:")):
            return
        target = self._targets.get(href)
        if target is None:
            target = urljoin(self.base_url, href) if self.base_url else href
            self._targets[href] = target
        if not target.startswith(("http://", "https://")):
            return
        del self._parts[start:]
        self._parts.append(f"[{_SPACES.sub(' ', label)}]({target})")
