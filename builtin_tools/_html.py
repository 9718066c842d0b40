"""`html_to_text`: an HTML page as Markdown, with html-to-markdown (an HTML5 parser and
converter written in Rust).

Headings become `#` lines, lists `- ` items, tables Markdown tables, `<pre>` fenced code
with its spacing kept (and its language when the markup names one), links
`[text](absolute url)`. Scripts, styles, hidden content, images, frames and navigation
are dropped. Quotes, lists and `<pre>` nested deep are flattened first (Markdown
would repeat their prefixes, quadratic in the depth), so time and output are linear
in the page whatever its nesting; the converter stops descending at 1024 levels, and
the text says so when a page went deeper. Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urljoin

import html_to_markdown as h2m

if TYPE_CHECKING:
    from html_to_markdown._html_to_markdown import HtmlVisitor

__all__ = ["html_to_text"]

# Navigation landmarks, Sphinx/MkDocs "¶" permalinks, and frames (content of another page).
_DROPPED = ["nav", "[role=navigation]", "a.headerlink", "iframe", "frame", "frameset"]
_DEPTH_NOTE = "[part of the page is nested more than 1024 elements deep and is left out]"

# Sphinx names a block's language on a wrapper, `<div class="highlight-python3 ...">
# <div class="highlight"><pre>`; the converter reads it from the `<pre>` only. Every
# quantifier is bounded by a delimiter that ends it, so the search is linear.
_SPHINX_CODE = re.compile(
    r'(<div class="highlight-([\w+#.-]+)[^"<>]*">\s*<div class="highlight">\s*<pre)(?=[\s>])'
)

_SURROGATE = re.compile("[\ud800-\udfff]")
# The start of a quote, list or pre tag; or a whole link tag, whose quoted values may
# hold a `>`. No part of it matches a `<`, so a scan never passes the next tag and the
# search is linear; a link tag with a `<` in a value is left as it is.
_NESTING_TAG = re.compile(
    r"<(/?)(blockquote|ul|ol|dl|menu|pre)(?=[\s/>])"
    r"""|<(/?a)(?:\s(?:[^<>"']|"[^"<]*"|'[^'<]*')*)?>""",
    re.IGNORECASE,
)
_MAX_NESTING = 16

# Sphinx's lexer names that say "no language", or say it differently from Markdown.
_SPHINX_LANGUAGES = {"default": "", "none": "", "text": "", "python3": "python", "py3": "python"}


def html_to_text(html: str, base_url: str = "") -> tuple[str, str]:
    """Return (title, Markdown text) of an HTML document. Relative links resolve against
    `base_url` (the page's final URL); links that lead nowhere on the web keep their text."""
    html = _SPHINX_CODE.sub(_name_the_language, html)
    html = _flatten_deep_nesting(html)
    options = h2m.ConversionOptions(
        extract_metadata=True,
        skip_images=True,
        bullets="-",
        exclude_selectors=_DROPPED,
    )
    # The converter calls only the visit_ methods a visitor defines (each one costs a
    # call into Python per node); its Protocol lists them all, hence the cast.
    links = cast("HtmlVisitor", _Links(base_url))
    try:
        result = h2m.convert(html, options, visitor=links)
    except UnicodeEncodeError:  # a lone surrogate: the converter takes UTF-8 only
        html = _SURROGATE.sub("\ufffd", html)
        result = h2m.convert(html, options, visitor=links)
    title = (result.metadata.document.title or "").strip() if result.metadata else ""
    text = _without_front_matter(result.content or "").strip()
    if any(str(w.kind) == "depth_limit_exceeded" for w in result.warnings):
        text = f"{text}\n\n{_DEPTH_NOTE}" if text else _DEPTH_NOTE
    return title, text


def _flatten_deep_nesting(html: str) -> str:
    """The page with quotes and lists nested past `_MAX_NESTING` turned into `<div>`s
    (their content kept at the deepest level allowed), a `<pre>` inside a `<pre>`
    turned into a `<span>` (its text stays preformatted in the outer one), and links
    inside a `<pre>` reduced to their text (a fenced block shows `[x](url)` as is, which
    is not the code; API docs link the names in their examples).

    Markdown writes a nested quote or list by prefixing every line inside it (`> `, an
    indent) once per level, and a fenced block inside a fenced block with a longer
    fence, so n levels cost n^2 characters: 1000 nested quotes, 26 KB of HTML, came
    out as 2 MB and took 1.5 s, and a page of such trees grows with its size times the
    depth. End tags of these elements are not optional in HTML, so counting them is
    enough to know the depth; the scan is one pass.
    """
    blocks: list[bool] = []  # per open quote or list: written as itself (True) or as a div
    pres: list[bool] = []  # per open pre: the outermost (True) or one inside it

    def rename(match: re.Match[str]) -> str:
        if match[3] is not None:  # a link tag
            return "" if pres else match[0]
        closing, name = match[1], match[2].lower()
        opened, substitute = (pres, "span") if name == "pre" else (blocks, "div")
        if not closing:
            keep = len(opened) < (1 if name == "pre" else _MAX_NESTING)
            opened.append(keep)
            return match[0] if keep else f"<{substitute}"
        if not opened or opened.pop():
            return match[0]
        return f"</{substitute}"

    return _NESTING_TAG.sub(rename, html)


def _name_the_language(match: re.Match[str]) -> str:
    language = _SPHINX_LANGUAGES.get(match[2], match[2])
    return f'{match[1]} class="language-{language}"' if language else match[1]


def _without_front_matter(markdown: str) -> str:
    """The text without the YAML block the converter puts first when the page has
    metadata: `---`, `key: value` lines with no blank one, `---`. A page that merely
    starts with a rule (`<hr>`) has a blank line after its `---` and is left alone."""
    if not markdown.startswith("---\n"):
        return markdown
    end = markdown.find("\n---\n", 3)
    if end == -1 or "\n\n" in markdown[3 : end + 1]:
        return markdown
    return markdown[end + 5 :]


class _Links:
    """The converter's visitor for links: `[text](absolute url)`, without the title
    (Sphinx gives every link one, which doubles the noise), and only the text for a link
    that is not http(s) (`javascript:`, `mailto:`) or points into the page itself."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._targets: dict[str, str] = {}  # href -> absolute URL: pages repeat their links

    def visit_link(self, _ctx: Any, href: str, text: str, _title: str) -> dict[str, str]:
        label = " ".join(text.split())
        href = href.strip()
        if not label or not href or href.startswith("#"):
            return {"type": "custom", "output": label}
        target = self._targets.get(href)
        if target is None:
            target = urljoin(self.base_url, href) if self.base_url else href
            target = target.replace(" ", "%20").replace("(", "%28").replace(")", "%29")
            self._targets[href] = target
        if not target.startswith(("http://", "https://")):
            return {"type": "custom", "output": label}
        return {"type": "custom", "output": f"[{label}]({target})"}
