"""MkDocs hooks of the docs site (``mkdocs.yml``: ``hooks``).

- The benchmark report (``BENCHMARKS.md``) and its plots (``bench/*.png``) live where ``make bench``
  writes them, outside ``docs/``; the site serves them as ``benchmarks.md`` and ``bench/*.png``, so it
  shows the last run's figures without a copy to keep in step.
- Docstrings cross-reference with Sphinx roles (``:class:`~a.b.C```); the API pages show the name as
  code, the role dropped and a leading ``~`` shortened to the last component, as Sphinx shows it.
- Diagrams are Mermaid text; the Material theme renders them in the reader's browser with the Mermaid
  script it fetches there. For a reader with no network, ``WSYNC_DOCS_MERMAID_JS=/path/mermaid.min.js``
  at build time puts that file in the site (``assets/mermaid.min.js``), and the theme uses it instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
MERMAID_ENV = "WSYNC_DOCS_MERMAID_JS"
MERMAID_URI = "assets/mermaid.min.js"


_ROLE = re.compile(r":(?:meth|class|func|data|attr|mod|exc|obj):<code>(~?)([\w.]+)(\(\))?</code>")


def _shown(m: re.Match[str]) -> str:
    name = m[2].rsplit(".", 1)[-1] if m[1] else m[2]
    return f"<code>{name}{m[3] or ''}</code>"


def on_page_content(html: str, **_: object) -> str:
    """Docstrings' Sphinx roles as plain code names (``:meth:`sync``` -> ``sync``)."""
    return _ROLE.sub(_shown, html)


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Load a local Mermaid script before the theme's own, when ``WSYNC_DOCS_MERMAID_JS`` names one."""
    if os.environ.get(MERMAID_ENV):
        config.extra_javascript.append(MERMAID_URI)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add ``BENCHMARKS.md`` (as ``benchmarks.md``), ``bench/*.png`` and the local Mermaid script, if any."""
    files.append(File.generated(config, "benchmarks.md", abs_src_path=str(ROOT / "BENCHMARKS.md")))
    for png in sorted((ROOT / "bench").glob("*.png")):
        files.append(File.generated(config, f"bench/{png.name}", abs_src_path=str(png)))
    if mermaid := os.environ.get(MERMAID_ENV):
        files.append(File.generated(config, MERMAID_URI, abs_src_path=mermaid))
    return files
