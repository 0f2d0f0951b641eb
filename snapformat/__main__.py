"""``python -m snapformat``: the same command as ``snapformat``."""

from snapformat.cli import main

raise SystemExit(main())
