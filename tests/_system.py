"""System programs some tests need (bwrap, redis-server), and how their absence is reported.

On a newcomer's machine a missing program skips the test with a reason naming the Debian
package that brings it. `.ci/run` sets THREEPASS_REQUIRE_SYSTEM=1, which turns those skips
into failures, so CI proves the tests ran.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "THREEPASS_REQUIRE_SYSTEM"


def require_program(program: str, *, package: str) -> str:
    """The path of `program`; skip (or, under CI, fail) naming `package` when it is missing."""
    path = shutil.which(program)
    if path is not None:
        return path
    reason = f"{program} is not installed (Debian package {package!r}: apt-get install -y {package})"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}; {REQUIRE_ENV}=1 requires it")
    pytest.skip(reason)
