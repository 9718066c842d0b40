"""``python -m bench``: every system over the same workloads in one run (bench/harness.py)."""

from .harness import main

if __name__ == "__main__":
    raise SystemExit(main())
