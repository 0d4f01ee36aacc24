"""The shape of the package: what the training process imports, and how big a module may grow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..conftest import ROOT

PACKAGE = ROOT / "elastic_runner"


def test_the_training_process_imports_no_test_support() -> None:
    code = ("import sys, elastic_runner.train; "
            "print(sorted(m for m in sys.modules if m.startswith(('elastic_runner.testing', 'elastic_runner.chaos', "
            "'pytest'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"elastic_runner.train pulls in test support: {out.stdout.strip()}"


def test_no_module_is_longer_than_500_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these modules by concern: {long}"


def test_exit_statuses_are_defined_in_one_module() -> None:
    defining = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                      if any(line.startswith("EXIT_") and "=" in line for line in p.read_text().splitlines()))
    assert defining == [str(Path("elastic_runner") / "lifecycle.py")]
