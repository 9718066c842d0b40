"""The wheel: it ships the four packages and the example the command line runs, never the
benchmark or the tests; installed from it into a fresh virtualenv, `threepass demo` runs
end to end, and `threepass bench` says where the benchmark is."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

import dispatcher

REPO = Path(dispatcher.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from this checkout without reaching the network."""
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr
    [found] = out.glob("threepass-*.whl")
    return found


def test_the_wheel_ships_the_packages_and_the_example_only(wheel: Path) -> None:
    """The wheel holds dispatcher, cache, builtin_tools and threepass (with py.typed and the
    example transcript and workspace), and no bench or tests."""
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.startswith("threepass-")}
    assert tops == {"dispatcher", "cache", "builtin_tools", "threepass"}
    for package in tops:
        assert f"{package}/py.typed" in names
    assert "threepass/examples/transcript.jsonl" in names
    assert "threepass/examples/workspace/src/inventory.py" in names
    assert "threepass/examples/site/prices.html" in names
    assert "threepass/cli.py" in names and "dispatcher/cli.py" not in names
    assert not [n for n in names if n.startswith(("bench/", "tests/"))]


def test_bench_from_the_wheel_says_where_the_benchmark_is(wheel: Path, tmp_path: Path) -> None:
    """Installed from the wheel, away from a source tree, `threepass bench` exits 2 and says
    how to get the benchmark, with no traceback."""
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    script = (
        f"import sys; sys.path.insert(0, {str(unpacked)!r}); "
        "from threepass.cli import main; sys.exit(main(['bench']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 2
    assert "python -m bench" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_demo_from_a_fresh_virtualenv(wheel: Path, tmp_path: Path) -> None:
    """Installed by pip into a fresh virtualenv, `threepass demo` exits 0 in under 5 s, replay matched."""
    venv = tmp_path / "venv"
    # no pip of its own (seeding one takes longer than the rest of the test): this
    # environment's pip installs into it, run by the virtualenv's interpreter (--python)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # The wheel itself is installed by pip; its dependencies come from this environment
    # (no index is reached): a .pth file names this environment's site-packages, where
    # threepass may be installed too, hence --ignore-installed.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "deps-from-the-test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
         "--ignore-installed", str(wheel)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    started = time.monotonic()
    done = subprocess.run(
        [str(venv / "bin" / "threepass"), "demo"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith("replay: 19 calls in 6 batches matched")
    assert str(venv) in subprocess.run(
        [str(python), "-c", "import threepass; print(threepass.__file__)"],
        capture_output=True, text=True, check=True, timeout=60, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert took < 5.0, took
