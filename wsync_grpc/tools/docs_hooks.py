"""MkDocs hooks of the docs site (``mkdocs.yml``: ``hooks``).

The benchmark report (``BENCHMARKS.md``) and its plots (``bench/*.png``) live where ``make bench``
writes them, outside ``docs/``; this hook serves them in the site as ``benchmarks.md`` and
``bench/*.png``, so the site shows the last run's figures without a copy to keep in step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]


def on_files(files: Files, config: Any) -> Files:
    """Add ``BENCHMARKS.md`` (as ``benchmarks.md``) and ``bench/*.png`` to the site's files."""
    files.append(File.generated(config, "benchmarks.md", abs_src_path=str(ROOT / "BENCHMARKS.md")))
    for png in sorted((ROOT / "bench").glob("*.png")):
        files.append(File.generated(config, f"bench/{png.name}", abs_src_path=str(png)))
    return files
