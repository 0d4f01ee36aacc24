"""The shape of the package: what the training process imports, and how big a module may grow."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ..support import ROOT

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
    assert defining == [str(Path("elastic_runner") / "worker" / "lifecycle.py")]


def test_the_worker_prints_nothing_that_could_interleave_with_another_ranks_line() -> None:
    """The ranks of a node share its terminal; ``print`` writes a line's text and its newline apart (unbuffered,
    under torchrun's ``-u``), so two ranks' lines could splice. Worker output goes through logging or
    ``logs.say`` (one write per line)."""
    worker_side = [p for p in PACKAGE.rglob("*.py")
                   if not any(part in p.parts for part in ("chaos", "testing", "agent", "rendezvous"))
                   and p.name not in ("cli.py", "report.py", "audit.py", "__main__.py", "launch.py")]
    printing = sorted(str(p.relative_to(ROOT)) for p in worker_side if re.search(r"(?<![\w.])print\(", p.read_text()))
    assert not printing, f"use logs.say or logging: {printing}"


def test_a_line_is_one_write() -> None:
    from elastic_runner.observe.logs import say

    class Pipe:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    pipe = Pipe()
    say("elastic_runner: config error: x", pipe)  # type: ignore[arg-type]
    assert pipe.writes == ["elastic_runner: config error: x\n"]


def test_no_module_imports_itself_back() -> None:
    """No import circle between modules, however indirect (a package importing its own modules aside)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    gen_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_docs)
    modules = {gen_docs.module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges = {m: {t for t in gen_docs.imported_modules(p, runtime_only=False)
                 if t in modules and t != m and not m.startswith(t + ".")} for m, p in modules.items()}
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(modules):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)
