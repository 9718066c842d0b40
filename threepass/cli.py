"""The `threepass` command line.

    threepass demo [--timeline FILE.html] [--plain | --json]
    threepass run TRANSCRIPT [--workspace DIR] [--record FILE] [--yes | --no] [--answer TEXT] ...
    threepass replay RECORDING [--diff] [--verify --workspace DIR] [--timeline FILE.html]
    threepass inspect RECORDING [--batch N]
    threepass tools [--json] [--workspace DIR]
    threepass cache stats | clear [--dir DIR]
    threepass bench [--quick] [--output PATH | --no-write] [--json]

`run` reads assistant messages (OpenAI chat or Anthropic shape, one JSON object a line,
or one JSON array) and dispatches each message's tool calls as one batch through the
builtin tools; a user message starts a new run. The terminal shows each batch as it
runs; `--json` prints JSON Lines instead; errors go to stderr. Ctrl-C ends a run as a
cancellation (exit 130). `bench` is `python -m bench` (bench/harness.py), its Markdown
table redrawn to fit the terminal.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

import attrs
import trio
from rich.console import Console
from rich.table import Table
from rich.text import Text

from builtin_tools import default_registry
from cache import DiskErrorStore, DiskResultCache, MemoryErrorStore, MemoryResultCache
from dispatcher import Dispatcher, ReplayReport, default_limit, replay
from dispatcher._recording import read_recording

from . import __version__
from ._runner import Answers, Outcome, TranscriptRun, read_messages
from ._view import JsonView, PlainView, RichView

__all__ = ["EXIT_BAD", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "main"]

EXIT_OK = 0
EXIT_BAD = 1  # a call could not be recorded, a replay diverged, the input was bad, --strict
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

EXIT_CODES = """\
exit codes:
  0    the run completed (calls that failed or were denied are results, not errors)
  1    a call could not be recorded, a replay diverged, or the input was bad
       (with --strict, also any call that failed or was denied)
  2    usage: the command line itself was wrong
  130  interrupted (Ctrl-C): what finished is committed and recorded
"""

T = TypeVar("T")
View = PlainView | RichView | JsonView


# --- output ------------------------------------------------------------------------------


def _plain(args: argparse.Namespace, out: TextIO) -> bool:
    if getattr(args, "plain", False) or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return True
    return not (hasattr(out, "isatty") and out.isatty())


def _console(out: TextIO, plain: bool) -> Console:
    if plain:
        return Console(file=out, color_system=None, force_terminal=False, highlight=False, width=100)
    return Console(file=out, highlight=False)


def _view(args: argparse.Namespace, out: TextIO) -> View:
    if getattr(args, "json", False):
        return JsonView(out)
    if _plain(args, out):
        return PlainView(out)
    return RichView(_console(out, plain=False))


class _Error(Exception):
    """A failure the command reports in one line on stderr (exit 1), without a traceback."""


# --- Ctrl-C ------------------------------------------------------------------------------


async def _cancellable(fn: Callable[[], Awaitable[T]]) -> tuple[T | None, bool]:
    """Run `fn` in a cancel scope that SIGINT cancels: (its value or None, interrupted).
    The first Ctrl-C is a cancellation (running tools are cancelled at once, what finished
    is committed); a second one, during the cleanup, is Python's KeyboardInterrupt."""
    interrupted = False
    scope = trio.CancelScope()
    value: T | None = None

    async def watch(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal interrupted
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                interrupted = True
                scope.cancel()
                return

    async with trio.open_nursery() as nursery:
        await nursery.start(watch)
        with scope:
            value = await fn()
        nursery.cancel_scope.cancel()
    return value, interrupted


# --- run and demo ------------------------------------------------------------------------


def _make_cache(args: argparse.Namespace) -> Any:
    if args.no_cache:
        return None
    return DiskResultCache(args.cache_dir)


def _make_error_store(args: argparse.Namespace) -> Any:
    """The error memory, beside the result cache (none with --no-cache)."""
    if args.no_cache:
        return None
    return DiskErrorStore(args.cache_dir)


def _copy_workspace(source: Path, prefix: str = "threepass-ws-") -> Path:
    if not source.is_dir():
        raise _Error(f"workspace {source} is not a folder")
    workspace = Path(tempfile.mkdtemp(prefix=prefix)) / source.name
    shutil.copytree(source, workspace)
    return workspace


def _summary(outcome: Outcome) -> str:
    served = ", ".join(f"{n} {k}" for k, n in sorted(outcome.served.items(), key=lambda kv: -kv[1]))
    statuses = ", ".join(f"{k} {n}" for k, n in sorted(outcome.statuses.items()))
    b = outcome.batches
    return f"{outcome.calls} calls in {b} batch{'es' * (b != 1)}: {served} ({statuses})"


def _summary_data(outcome: Outcome) -> dict[str, Any]:
    return {
        "calls": outcome.calls,
        "batches": outcome.batches,
        "served_by": dict(outcome.served),
        "statuses": dict(outcome.statuses),
    }


async def _drive(
    view: View,
    runner: TranscriptRun,
    messages: list[dict[str, Any]],
) -> bool:
    """Run the transcript under Ctrl-C; True if it was interrupted."""
    _, interrupted = await _cancellable(lambda: runner.run(messages))
    if interrupted:
        runner.finish_cut()
    else:
        runner.close()
    return interrupted


def _report_run(view: View, runner: TranscriptRun, interrupted: bool, record: str | None) -> None:
    outcome = runner.outcome
    if interrupted:
        cut = outcome.cut
        where = f"in batch {cut}" if cut is not None else "between batches"
        finished = sum(1 for r in outcome.cut_rows if r.result is not None)
        cancelled = len(outcome.cut_rows) - finished
        detail = f" ({finished} finished, {cancelled} cancelled)" if cut is not None else ""
        view.message(
            "interrupted",
            f"interrupted {where}{detail}: what finished is committed" + (" and recorded" if record else ""),
            batch=cut,
            finished=finished,
            cancelled=cancelled,
        )
    elif outcome.answer:
        view.message("answer", f"answer: {outcome.answer}", text=outcome.answer)
    view.message("summary", _summary(outcome), **_summary_data(outcome))
    if record and outcome.recording_problem is None:
        view.message("recorded", f"recorded to {record}", path=record)


def _answers(args: argparse.Namespace) -> Answers:
    # sys.stdin, not descriptor 0: a host that swaps stdin out (a test runner) is no terminal
    interactive = sys.stdin is not None and sys.stdin.isatty()
    return Answers(assume=args.yes, texts=list(args.answer or []), interactive=interactive)


def _cmd_run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        messages = read_messages(Path(args.transcript))
    except (OSError, ValueError) as exc:
        raise _Error(f"cannot read the transcript: {exc}") from exc
    source = Path(args.workspace).resolve()
    view = _view(args, out)
    if args.in_place:
        if not source.is_dir():
            raise _Error(f"workspace {source} is not a folder")
        workspace = source
        view.message("workspace", f"workspace: {workspace} (in place)", path=str(workspace))
    else:
        workspace = _copy_workspace(source)
        view.message(
            "workspace",
            f"workspace: {workspace} (a copy of {source}; it is kept, remove it when done)",
            path=str(workspace),
            copy_of=str(source),
        )
    if args.record:
        Path(args.record).unlink(missing_ok=True)  # one recording per run, never two spliced
    cache = _make_cache(args)
    errors = _make_error_store(args)
    registry = default_registry(workspace)

    def make(**kw: Any) -> Dispatcher:
        return Dispatcher(registry, cache=cache, error_store=errors, **kw)

    runner = TranscriptRun(
        make,
        view,
        _answers(args),
        mode=args.mode,
        record=args.record,
        meta={"workspace": str(workspace), "transcript": str(args.transcript)},
    )
    interrupted = trio.run(_drive, view, runner, messages)
    _report_run(view, runner, interrupted, args.record)
    if args.timeline:
        _write_timeline(
            args.timeline,
            runner.outcome,
            view,
            title=f"threepass run {args.transcript}",
            limit=int(runner.dispatcher.limiter.total_tokens),
        )
    if runner.outcome.recording_problem is not None:
        err.write(
            f"threepass: recording to {args.record} stopped early: {runner.outcome.recording_problem}\n"
        )
        return EXIT_BAD
    if interrupted:
        return EXIT_INTERRUPTED
    if args.strict and runner.outcome.strict_failures:
        err.write(f"threepass: --strict: {runner.outcome.strict_failures} call(s) failed or were refused\n")
        return EXIT_BAD
    return EXIT_OK


def _write_timeline(
    path: str,
    outcome: Outcome,
    view: View,
    title: str,
    limit: int | None = None,
    workspace: str | None = None,
) -> None:
    """The page of `outcome`'s batches; pass 2's groups follow the builtin tools' tags."""
    try:
        from ._timeline import write_timeline

        d = Dispatcher(default_registry(workspace or tempfile.gettempdir()))
        tools = {t.name: t for t in [*d.core_registry, *d.registry]}
        write_timeline(path, outcome.events, title=title, limit=limit or default_limit(), tools=tools)
    except ImportError as exc:
        raise _Error(f"--timeline needs plotly: pip install 'threepass[timeline]' ({exc})") from exc
    view.message("timeline", f"timeline: {path}", path=path)


def _cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """The example, copied, served, run, recorded and replayed: 0 if the replay matched,
    1 where it diverged, 130 if interrupted."""
    from ._demo import DEMO_ANSWERS, DEMO_APPROVALS, EXAMPLES, demo_messages, serve_site

    view = _view(args, out)
    folder = Path(tempfile.mkdtemp(prefix="threepass-demo-"))
    workspace = folder / "workspace"
    shutil.copytree(EXAMPLES / "workspace", workspace)
    recording = args.record or str(folder / "demo.recording.jsonl")
    Path(recording).unlink(missing_ok=True)
    view.message(
        "workspace",
        f"workspace: {workspace} (a copy of the example's; it is kept, remove {folder} when done)",
        path=str(workspace),
    )
    with serve_site(EXAMPLES / "site") as site:
        view.message("site", f"site: {site} (the example site, on loopback for this demo)", url=site)
        registry = default_registry(workspace, allow_private_network=True)
        cache = MemoryResultCache()
        errors = MemoryErrorStore()  # the demo remembers its failures for itself only

        def make(**kw: Any) -> Dispatcher:
            return Dispatcher(registry, cache=cache, error_store=errors, **kw)

        script = "the demo's script"
        answers = Answers(approve=DEMO_APPROVALS, texts=list(DEMO_ANSWERS), source=script, approver=script)
        meta = {"workspace": str(workspace), "transcript": "demo", "private_network": "yes"}
        runner = TranscriptRun(make, view, answers, record=recording, meta=meta)
        interrupted = trio.run(_drive, view, runner, demo_messages(site))
    _report_run(view, runner, interrupted, recording)
    if args.timeline:
        limit = int(runner.dispatcher.limiter.total_tokens)
        _write_timeline(args.timeline, runner.outcome, view, title="threepass demo", limit=limit)
    if interrupted:
        return EXIT_INTERRUPTED
    if runner.outcome.recording_problem is not None:
        err.write(f"threepass: the recording stopped early: {runner.outcome.recording_problem}\n")
        return EXIT_BAD
    report = trio.run(replay_recording, recording, str(workspace))
    if report.ok:
        view.message(
            "replay_ok",
            f"replay: {report.calls} calls in {report.batches} batches matched the recording, no tool run",
            ok=True,
            calls=report.calls,
            batches=report.batches,
        )
        return EXIT_OK
    where = report.problem or str(report.divergence)
    view.message("replay_diverged", f"replay diverged: {where}", ok=False, where=where)
    return EXIT_BAD


# --- replay and inspect -------------------------------------------------------------------


def _replay_workspace(path: str) -> str:
    """No tool runs in replay: the workspace only anchors resource keys, so any folder will
    do when the recorded one (often a temporary copy) is gone."""
    header, _, _, problem = read_recording(path)
    if problem and not header:
        raise _Error(problem)
    meta = header.get("meta")
    workspace = meta.get("workspace") if isinstance(meta, dict) else None
    if not isinstance(workspace, str) or not workspace or not Path(workspace).is_dir():
        workspace = tempfile.mkdtemp(prefix="threepass-replay-")
    return str(workspace)


def _private_network(path: str) -> bool:
    header, _, _, _ = read_recording(path)
    meta = header.get("meta")
    return isinstance(meta, dict) and meta.get("private_network") == "yes"


async def replay_recording(path: str, workspace: str | None = None) -> ReplayReport:
    """Replay `path` through the builtin tools, none of them run."""
    ws = workspace or _replay_workspace(path)
    return await replay(path, Dispatcher(default_registry(ws, allow_private_network=_private_network(path))))


def _diff_lines(expected: str, got: str) -> list[str]:
    a, b = expected.splitlines() or [expected], got.splitlines() or [got]
    if len(a) == 1 and len(b) == 1:  # one long line (JSON): split it where it differs
        at = next(
            (i for i, (x, y) in enumerate(zip(a[0], b[0], strict=False)) if x != y), min(len(a[0]), len(b[0]))
        )
        start = max(0, at - 60)
        return [f"- {a[0][start : at + 120]}", f"+ {b[0][start : at + 120]}", f"  {' ' * (at - start)}^"]
    return [line.rstrip("\n") for line in difflib.unified_diff(a, b, "recorded", "replayed", lineterm="")]


def _print_diff(view: View, lines: Sequence[str]) -> None:
    if isinstance(view, RichView):
        for line in lines:
            style = "red" if line.startswith("-") else "green" if line.startswith("+") else "dim"
            view.console.print(Text(line, style=style))
    elif isinstance(view, JsonView):
        view.emit("diff", lines=list(lines))
    else:
        for line in lines:
            view.message("diff", line)


def report_replay(view: View, report: ReplayReport, diff: bool = False) -> int:
    for warning in report.warnings:
        view.message("warning", f"warning: {warning}", text=warning)
    if report.truncated:
        view.message(
            "warning", "warning: the last line was cut short (a crash while writing); replayed the rest"
        )
    view.message(
        "replayed",
        f"replayed {report.calls} calls in {report.batches} batches without running any tool",
        calls=report.calls,
        batches=report.batches,
    )
    if report.problem:
        view.message("problem", f"problem: {report.problem}", text=report.problem)
    if report.divergence is not None:
        d = report.divergence
        view.message(
            "divergence",
            f"divergence: {d}",
            batch=d.batch,
            index=d.index,
            call_id=d.call_id,
            field=d.field,
            line=d.line,
            expected=d.expected,
            got=d.got,
        )
        if diff:
            _print_diff(view, _diff_lines(d.expected, d.got))
    elif not report.problem:
        view.message("replay_ok", "no divergence", ok=True)
    return EXIT_OK if report.ok else EXIT_BAD


def _cmd_replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    view = _view(args, out)
    if not Path(args.recording).is_file():
        raise _Error(f"no recording at {args.recording}")
    if args.verify:
        from ._verify import verify

        if not args.workspace:
            raise _Error("--verify needs --workspace DIR: the folder to run the tools in (it is copied)")
        workspace = _copy_workspace(Path(args.workspace).resolve(), prefix="threepass-verify-")
        view.message("workspace", f"workspace: {workspace} (a copy of {args.workspace})", path=str(workspace))
        code, outcome = verify(
            args.recording, workspace, view, diff_lines=_diff_lines, print_diff=_print_diff
        )
        if args.timeline:
            _write_timeline(args.timeline, outcome, view, title=f"threepass replay --verify {args.recording}")
        return code
    report = trio.run(replay_recording, args.recording, None)
    code = report_replay(view, report, diff=args.diff)
    if args.timeline:
        from ._inspect import outcome_of_recording

        _write_timeline(
            args.timeline,
            outcome_of_recording(args.recording),
            view,
            title=f"threepass replay {args.recording}",
        )
    return code


def _cmd_inspect(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from ._inspect import inspect

    return inspect(args.recording, args.batch, _console(out, _plain(args, out)), as_json=args.json)


# --- tools, cache, bench ------------------------------------------------------------------


def _rule(flag: Any) -> bool | str:
    """A tool's concurrent or confirm setting as shown: a bool, or the predicate's rule (the
    first line of its docstring)."""
    if isinstance(flag, bool):
        return flag
    doc = (getattr(flag, "__doc__", None) or "").strip().splitlines()
    return doc[0].rstrip(".") if doc else f"decided per call by {getattr(flag, '__name__', repr(flag))}"


def _tools(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Every tool a session offers (the core two first): how each is run, confirmed and cached."""
    from builtin_tools import GROUPS, command_sandbox

    workspace = Path(args.workspace).resolve()
    if not workspace.is_dir():
        raise _Error(f"workspace {workspace} is not a folder")
    registry = default_registry(workspace)
    d = Dispatcher(registry)
    group_of = {name: group for group, names in GROUPS.items() for name in names}
    sandbox = command_sandbox()
    rows: list[dict[str, Any]] = []
    for tool in [*d.core_registry, *registry]:
        policy = tool.cache
        row: dict[str, Any] = {
            "name": tool.name,
            "group": group_of.get(tool.name, "core"),
            "concurrent": _rule(tool.concurrent),
            "confirm": _rule(tool.confirm),
            "deferred": tool.deferred,
            "cache": None if policy is None else {"ttl": policy.ttl, "scope": policy.scope},
            "reads": tool.reads is not None,
            "writes": tool.writes is not None,
        }
        if group_of.get(tool.name) == "shell":
            row["sandbox"] = attrs.asdict(sandbox)
        rows.append(row)
    if args.json:
        out.write(json.dumps(rows, indent=2) + "\n")
        return EXIT_OK
    console = _console(out, _plain(args, out))
    table = Table(box=None, padding=(0, 2, 0, 0), pad_edge=False, header_style="bold")
    for column in ("tool", "group", "concurrent", "deferred", "cache", "reads/writes", "confirm"):
        table.add_column(column, no_wrap=column != "confirm", overflow="fold")

    def yes(value: Any) -> str:
        return "yes" if value is True else "no" if value is False else str(value)

    for r in rows:
        cache = "-" if r["cache"] is None else f"{r['cache']['scope']} {r['cache']['ttl']:g}s"
        rw = "/".join(k for k in ("reads", "writes") if r[k]) or "-"
        table.add_row(
            r["name"], r["group"], yes(r["concurrent"]), yes(r["deferred"]), cache, rw, yes(r["confirm"])
        )
    console.print(table)
    if sandbox.active:
        console.print(Text("command sandbox: active", style="green"))
    else:
        state = f"command sandbox: NOT active ({sandbox.reason}): every command needs confirmation"
        console.print(Text(state, style="bold red"))
    return EXIT_OK


def _cache(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    store = DiskResultCache(args.dir)
    if args.action == "clear":
        store.clear_sync()
        out.write(f"cleared {store.directory}\n")
        return EXIT_OK
    stats = store.statistics_sync()
    out.write(f"cache {store.directory}: {stats.entries} entries\n")
    return EXIT_OK


def _bench_harness() -> Any:
    """bench/harness.py of the source tree this package sits in, or of the current folder
    (a clone the package was installed from); None where there is none."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "bench" / "harness.py").is_file():
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            return importlib.import_module("bench.harness")
    return None


def markdown_table(lines: Sequence[str]) -> Table:
    """A Markdown table (header, rule, one row per system) turned on its side for the
    terminal: a column per system, a row per figure, so that it fits where the Markdown
    (kept for RESULTS.md) is far too wide."""

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    headers = cells(lines[0])
    rows = [cells(line) for line in lines[2:]]
    table = Table(header_style="bold", show_lines=False, expand=False)
    table.add_column(headers[0] if headers else "", style="bold", overflow="fold")
    for row in rows:
        table.add_column(row[0] if row else "", overflow="fold")
    for j, header in enumerate(headers[1:], 1):
        table.add_row(header, *(row[j] if j < len(row) else "" for row in rows))
    return table


def _bench(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    # The harness lives in the source tree beside the packages and is not shipped: it is
    # imported by name, only when asked for, so nothing installed depends on it.
    harness = _bench_harness()
    if harness is None:
        err.write(
            "threepass: the benchmark is not installed with the package; it lives in the source tree.\n"
            "  git clone the threepass repository, then in it: pip install '.[bench]' && python -m bench\n"
        )
        return EXIT_USAGE
    if "--json" in argv or "-h" in argv or "--help" in argv:
        code: int = harness.main(list(argv), out=out)
        return code
    buffer = io.StringIO()
    code = harness.main(list(argv), out=buffer)
    console = _console(out, _plain(argparse.Namespace(), out))
    lines = buffer.getvalue().splitlines()
    table = [line for line in lines if line.startswith("|")]
    if len(table) >= 2:
        console.print(markdown_table(table))
    for line in lines:
        if not line.startswith("|") and line.strip():
            console.print(_goal_line(line))
    return code


def _goal_line(line: str) -> Text:
    """A goal line of the harness: its **figure** in bold, met in green, not met in red."""
    text = Text()
    for i, part in enumerate(line.split("**")):
        text.append(part, style="bold" if i % 2 else "")
    if line.rstrip().endswith("not met"):
        text.stylize("red", len(line.rstrip()) - len("not met") - line.count("**") * 2)
    elif line.rstrip().endswith("met"):
        text.stylize("green", len(text) - len("met"))
    return text


# --- the parser --------------------------------------------------------------------------


def _output_flags(p: argparse.ArgumentParser, json_help: str = "JSON Lines, one event a line") -> None:
    p.add_argument(
        "--plain", action="store_true", help="plain text, no colour (also NO_COLOR, or not a terminal)"
    )
    p.add_argument("--json", action="store_true", help=json_help)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="threepass",
        description="Execute, record and replay the tool calls of LLM assistant messages.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"threepass {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    demo = command("demo", "run the shipped example end to end, record it, replay it offline")
    demo.add_argument("--record", help="where to record (default: in the demo's temporary folder)")
    demo.add_argument("--timeline", metavar="FILE.html", help="draw the batches as a page")
    _output_flags(demo)

    run = command("run", "dispatch the tool calls of a transcript")
    run.add_argument("transcript", help="JSONL (or a JSON array) of chat messages")
    run.add_argument("--workspace", default=".", help="folder the file tools work in (copied first)")
    run.add_argument("--in-place", action="store_true", help="work in the workspace itself, not a copy")
    run.add_argument("--record", help="record the session's batches to this JSONL file (replaced)")
    run.add_argument("--mode", choices=["deferred", "direct"], default="deferred")
    run.add_argument("--cache-dir", help="result cache folder (default: the user cache folder)")
    run.add_argument("--no-cache", action="store_true", help="run without the result cache")
    run.add_argument(
        "--answer",
        action="append",
        metavar="TEXT",
        help="answer the next ask_user with TEXT (repeatable, in order)",
    )
    run.add_argument("--strict", action="store_true", help="exit 1 if any call failed or was denied")
    run.add_argument("--timeline", metavar="FILE.html", help="draw the batches as a page")
    _output_flags(run)
    answer = run.add_mutually_exclusive_group()
    answer.add_argument(
        "--yes", action="store_const", const=True, dest="yes", help="allow every confirmation"
    )
    answer.add_argument(
        "--no", action="store_const", const=False, dest="yes", help="refuse every confirmation"
    )

    rep = command("replay", "replay a recording offline and report the first divergence")
    rep.add_argument("recording")
    rep.add_argument("--diff", action="store_true", help="show the divergence as a diff")
    rep.add_argument(
        "--verify", action="store_true", help="run the tools for real (in a copy of --workspace)"
    )
    rep.add_argument("--workspace", help="with --verify: the folder to run the tools in")
    rep.add_argument("--timeline", metavar="FILE.html", help="draw the recorded batches as a page")
    _output_flags(rep)

    ins = command("inspect", "show the batches of a recording")
    ins.add_argument("recording")
    ins.add_argument("--batch", type=int, metavar="N", help="one batch's calls and results (from 1)")
    _output_flags(ins, "one JSON document")

    tools = command("tools", "list the tools a session offers, with their rules")
    tools.add_argument("--workspace", default=".", help="the folder the builtin tools would work in")
    _output_flags(tools, "a JSON list of tools")

    cache = command("cache", "the result cache")
    cache.add_argument("action", choices=["stats", "clear"])
    cache.add_argument("--dir", help="cache folder (default: THREEPASS_CACHE_DIR or the user cache folder)")
    # Listed for --help only: main() hands everything after "bench" to the harness.
    command("bench", "measure threepass beside the floor and peer frameworks (python -m bench)")
    return parser


_COMMANDS: Mapping[str, Callable[[argparse.Namespace, TextIO, TextIO], int]] = {
    "demo": _cmd_demo,
    "run": _cmd_run,
    "replay": _cmd_replay,
    "inspect": _cmd_inspect,
    "tools": _tools,
    "cache": _cache,
}


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    stream = out or sys.stdout
    errors = err or sys.stderr
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"]:
        return _bench(arguments[1:], stream, errors)
    try:
        args = _parser().parse_args(arguments)
    except SystemExit as exc:  # --help and --version exit 0, a usage error 2
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    try:
        return _COMMANDS[args.command](args, stream, errors)
    except _Error as exc:
        errors.write(f"threepass: error: {exc}\n")
        return EXIT_BAD
    except (OSError, ValueError) as exc:
        errors.write(f"threepass: error: {exc}\n")
        return EXIT_BAD
    except KeyboardInterrupt:
        errors.write("threepass: interrupted\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
