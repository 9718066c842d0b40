"""HTML to Markdown converters side by side: time on real pages and on adversarial nesting.

Pages: the files under tests/data/ (two pages of the Python docs, a news-like article,
a windows-1252 page), plus any path given with `--page`. Each converter's time is the
median of `--runs` runs; the size of its output is shown beside it. Adversarial cases
nest one element 20,000 deep (links, divs, spans, quotes, lists, pre), and repeat
trees of 1000 nested quotes, the case whose output Markdown makes quadratic.

Converters: threepass's `html_to_text` (html-to-markdown underneath), and whichever of
these are installed: html-to-markdown alone, markdownify on BeautifulSoup (lxml and
html.parser), html2text, justhtml. `html.parser (no output)` is a stdlib HTMLParser
that only receives the events: the floor of any converter written on it.

A converter that raises (markdownify recurses once per level) or runs past
`--limit` seconds on a case is reported as such; the slow case is stopped by running
each adversarial conversion in a child process.

    python -m bench.html_convert [--runs 5] [--limit 10] [--page PATH ...]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path

from builtin_tools._html import html_to_text

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
BASE_URL = "https://docs.python.org/3/library/"

Converter = Callable[[str], str]


def _threepass(html: str) -> str:
    return html_to_text(html, BASE_URL)[1]


class _EventsOnly(HTMLParser):
    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        pass

    def handle_endtag(self, tag: str) -> None:
        pass

    def handle_data(self, data: str) -> None:
        pass


def _events_only(html: str) -> str:
    parser = _EventsOnly(convert_charrefs=True)
    parser.feed(html)
    parser.close()
    return ""


def converters() -> dict[str, Converter]:
    """Every converter that imports here, by name."""
    found: dict[str, Converter] = {
        "threepass html_to_text": _threepass,
        "html.parser (no output)": _events_only,
    }
    try:
        import html_to_markdown as h2m

        def plain_h2m(html: str) -> str:
            return h2m.convert(html, h2m.ConversionOptions(base_url=BASE_URL)).content or ""

        found["html-to-markdown"] = plain_h2m
    except ImportError:
        pass
    try:
        from bs4 import BeautifulSoup
        from markdownify import MarkdownConverter

        def markdownify_on(parser: str) -> Converter:
            def convert(html: str) -> str:
                soup = BeautifulSoup(html, parser)
                return str(MarkdownConverter(heading_style="ATX").convert_soup(soup))

            return convert

        found["markdownify + bs4(lxml)"] = markdownify_on("lxml")
        found["markdownify + bs4(html.parser)"] = markdownify_on("html.parser")
    except ImportError:
        pass
    try:
        import html2text

        def h2t(html: str) -> str:
            handler = html2text.HTML2Text(baseurl=BASE_URL)
            handler.body_width = 0
            return str(handler.handle(html))

        found["html2text"] = h2t
    except ImportError:
        pass
    try:
        import justhtml

        def just(html: str) -> str:
            return str(justhtml.JustHTML(html).to_markdown())

        found["justhtml"] = just
    except ImportError:
        pass
    return found


def adversarial_cases() -> dict[str, str]:
    depth = 20_000
    cases = {
        f"{name} x{depth}": f"<{open_}>t" * depth + f"</{name}>" * depth
        for name, open_ in [("a", 'a href="/x"'), ("div", "div"), ("span", "span"),
                            ("blockquote", "blockquote"), ("pre", "pre")]
    }  # fmt: skip
    cases[f"ul>li x{depth}"] = "<ul><li>t" * depth + "</li></ul>" * depth
    cases["10 trees of 1000 quotes"] = ("<blockquote>t" * 1000 + "</blockquote>" * 1000) * 10
    return cases


def _timed(convert: Converter, html: str, runs: int) -> tuple[float, int]:
    times = []
    size = 0
    for _ in range(runs):
        start = time.perf_counter()
        size = len(convert(html))
        times.append(time.perf_counter() - start)
    return statistics.median(times), size


def _child(name: str, html: str, answer: multiprocessing.SimpleQueue[str]) -> None:
    sys.setrecursionlimit(10_000)  # as a caller would raise it; the thread's stack still bounds it
    try:
        seconds, size = _timed(converters()[name], html, 1)
        answer.put(f"{seconds * 1000:9.1f} ms  {size:>10,} chars")
    except BaseException as exc:
        answer.put(f"fails: {type(exc).__name__}")


def _bounded(name: str, html: str, limit: float) -> str:
    context = multiprocessing.get_context("fork")
    answer: multiprocessing.SimpleQueue[str] = context.SimpleQueue()
    child = context.Process(target=_child, args=(name, html, answer))
    child.start()
    child.join(limit)
    if child.is_alive():
        child.kill()
        child.join()
        return f"over {limit:g} s (stopped)"
    return answer.get() if not answer.empty() else f"died (exit {child.exitcode})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.html_convert", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per page; the median is shown")
    parser.add_argument("--limit", type=float, default=10.0, help="seconds per adversarial case")
    parser.add_argument("--page", action="append", default=[], help="another HTML file to time")
    args = parser.parse_args(argv)
    found = converters()
    width = max(map(len, found))
    pages = sorted(DATA.glob("*.html")) + [Path(p) for p in args.page]
    print(f"Real pages (median of {args.runs} runs)")
    for page in pages:
        html = page.read_bytes().decode("utf-8", errors="replace")
        print(f"\n{page.name} ({len(html) // 1024} KB)")
        for name, convert in found.items():
            seconds, size = _timed(convert, html, args.runs)
            print(f"  {name:<{width}}  {seconds * 1000:9.1f} ms  {size:>10,} chars")
    print(f"\nAdversarial nesting (one run each, stopped at {args.limit:g} s)")
    for label, html in adversarial_cases().items():
        print(f"\n{label} ({len(html) // 1024} KB)")
        for name in found:
            print(f"  {name:<{width}}  {_bounded(name, html, args.limit)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
