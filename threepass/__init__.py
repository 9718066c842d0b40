"""threepass, the application: the command line (`threepass demo`, `run`, `replay`,
`inspect`, `tools`, `cache`, `bench`), its views and timeline, and the example it runs.
The libraries are `dispatcher` (the kernel), `cache` (result stores) and `builtin_tools`
(the tools that ship); nothing here is imported by them.
"""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("threepass")
except PackageNotFoundError:  # pragma: no cover - run from a source tree that was never installed
    __version__ = "0+unknown"
