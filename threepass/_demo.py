"""`threepass demo`: the main job with nothing to configure.

What the demo runs on, beside the shipped example (threepass/examples/): the small site
served on loopback for the web tools, and the script that answers for the person (the
gate's approvals by call id, `ask_user`'s answers in order). In the transcript,
`{{site}}` stands for the site's address, which is only known once it is served. The
command itself (copy, serve, run, record, replay) is `threepass.cli`'s `demo`.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["DEMO_ANSWERS", "DEMO_APPROVALS", "EXAMPLES", "demo_messages", "serve_site"]

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


def demo_messages(site: str) -> list[dict[str, Any]]:
    text = (EXAMPLES / "transcript.jsonl").read_text(encoding="utf-8").replace("{{site}}", site)
    return [json.loads(line) for line in text.splitlines() if line.strip()]
