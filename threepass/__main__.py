"""`python -m threepass`: the command line."""

from .cli import main

raise SystemExit(main())
