"""``python -m elasticdl`` is the ``elasticdl`` command."""

from elasticdl.cli import main

raise SystemExit(main())
