"""``python -m kvlab`` is the same program as the ``kvlab`` command."""

from kvlab.cli import main

raise SystemExit(main())
