"""The progress output's own rules: one bar per process, log records above it, nothing left behind."""

from __future__ import annotations

import io
import logging

import pytest

from elastic_runner.observe.logs import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def root_handler(monkeypatch: pytest.MonkeyPatch) -> logging.StreamHandler:  # type: ignore[type-arg]
    import sys

    handler = logging.StreamHandler(sys.stderr)
    monkeypatch.setattr(logging.root, "handlers", [handler])
    return handler


def test_a_new_attempts_bar_ends_the_last_ones_and_closing_gives_the_log_its_handler_back(
        root_handler: logging.Handler) -> None:
    terminal = Terminal()
    first = Progress(100, 0, 10, "text", "auto", stream=terminal)
    assert root_handler not in logging.root.handlers, "while a bar shows, records go above it"
    first.tick(30)
    second = Progress(100, 30, 10, "text", "auto", stream=terminal)  # an attempt after an in-process recovery
    assert first._tqdm is None, "the abandoned attempt's bar was closed"
    second.note("rank 1 (node a, pid 42) was killed by SIGKILL at step 30 → recovered in process in 0.15 s")
    second.close()
    assert root_handler in logging.root.handlers
    assert "\rrank 1 (node a, pid 42) was killed" in terminal.getvalue() or \
        "\nrank 1 (node a, pid 42) was killed" in terminal.getvalue()


def test_without_a_terminal_or_off_no_bar_and_the_log_is_untouched(root_handler: logging.Handler) -> None:
    for stream, setting in ((io.StringIO(), "auto"), (Terminal(), "off")):
        progress = Progress(100, 0, 10, "text", setting, stream=stream)
        assert progress._tqdm is None and root_handler in logging.root.handlers
        progress.report({"step": 10, "epoch": 0, "loss": 0.5, "samples_per_s": 320.0, "eta_s": 83.2})
        progress.close()
        assert stream.getvalue() == "step=10/100 epoch=0 loss=0.5 samples_per_s=320 eta=01:23\n"


def test_a_json_line_keeps_numbers_for_machines() -> None:
    stream = io.StringIO()
    Progress(100, 0, 10, "json", "off", stream=stream).report(
        {"step": 10, "epoch": 0, "loss": 0.5, "samples_per_s": 320.0, "eta_s": 83.2})
    assert stream.getvalue() == ('{"step":10,"epoch":0,"loss":0.5,"samples_per_s":320.0,"eta_s":83.2,'
                                 '"total_steps":100}\n')
