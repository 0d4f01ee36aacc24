"""The documentation: README as a short front door, generated pages that match the code, a site that builds
without a warning and whose internal links and anchors all resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..support import ROOT

README = ROOT / "README.md"


def test_the_generated_pages_are_current() -> None:
    """The configuration and etcd option references and the architecture page follow the code."""
    out = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr


def test_every_module_has_a_docstring_for_the_architecture_page() -> None:
    import ast

    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "elastic_runner").rglob("*.py"))
               if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"say in a docstring what these modules hold: {missing}"


def test_the_readme_is_a_front_door() -> None:
    """Short, and undated: a figure is one line with a link to docs/benchmarks.md, where each table keeps its
    command and date (dated tables in the README went stale and contradicted the pages)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "README.md grew past 200 lines: move the details into docs/"
    for command in ("scripts/quickstart.sh", "scripts/test.sh"):
        assert command in text
    dated = [line for line in text.splitlines() if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert not dated, f"README.md has dated lines (their place is docs/benchmarks.md): {dated}"
    tables = [line for line in text.splitlines() if line.startswith("|")]
    assert not tables, f"README.md has a table (one line per headline figure instead): {tables[:2]}"


def test_every_relative_link_of_the_readme_and_changelog_exists() -> None:
    for page in (README, ROOT / "CHANGELOG.md"):
        targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
        local = [t for t in targets if "://" not in t and not t.startswith("mailto:")]
        missing = [t for t in local if not (page.parent / t).exists()]
        assert not missing, f"{page.name} links to files that do not exist: {missing}"


def test_the_site_builds_without_a_warning(tmp_path: Path) -> None:
    """``mkdocs build --strict`` with link and anchor validation (mkdocs.yml): a broken internal link fails."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra: pip install -e '.[docs]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed (the docs extra)")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").exists()


def test_every_test_the_fault_table_names_exists() -> None:
    """docs/development.md's fault × moment table names tests by file and name prefix: a renamed or removed test
    must not leave its cell claiming coverage."""
    text = (ROOT / "docs" / "development.md").read_text()
    table = text[text.index("### Each fault at each moment"):]
    folders = {"E": "elastic", "M": "multiprocess", "U": "unit", "I": "integration"}
    cited = set(re.findall(r"`([EMUI])/(\w+)::(\w+)", table))
    assert len(cited) > 20, "the table cites the tests it counts"
    missing = [f"{d}/{module}::{name}" for d, module, name in sorted(cited)
               if not re.search(rf"def test_{name}", (ROOT / "tests" / folders[d] / f"test_{module}.py").read_text()
                                if (ROOT / "tests" / folders[d] / f"test_{module}.py").exists() else "")]
    assert not missing, f"docs/development.md names tests that do not exist: {missing}"
