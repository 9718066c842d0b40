"""Recording lines as replay reads them (`_recording._record`: a `rows` line as the `batch`
record it stands for), the checks that a line the one-pass builder made reads back as
the record built part by part, and a file a thread writes, watched."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from dispatcher import _recording
from dispatcher._recording import Recorder, encode_line, read_recording


@contextmanager
def submitted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """Every batch handed to a recorder meanwhile, as the parts `Recorder._record_of` takes."""
    seen: list[tuple[Any, ...]] = []
    submit = Recorder.submit

    def watched(self: Recorder, *parts: Any) -> Any:
        seen.append(parts)
        return submit(self, *parts)

    with monkeypatch.context() as m:
        m.setattr(Recorder, "submit", watched)
        yield seen


def read_line(line: bytes) -> dict[str, Any]:
    """One line as the readers take it."""
    return _recording._record(line)


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of the recording at `path` as the readers take it, the header first."""
    return [read_line(line) for line in path.read_bytes().splitlines()]


def kinds(path: Path) -> list[str]:
    """The `type` of each line of the recording at `path` as written (`rows` or `batch` for a batch)."""
    return [json.loads(line)["type"] for line in path.read_bytes().splitlines()]


def assert_same(got: Any, expected: Any, where: str = "record") -> None:
    """`got` is `expected` field for field: the same types (True is not 1, 1 is not 1.0),
    the same keys in the same order, the same values."""
    assert type(got) is type(expected), (where, got, expected)
    if isinstance(expected, dict):
        assert list(got) == list(expected), (where, list(got), list(expected))
        for key, value in expected.items():
            assert_same(got[key], value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), (where, len(got), len(expected))
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(got), (where, got)
    else:
        assert got == expected, (where, got, expected)


def part_by_part(parts: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The `batch` record `Recorder._record_of` builds part by part for a batch's `parts`."""
    with monkeypatch.context() as m:
        m.setattr(_recording, "_common_rows", lambda *args: None)
        record, plain = Recorder._record_of(*parts)
    assert not plain and record["type"] == "batch"
    return record


def assert_reads_as(line: bytes, expected: dict[str, Any]) -> None:
    """The line reads back as `expected` (a `batch` record as built part by part), field for
    field, and encodes again to the very bytes `expected` does; a `batch` line is those bytes."""
    written = read_line(line)
    assert_same(written, read_line(encode_line(expected)))
    assert encode_line(written) == encode_line(expected)
    if json.loads(line)["type"] == "batch":
        assert line == encode_line(expected)


def one_pass_line(record: dict[str, Any], plain: bool) -> bytes:
    """The line of a record `Recorder._record_of` made, checked to be a `rows` line when the
    one-pass builder made it and a `batch` line otherwise."""
    line = encode_line(record, finite=plain)
    assert record["type"] == json.loads(line)["type"] == ("rows" if plain else "batch")
    return line


def lines_in(path: Path) -> int:
    """Whole lines in the file now (the header among them)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


async def until_lines(path: Path, count: int) -> None:
    """Until the file holds `count` whole lines (written by another thread: polled)."""
    with anyio.fail_after(10):
        while lines_in(path) < count:  # noqa: ASYNC110  # the file, written by a thread
            await anyio.sleep(0.001)


def first_results(path: Path) -> list[str]:
    """The first result of each batch in the file, in its order; the file whole."""
    _, batches, truncated, problem = read_recording(path)
    assert problem is None and not truncated, problem
    return [b["results"][0]["content"] for b in batches]
