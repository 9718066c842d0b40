"""`threepass demo`: the main job with nothing to configure.

The shipped example (threepass/examples/) is run as a person would run it: the
workspace copied to a temporary folder, the small site served on loopback for the web
tools (the network policy allows loopback for the demo's registry only), the
transcript dispatched through every pass with its gate and its question answered by the
demo's script, recorded, then replayed offline against the recording. In the
transcript, `{{site}}` stands for the site's address, which is only known once it is
served.
"""

from __future__ import annotations

import http.server
import json
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

from builtin_tools import default_registry
from cache import MemoryResultCache
from dispatcher import Dispatcher

from ._runner import Answers, TranscriptRun

__all__ = ["DEMO_ANSWERS", "DEMO_APPROVALS", "EXAMPLES", "run_demo", "serve_site"]

EXAMPLES = Path(__file__).resolve().parent / "examples"
DEMO_APPROVALS = frozenset({"call_16"})
"""The calls the demo's script approves at the gate: the order POSTed to the site."""
DEMO_ANSWERS = ("yes",)
"""What the demo's script answers to `ask_user`, in order."""


class _SiteHandler(http.server.SimpleHTTPRequestHandler):
    """The example site: its files for GET, and an order desk for POST /orders."""

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if self.path != "/orders":
            self.send_error(404)
            return
        try:
            order = json.loads(body or b"{}")
        except ValueError:
            self.send_error(400, "the order is not JSON")
            return
        reply = json.dumps({"accepted": True, "order": order}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def serve_site(folder: Path) -> Iterator[str]:
    """Serve `folder` on a free loopback port for as long as the block lasts; yields the
    site's address."""

    def handler(*args: Any, **kwargs: Any) -> _SiteHandler:
        return _SiteHandler(*args, directory=str(folder), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="threepass-demo-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _messages(site: str) -> list[dict[str, Any]]:
    text = (EXAMPLES / "transcript.jsonl").read_text(encoding="utf-8").replace("{{site}}", site)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_demo(
    view: Any,
    *,
    record: str | None,
    timeline: str | None,
    write_timeline: Callable[..., None],
) -> int:
    """Run, record and replay the example; 0 if the replay matched, 1 where it diverged,
    130 if interrupted."""
    from .cli import EXIT_BAD, EXIT_INTERRUPTED, EXIT_OK, _drive, _report_run, replay_recording

    folder = Path(tempfile.mkdtemp(prefix="threepass-demo-"))
    workspace = folder / "workspace"
    shutil.copytree(EXAMPLES / "workspace", workspace)
    recording = record or str(folder / "demo.recording.jsonl")
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

        def make(**kw: Any) -> Dispatcher:
            return Dispatcher(registry, cache=cache, **kw)

        answers = Answers(
            approve=DEMO_APPROVALS, texts=list(DEMO_ANSWERS), interactive=False, source="the demo's script"
        )
        runner = TranscriptRun(
            make,
            view,
            answers,
            record=recording,
            meta={"workspace": str(workspace), "transcript": "demo", "private_network": "yes"},
        )
        interrupted = trio.run(_drive, view, runner, _messages(site))
    _report_run(view, runner, interrupted, recording)
    if timeline:
        write_timeline(
            timeline,
            runner.outcome,
            view,
            title="threepass demo",
            limit=int(runner.dispatcher.limiter.total_tokens),
        )
    if interrupted:
        return EXIT_INTERRUPTED
    if runner.outcome.recording_problem is not None:
        view.message("problem", f"the recording stopped early: {runner.outcome.recording_problem}")
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
