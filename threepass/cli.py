"""The `threepass` command line: run a transcript's tool calls, replay a recording, manage the cache.

    threepass run TRANSCRIPT [--workspace DIR] [--record FILE] [--yes | --no] ...
    threepass replay RECORDING
    threepass cache stats | clear [--dir DIR]
    threepass bench [--quick] [--output PATH | --no-write] [--json]

`run` reads assistant messages (OpenAI chat or Anthropic shape, one JSON object a line,
or one JSON array) and dispatches each message's tool calls as one batch through the
builtin tools; a user message starts a new run. Calls that need confirmation are asked
about on the terminal; without one they are refused unless --yes. `bench` is
`python -m bench`, the benchmark harness (bench/harness.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import anyio.to_thread
import attrs
import trio

from builtin_tools import default_registry
from cache import DiskResultCache
from dispatcher import (
    Allow,
    Deny,
    Dispatcher,
    DispatchInterrupted,
    HookBlocked,
    ToolCall,
    ToolContext,
    ToolResult,
)
from dispatcher._recording import read_recording, replay

__all__ = ["main"]


def _messages(path: Path) -> Iterator[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON array of messages")
        yield from data
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: not a JSON message: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"{path}:{number}: a message must be a JSON object")
        yield value


def tool_calls_of(message: Mapping[str, Any]) -> list[Any]:
    """The tool calls of an assistant message, in either provider's shape."""
    calls = list(message.get("tool_calls") or [])
    content = message.get("content")
    if isinstance(content, list):
        calls += [b for b in content if isinstance(b, Mapping) and b.get("type") == "tool_use"]
    return calls


class TerminalGate:
    """Asks on the terminal; with no terminal, the answer given on the command line."""

    def __init__(self, *, assume: bool | None, stdin: TextIO, stdout: TextIO) -> None:
        self._assume = assume
        self._stdin = stdin
        self._stdout = stdout

    async def __call__(self, call: ToolCall, ctx: ToolContext) -> Allow | Deny:
        if self._assume is not None:
            return Allow() if self._assume else Deny("refused on the command line (--no)")
        if not self._stdin.isatty():
            return Deny("no one to ask: run with --yes to allow calls that need confirmation")
        args = json.dumps(call.arguments, ensure_ascii=False)
        self._stdout.write(f"allow {call.name} {args}? [y/N] ")
        self._stdout.flush()
        answer = await anyio.to_thread.run_sync(self._stdin.readline)
        return Allow() if answer.strip().lower() in ("y", "yes") else Deny("the user said no")


def _line(result: ToolResult) -> str:
    flags = "".join(f" [{f}]" for f in ("cached", "deduped") if getattr(result, f))
    first = result.content.split("\n", 1)[0]
    if len(first) > 100:
        first = first[:97] + "..."
    return f"  {result.call_id:<10} {result.name:<14} {result.status.value:<17}{flags} {first}"


def _make_cache(args: argparse.Namespace) -> Any:
    if args.no_cache:
        return None
    return DiskResultCache(args.cache_dir)


def _prepare_workspace(args: argparse.Namespace) -> Path:
    """The folder the tools work in: a fresh copy of --workspace unless --in-place."""
    source = Path(args.workspace).resolve()
    if not source.is_dir():
        raise ValueError(f"workspace {source} is not a folder")
    if args.in_place:
        return source
    workspace = Path(tempfile.mkdtemp(prefix="threepass-ws-")) / source.name
    shutil.copytree(source, workspace)
    return workspace


async def _run(args: argparse.Namespace, workspace: Path, messages: list[dict[str, Any]], out: TextIO) -> int:
    registry = default_registry(workspace)
    gate = TerminalGate(assume=args.yes, stdin=sys.stdin, stdout=out)
    d = Dispatcher(registry, cache=_make_cache(args), gate=gate)
    session = d.session("cli", mode=args.mode, record=args.record)
    if session.recorder is not None:
        session.recorder.set_meta(workspace=str(workspace), transcript=str(args.transcript))
    out.write(f"workspace: {workspace}\n")
    batches = 0
    for message in messages:
        role = message.get("role")
        if role == "user":
            session.new_run()
            text = message.get("content")
            out.write(f"user: {text if isinstance(text, str) else '...'}\n")
            continue
        calls = tool_calls_of(message)
        if role != "assistant" or not calls:
            continue
        batches += 1
        out.write(f"batch {batches}: {len(calls)} call(s)\n")
        try:
            results = await session.dispatch(calls)
        except DispatchInterrupted as exc:
            for call, reason, _ in exc.pending:
                out.write(f"  {call.id:<10} {call.name:<14} interrupted       {reason}\n")
            continue
        except HookBlocked as exc:
            out.write(f"  blocked: {exc.reason}\n")
            continue
        for result in results:
            out.write(_line(result) + "\n")
            if args.json:
                out.write("    " + json.dumps(result.to_message("openai"), ensure_ascii=False) + "\n")
    stats = session.statistics()
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(stats.by_status.items()))
    out.write(
        f"{stats.calls} calls in {batches} batches: {stats.executed} ran, {stats.deduped} deduped, "
        f"{stats.cached} cached ({statuses})\n"
    )
    recorder = session.recorder
    if recorder is not None and recorder.problem is not None:
        out.write(f"recording to {args.record} stopped early: {recorder.problem}\n")
        return 1
    if args.record:
        out.write(f"recorded to {args.record}\n")
    return 0


def _replay_workspace(path: str) -> str:
    """No tool runs in replay: the workspace only anchors resource keys, so any folder will
    do when the recorded one (often a temporary copy) is gone."""
    header, _, _, problem = read_recording(path)
    if problem and not header:
        raise ValueError(problem)
    meta = header.get("meta")
    workspace = meta.get("workspace") if isinstance(meta, dict) else None
    if not isinstance(workspace, str) or not workspace or not Path(workspace).is_dir():
        workspace = tempfile.mkdtemp(prefix="threepass-replay-")
    return str(workspace)


async def _replay(args: argparse.Namespace, workspace: str, out: TextIO) -> int:
    from builtin_tools import default_registry

    d = Dispatcher(default_registry(workspace))
    report = await replay(args.recording, d)
    for warning in report.warnings:
        out.write(f"warning: {warning}\n")
    if report.truncated:
        out.write("warning: the last line was cut short (a crash while writing); replayed the rest\n")
    out.write(f"replayed {report.calls} calls in {report.batches} batches without running any tool\n")
    if report.problem:
        out.write(f"problem: {report.problem}\n")
    if report.divergence is not None:
        out.write(f"divergence: {report.divergence}\n")
    elif not report.problem:
        out.write("no divergence\n")
    return 0 if report.ok else 1


def _cache(args: argparse.Namespace, out: TextIO) -> int:
    store = DiskResultCache(args.dir)
    if args.action == "clear":
        store.clear_sync()
        out.write(f"cleared {store.directory}\n")
        return 0
    stats = store.statistics_sync()
    out.write(f"cache {store.directory}: {stats.entries} entries\n")
    return 0


def _rule(flag: Any) -> bool | str:
    """A tool's concurrent or confirm setting as shown: a bool, or the predicate's rule (the
    first line of its docstring)."""
    if isinstance(flag, bool):
        return flag
    doc = (getattr(flag, "__doc__", None) or "").strip().splitlines()
    return doc[0].rstrip(".") if doc else f"decided per call by {getattr(flag, '__name__', repr(flag))}"


def _tools(args: argparse.Namespace, out: TextIO) -> int:
    """Every tool a session offers (the core two first): how each is run, confirmed and cached."""
    from builtin_tools import GROUPS, command_sandbox

    workspace = Path(args.workspace).resolve()
    if not workspace.is_dir():
        raise ValueError(f"workspace {workspace} is not a folder")
    registry = default_registry(workspace)
    d = Dispatcher(registry)
    group_of = {name: group for group, names in GROUPS.items() for name in names}
    sandbox = command_sandbox()
    rows: list[dict[str, Any]] = []
    for tool in [*d.core_registry, *registry]:
        policy = tool.cache
        rows.append(
            {
                "name": tool.name,
                "group": group_of.get(tool.name, "core"),
                "concurrent": _rule(tool.concurrent),
                "confirm": _rule(tool.confirm),
                "deferred": tool.deferred,
                "cache": None if policy is None else {"ttl": policy.ttl, "scope": policy.scope},
                "reads": tool.reads is not None,
                "writes": tool.writes is not None,
            }
        )
    if args.json:
        out.write(json.dumps({"tools": rows, "command_sandbox": attrs.asdict(sandbox)}, indent=2) + "\n")
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        cache = "-" if r["cache"] is None else f"{r['cache']['scope']} {r['cache']['ttl']:g}s"
        out.write(
            f"{r['name']:<{width}}  {r['group']:<9} concurrent={r['concurrent']!s:<5} "
            f"deferred={r['deferred']!s:<5} cache={cache:<13} confirm={r['confirm']}\n"
        )
    state = "active" if sandbox.active else f"NOT active ({sandbox.reason}): every command needs confirmation"
    out.write(f"command sandbox: {state}\n")
    return 0


def _bench_harness() -> Any:
    """bench/harness.py of the source tree this package sits in, or of the current folder
    (a clone the package was installed from); None where there is none."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "bench" / "harness.py").is_file():
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            return importlib.import_module("bench.harness")
    return None


def _bench(argv: Sequence[str], out: TextIO) -> int:
    # The harness lives in the source tree beside the packages and is not shipped: it is
    # imported by name, only when asked for, so nothing installed depends on it.
    harness = _bench_harness()
    if harness is None:
        sys.stderr.write(
            "threepass: the benchmark is not installed with the package; it lives in the source tree.\n"
            "  git clone the threepass repository, then in it: pip install '.[bench]' && python -m bench\n"
        )
        return 2
    code: int = harness.main(argv, out=out)
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="threepass", description="Execute and replay LLM tool calls.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="dispatch the tool calls of a transcript")
    run.add_argument("transcript", help="JSONL (or a JSON array) of chat messages")
    run.add_argument("--workspace", default=".", help="folder the file tools work in (copied first)")
    run.add_argument("--in-place", action="store_true", help="work in the workspace itself, not a copy")
    run.add_argument("--record", help="record the session's batches to this JSONL file (replaced)")
    run.add_argument("--mode", choices=["deferred", "direct"], default="deferred")
    run.add_argument("--json", action="store_true", help="also print each tool message")
    run.add_argument("--cache-dir", help="result cache folder (default: the user cache folder)")
    run.add_argument("--no-cache", action="store_true", help="run without the result cache")
    answer = run.add_mutually_exclusive_group()
    answer.add_argument(
        "--yes", action="store_const", const=True, dest="yes", help="allow every confirmation"
    )
    answer.add_argument(
        "--no", action="store_const", const=False, dest="yes", help="refuse every confirmation"
    )
    rep = sub.add_parser("replay", help="replay a recording offline and report the first divergence")
    rep.add_argument("recording")
    tools = sub.add_parser("tools", help="list the tools a session offers, with their rules")
    tools.add_argument("--workspace", default=".", help="the folder the builtin tools would work in")
    tools.add_argument("--json", action="store_true", help="one JSON document")
    cache = sub.add_parser("cache", help="the result cache")
    cache.add_argument("action", choices=["stats", "clear"])
    cache.add_argument("--dir", help="cache folder (default: THREEPASS_CACHE_DIR or the user cache folder)")
    # Listed for --help only: main() hands everything after "bench" to the harness.
    sub.add_parser("bench", help="measure threepass beside the floor and peer frameworks (python -m bench)")
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    stream = out or sys.stdout
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"]:
        return _bench(arguments[1:], stream)
    args = _parser().parse_args(arguments)
    try:
        if args.command == "run":
            messages = list(_messages(Path(args.transcript)))
            if args.record:
                Path(args.record).unlink(missing_ok=True)  # one recording per run, never two spliced
            return trio.run(_run, args, _prepare_workspace(args), messages, stream)
        if args.command == "replay":
            return trio.run(_replay, args, _replay_workspace(args.recording), stream)
        if args.command == "tools":
            return _tools(args, stream)
        return _cache(args, stream)
    except (OSError, ValueError) as exc:
        stream.write(f"threepass: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
