# ruff: noqa: RUF001
# (The curly quotes and dashes in the strings are what the pages hold and what is checked.)
"""html_to_text on real pages (tests/data/) and on hand-made cases, and how fetch_page
picks a page's charset.

tests/data/ holds two pages of the Python 3.11 documentation as Debian's python3-doc
ships them (PSF License, LICENSE-python-docs.txt), a long article written in the
markup of a news site, and a page in windows-1252 that declares it only in a `<meta>`.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from builtin_tools._html import html_to_text
from builtin_tools.web import _decode_text

DATA = Path(__file__).parent / "data"
DOCS = "https://docs.python.org/3/library/"
ARTICLE_URL = "https://news.example/uk/2026/mar/14/millbrook-flood-wall"


def _page(name: str, url: str) -> tuple[str, str]:
    return html_to_text((DATA / name).read_text(encoding="utf-8"), url)


def _rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row, stripped of the padding that aligns them."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        for line in text.splitlines()
        if line.startswith("| ")
    ]


def _decode(data: bytes, content_type: str) -> str:
    response = httpx.Response(200, headers={"content-type": content_type}, content=data)
    text, note = _decode_text(response, data)
    assert note == ""
    return text


# -- real pages ---------------------------------------------------------------------------


def test_python_docs_page_has_its_title_headings_and_absolute_links() -> None:
    """The itertools docs: the <title>, `#` headings, links absolute against the page URL."""
    title, text = _page("python-itertools.html", DOCS + "itertools.html")
    assert title == (
        "itertools — Functions creating iterators for efficient looping — Python 3.11.2 documentation"
    )
    assert text.startswith("# `itertools` — Functions creating iterators for efficient looping\n")
    assert "\n## Itertool functions\n" in text
    assert "\n## Itertools Recipes\n" in text
    assert "[iterator](https://docs.python.org/3/glossary.html#term-iterator)" in text
    assert "[`map()`](https://docs.python.org/3/library/functions.html#map)" in text


def test_python_docs_page_keeps_its_tables_as_markdown_tables() -> None:
    """The docs' tables of iterators come out as Markdown tables, one row per iterator."""
    _, text = _page("python-itertools.html", DOCS + "itertools.html")
    rows = _rows(text)
    assert ["Iterator", "Arguments", "Results", "Example"] in rows
    assert ["`count()`", "start, [step]", "start, start+step, start+2*step, …",
            "`count(10) --> 10 11 12 13 14 ...`"] in rows  # fmt: skip
    assert any(row[0] == "`product()`" for row in rows)


def test_python_docs_page_keeps_code_blocks_fenced_with_their_indentation() -> None:
    """A recipe's `<pre>` is a ```python block, every line indented as in the page."""
    _, text = _page("python-itertools.html", DOCS + "itertools.html")
    assert (
        "```python\n"
        "def accumulate(iterable, func=operator.add, *, initial=None):\n"
        "    'Return running totals'\n"
        "    # accumulate([1,2,3,4,5]) --> 1 3 6 10 15\n"
        "    # accumulate([1,2,3,4,5], initial=100) --> 100 101 103 106 110 115\n"
        "    # accumulate([1,2,3,4,5], operator.mul) --> 1 2 6 24 120\n"
        "    it = iter(iterable)\n"
        "    total = initial\n"
        "    if initial is None:\n"
        "        try:\n"
        "            total = next(it)\n"
        "        except StopIteration:\n"
        "            return\n"
    ) in text
    assert ">>> list(accumulate(data, operator.mul))     # running product\n" in text
    assert "`sum(starmap(operator.mul, zip(vec1, vec2, strict=True)))`" in text


def test_python_docs_page_drops_navigation_permalinks_and_scripts() -> None:
    """The sidebars, the related-pages bars, the ¶ permalinks and the scripts are gone."""
    _, text = _page("python-itertools.html", DOCS + "itertools.html")
    for gone in ("Previous topic", "Report a Bug", "Table of Contents", "¶", "modules |",
                 "DOCUMENTATION_OPTIONS", "Theme"):  # fmt: skip
        assert gone not in text


def test_python_docs_list_of_paragraphs_has_no_empty_bullets() -> None:
    """The csv docs' `<li><p>` items are `- text` bullets; no bullet is left empty."""
    _, text = _page("python-csv.html", DOCS + "csv.html")
    assert "> - the second through n-th rows contain numeric values\n" in text
    assert not re.search(r"^[> ]*[-*] *$", text, re.MULTILINE)
    assert "[Lib/csv.py](https://github.com/python/cpython/tree/3.11/Lib/csv.py)" in text


def test_news_article_reads_as_the_story_without_the_site_around_it() -> None:
    """A news page: the headline and subheads as headings, the story's paragraphs, and none
    of the menus, cookie banner, ads, share buttons or script state."""
    title, text = _page("news-article.html", ARTICLE_URL)
    assert title.startswith("Millbrook flood wall: how a town of 12,000 paid")
    assert "\n# Millbrook flood wall: how a town of 12,000 paid for its own defences\n" in text
    assert text.count("# Millbrook flood wall") == 1
    assert "\n## What the money bought\n" in text and "\n## Outside the wall\n" in text
    assert "residents raised £4.2m themselves" in text
    assert "“It turns out it’s most of a town wall.”" in text
    assert "> The water does not read lists." in text
    for gone in ("Podcasts", "We use cookies", "adQueue", "__INITIAL_STATE__", "dataLayer",
                 "Privacy policy", "Breadcrumb", "UK news"):  # fmt: skip
        assert gone not in text
    assert "Share on Facebook" in text and "javascript:" not in text and "mailto:" not in text


def test_news_article_links_are_absolute_against_the_page_url() -> None:
    """Root-relative, dot-dot and protocol-relative links all resolve against the page URL."""
    _, text = _page("news-article.html", ARTICLE_URL)
    assert (
        "[the parish council’s published accounts]"
        "(https://news.example/uk/2026/feb/02/millbrook-council-accounts)"
    ) in text
    assert "[Tom Reyes](https://news.example/profile/tom-reyes)" in text
    assert "[resilience grant](https://news.example/uk/flood-resilience-grants)" in text
    assert "[download it](https://data.news.example/millbrook/millbrook_addresses.csv)" in text


def test_news_article_table_list_and_code_come_through() -> None:
    """The spending table is a Markdown table, the `<li><p>` sources are bullets, and the
    analysis code is a ```python block with its indentation and spacing exact."""
    _, text = _page("news-article.html", ARTICLE_URL)
    rows = _rows(text)
    assert rows[0] == ["Item", "Cost (£)", "Share"]
    assert ["Flood wall (1.4km)", "2,310,000", "55%"] in rows
    assert "- a parish precept of £96 a year per band D home, for ten years;" in text
    assert "- a gift of £750,000 from Dunmore Haulage, whose depot sits by the river." in text
    assert (
        "```python\n"
        "import csv\n\n"
        "def homes_by_side(path):\n"
        '    counts = {"inside": 0, "outside": 0}\n'
        '    with open(path, newline="") as f:\n'
        "        for row in csv.DictReader(f):\n"
        '            if row["protected"] == "yes":\n'
        '                counts["inside"] += 1\n'
        "            else:\n"
        '                counts["outside"] +=   1\n'
        "    return counts\n"
        "```"
    ) in text
    assert "`millbrook_addresses.csv`" in text


def test_windows_1252_page_declared_only_in_meta_reads_right() -> None:
    """A page in windows-1252 whose charset is only in `<meta charset>` (the header names
    none) has its accents, euro signs and curly quotes right."""
    data = (DATA / "windows-1252.html").read_bytes()
    title, text = html_to_text(_decode(data, "text/html"), "https://cafe.example/menu")
    assert title == "Café de la Gare – menu d’été"
    assert "# Café de la Gare" in text
    assert "Menu d’été, servi du 21 juin au 22 septembre. Prix en euros (€)" in text
    assert ["Crème brûlée", "6,50 €"] in _rows(text)
    assert ["Bœuf bourguignon", "18 €"] in _rows(text)
    assert "« Ouvert tous les jours » — sauf le lundi." in text
    assert "Über uns · Señor Muñoz · naïve façade · 25°C · ½ tarif · ™ ‰ • …" in text
    assert "\ufffd" not in text


# -- charset ------------------------------------------------------------------------------


def test_charset_in_the_header_wins_over_the_meta() -> None:
    """The Content-Type header's charset is used even when a `<meta>` names another."""
    data = '<meta charset="windows-1252"><p>é€</p>'.encode()
    assert _decode(data, "text/html; charset=utf-8").endswith("<p>é€</p>")


def test_charset_in_a_meta_http_equiv_is_honoured_and_latin1_is_read_as_1252() -> None:
    """`<meta http-equiv=Content-Type content="...; charset=iso-8859-1">` is honoured, and
    read as windows-1252 as browsers do, so its euro sign and quotes survive."""
    data = (
        b'<html><head><meta http-equiv="Content-Type" content="text/html; charset=ISO-8859-1">'
        b"<p>\x80 \x93q\x94 caf\xe9</p>"
    )
    assert _decode(data, "text/html").endswith("<p>€ “q” café</p>")


def test_without_any_declared_charset_the_encoding_is_detected() -> None:
    """No header charset and no `<meta>`: UTF-8 when the bytes are UTF-8 (even cut inside a
    character), else the detected encoding."""
    assert _decode("<p>naïve € café</p>".encode(), "text/html") == "<p>naïve € café</p>"
    assert _decode("<p>café</p>".encode()[:-5], "text/html") == "<p>caf\ufffd"
    data = (DATA / "windows-1252.html").read_bytes().replace(b'<meta charset="windows-1252">', b"")
    text = _decode(data, "text/html")
    assert "Café de la Gare" in text and "6,50 €" in text and "d’été" in text


def test_a_meta_naming_no_text_encoding_is_ignored() -> None:
    """A `<meta charset>` naming no codec, or a codec that is not text, falls through to
    detection."""
    for label in ("no-such-charset", "base64"):
        data = f'<meta charset="{label}"><p>é</p>'.encode()
        assert _decode(data, "text/html").endswith("<p>é</p>")


def test_a_byte_order_mark_wins_and_is_not_shown() -> None:
    """A UTF-8 or UTF-16 byte-order mark names the encoding, and is not part of the text."""
    assert _decode(b"\xef\xbb\xbf<p>\xc3\xa9</p>", "text/html; charset=iso-8859-1") == "<p>é</p>"
    assert _decode("\ufeff<p>é</p>".encode("utf-16-le"), "text/html") == "<p>é</p>"


# -- hand-made cases ----------------------------------------------------------------------


def test_pre_keeps_every_lines_indentation_and_spaces() -> None:
    """A multi-line `<pre>` is a fenced block whose every line keeps its leading spaces and
    its runs of spaces."""
    _, text = html_to_text("<pre>def f(x):\n    if x:\n        return   1</pre>")
    assert text == "```\ndef f(x):\n    if x:\n        return   1\n```"


def test_code_blocks_take_their_language_from_the_markup() -> None:
    """`class="language-x"` on the code, or Sphinx's `highlight-x` wrapper, names the
    block's language; Sphinx's `default` names none."""
    _, text = html_to_text('<pre><code class="language-rust">fn main() {}</code></pre>')
    assert text == "```rust\nfn main() {}\n```"
    sphinx = (
        '<div class="highlight-{} notranslate"><div class="highlight">'
        "<pre><span></span>x = 1</pre></div></div>"
    )
    assert html_to_text(sphinx.format("python3"))[1] == "```python\nx = 1\n```"
    assert html_to_text(sphinx.format("console"))[1] == "```console\nx = 1\n```"
    assert html_to_text(sphinx.format("default"))[1] == "```\nx = 1\n```"


def test_links_inside_a_code_block_are_just_their_text() -> None:
    """A `<pre>` whose names are links (as in API docs) shows the code, not `[os](url)`;
    links outside it are kept."""
    page = (
        '<pre class="language-python">import <a href="/os" title="a>b">os</a>\n'
        '    <A HREF="/p">path</A>.join(x)</pre><p>see <a href="/os">os</a></p>'
    )
    _, text = html_to_text(page, "https://h.example/")
    assert text == "```python\nimport os\n    path.join(x)\n```\n\nsee [os](https://h.example/os)"


def test_list_items_holding_paragraphs_are_bullets_with_their_text() -> None:
    """`<li><p>x</p></li>` is `- x`, not an empty bullet and a stray line."""
    _, text = html_to_text("<ul><li><p>x</p></li><li><p>y</p></li></ul><ol><li>one</li></ol>")
    assert re.split(r"\n+", text) == ["- x", "- y", "1. one"]


def test_inline_code_is_marked() -> None:
    """`<code>` inside a paragraph is `backticked`."""
    assert html_to_text("<p>call <code>f(x)</code> now</p>")[1] == "call `f(x)` now"


def test_a_lone_surrogate_becomes_a_replacement_character() -> None:
    """Text holding a lone surrogate (no UTF-8 for it) converts, the surrogate shown as U+FFFD."""
    assert html_to_text("<p>a\ud800b</p>")[1] == "a\ufffdb"


def test_a_page_that_starts_with_a_rule_keeps_it() -> None:
    """The converter's metadata block is taken off the text; a page's own leading `<hr>`
    (also `---`) is not mistaken for it."""
    assert html_to_text("<hr><p>x</p>") == ("", "---\n\nx")
    title, text = html_to_text('<title>a: "b"\n---\nc</title><p>x</p>')
    assert (title, text) == ('a: "b"\n---\nc', "x")


@pytest.mark.parametrize(
    "tag", ["div", "span", "blockquote", "ul><li", "pre", "li", "a href='/x'", "table><tr><td"]
)
def test_deep_nesting_converts_in_linear_time_and_says_what_is_left_out(tag: str) -> None:
    """Elements nested 30,000 deep (150 KB and more) convert in well under two seconds, to
    no more text than a few times the page; what lies past 1024 levels is left out, and
    the text says so."""
    names = [part.split()[0] for part in tag.split("><")]
    page = f"<{tag}>t\n  x" * 30_000 + "".join(f"</{name}>" for name in reversed(names)) * 30_000
    assert len(page) > 150_000
    start = time.perf_counter()
    _, text = html_to_text(page, "https://h.example/")
    assert time.perf_counter() - start < 2
    assert text.startswith(("t", "[t", "- t", "> t", "```\nt"))
    assert len(text) < 5 * len(page)
    # An <li> or <a> closes the open one, and lists past 16 levels are flattened: no depth.
    if tag not in ("li", "ul><li", "a href='/x'"):
        assert text.endswith("[part of the page is nested more than 1024 elements deep and is left out]")


def test_deeply_nested_quotes_lists_and_pre_stay_linear_in_size() -> None:
    """Quotes and lists nested past 16 levels, and a <pre> inside a <pre>, are flattened:
    Markdown would repeat every level's prefix on every line inside it (n^2 text)."""
    quotes = ("<blockquote>t" * 1000 + "</blockquote>" * 1000) * 10
    _, text = html_to_text(quotes)
    assert len(text) < 5 * len(quotes)
    assert max(len(line) - len(line.lstrip("> ")) for line in text.splitlines()) <= 32
    _, text = html_to_text("<ul><li>a<ul><li>b</li></ul></li></ul>")
    assert text == "- a\n  - b"
    _, text = html_to_text("<pre>a\n  b<pre>c\n  d</pre></pre>")
    assert text == "```\na\n  bc\n  d\n```"
