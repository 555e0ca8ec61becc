"""``python -m benchmarks``: run the benchmark suite; see benchmarks/runner.py and docs/benchmarks.md."""

from benchmarks.runner import main

raise SystemExit(main())
