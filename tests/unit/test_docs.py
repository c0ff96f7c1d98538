"""The failure-semantics tables name, for every row, tests that exist; the site and the README lead to them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "failure-semantics.md"


def _test_functions() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(node.name)
    return names


def test_every_row_of_the_failure_tables_names_existing_tests() -> None:
    text = DOC.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| What happened")]
    rows = [r for r in rows if not r.startswith("| Around the sync")]
    defined = _test_functions()
    assert len(rows) >= 20
    for row in rows:
        cited = set(re.findall(r"\btest_[a-z0-9_]+(?=[`\[:, )]|$)", row.rsplit("|", 2)[-2]))
        assert cited, f"a row without a test: {row[:80]}"
        missing = cited - defined
        assert not missing, f"{row[:60]}...: no such test {sorted(missing)}"


def test_the_readme_and_the_site_lead_to_the_failure_semantics() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/failure-semantics.md)" in readme
    assert "failure-semantics.md" in (ROOT / "mkdocs.yml").read_text()
