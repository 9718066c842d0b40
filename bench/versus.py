"""This checkout's per-call cost against another revision's, measured in the same run.

Each round runs bench/percall.py (this checkout's copy, the same measurement for both) in
a fresh process twice: once importing the kernel of REVISION (checked out into a
temporary folder with `git worktree`), once importing this checkout's. Rounds alternate
A B A B ..., so a shared machine's slow spells fall on both; each figure is the median
over the rounds, and the ratio is this checkout's over the revision's.

    python -m bench.versus REVISION [--rounds 7] [--loop trio|asyncio] [--write]

`--write` puts the table, with the command and the date, into bench/RESULTS.md between
`<!-- versus-REVISION -->` markers (the harness keeps such sections when it rewrites the file).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _figures(tree: Path, loop: str) -> dict[str, float]:
    """bench/percall.py of this checkout, run by path with `tree` first on the import path."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, str(HERE / "bench" / "percall.py"), "--loop", loop],
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"bench/percall.py against {tree} failed:\n{done.stderr}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("revision")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--loop", choices=["trio", "asyncio"], default="trio")
    parser.add_argument("--write", action="store_true", help="put the table into bench/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "base"
        subprocess.run(
            ["git", "-C", str(HERE), "worktree", "add", "-q", "--detach", str(base), args.revision],
            check=True,
        )
        try:
            seen: dict[str, dict[str, list[float]]] = {"base": {}, "here": {}}
            for _ in range(args.rounds):
                for name, tree in (("base", base), ("here", HERE)):
                    for key, value in _figures(tree, args.loop).items():
                        seen[name].setdefault(key, []).append(value)
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(base)], check=False)
    lines = [
        f"per-call cost, µs, median of {args.rounds} alternating rounds ({args.loop}):",
        f"{'':12} {args.revision[:12]:>12} {'this checkout':>14} {'ratio':>7}",
    ]
    for key in seen["base"]:
        a, b = statistics.median(seen["base"][key]), statistics.median(seen["here"][key])
        lines.append(f"{key:12} {a:12.2f} {b:14.2f} {b / a:6.2f}x")
    print("\n".join(lines))
    if args.write:
        from bench.sections import write_section

        command = " ".join(["python -m bench.versus", *map(shlex.quote, sys.argv[1:])])
        lines.append("(the same measurement, bench/percall.py, imports each revision's kernel in turn)")
        name = f"versus-{args.revision[:12].lower()}"
        write_section(name, f"This checkout against {args.revision}", command, lines)


if __name__ == "__main__":
    main()
