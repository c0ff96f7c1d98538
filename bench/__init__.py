"""wsync benchmarks: ``make bench`` (``python -m bench.run``) writes ``BENCHMARKS.md`` and its plots.

- :mod:`bench.run`: the suite (the trainer side, rank 0) and the report.
- :mod:`bench.engine`: the engine-side helper process (a wsync servicer plus a
  plain HTTP server for the raw-broadcast ceiling and the naive baseline).
- :mod:`bench.naive`: the naive way (JSON over HTTP, one collective per tensor).
- :mod:`bench.profile`: per-thread CPU accounting and py-spy sampling (section 7).
- :mod:`bench.common`: models, HTTP and memory helpers shared by both sides.
"""
