"""The shape of the package: what the training process imports, and how big a module may grow."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

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
    assert defining == [str(Path("elastic_runner") / "lifecycle.py")]


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


def _gen_docs() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    gen_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_docs)
    return gen_docs


def upward_imports(modules: dict[str, Path], imports: Callable[[Path], set[str]]) -> list[str]:
    """Each import (``imports(path)``: type-only ones included) of a room on its own floor's other room or a floor
    above."""
    floor_of = _gen_docs().floor_of
    found = []
    for module, path in sorted(modules.items()):
        here = floor_of(module)
        for target in sorted(imports(path)):
            there = floor_of(target)
            if here is None or there is None or there[1] == here[1] or target not in modules:
                continue
            if there[0] <= here[0]:
                found.append(f"{module} ({here[1]}) imports {target} ({there[1]}, "
                             f"{'the same floor' if there[0] == here[0] else 'a floor above'})")
    return found


def test_every_room_imports_only_from_the_floors_below_it() -> None:
    """The floors declared once (scripts/gen_docs.py FLOORS, drawn on the architecture page): doors, then the
    agent, ... down to the ground floor of the process group and the process's primitives."""
    gen_docs = _gen_docs()
    modules = {gen_docs.module_name(path): path for path in PACKAGE.rglob("*.py")}
    unplaced = sorted(m for m in modules if m != "elastic_runner" and gen_docs.floor_of(m) is None)
    assert not unplaced, f"put these on a floor in scripts/gen_docs.py FLOORS: {unplaced}"
    wrong = upward_imports(modules, lambda path: gen_docs.imported_modules(path, runtime_only=False))
    assert not wrong, "imports against the floors (move the shared thing down, or name what is needed in a " \
        "Protocol): " + "; ".join(wrong)


def test_the_floor_check_sees_an_import_from_above() -> None:
    """Not a check of nothing: the training loop importing the worker's watchdog (as it once did) is caught."""
    loop = ROOT / "elastic_runner" / "training" / "loop.py"
    planted = {"elastic_runner.training.loop": loop, "elastic_runner.worker.watchdog": loop}
    assert upward_imports(planted, lambda path: {"elastic_runner.worker.watchdog"}) == [
        "elastic_runner.training.loop (training) imports elastic_runner.worker.watchdog (worker, a floor above)"]


def test_no_module_imports_itself_back() -> None:
    """No import circle between modules, however indirect (a package importing its own modules aside)."""
    gen_docs = _gen_docs()
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
