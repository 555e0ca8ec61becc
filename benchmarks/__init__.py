"""ElasticDL's benchmark suite: ``python -m benchmarks`` (``make bench``); see docs/benchmarks.md."""
