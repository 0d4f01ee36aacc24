"""The report picture tells a run at a glance: what failed and when, where training paused, how the test
metric went, the world size only when it changed; against wall time or steps."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.observe.report import gap_cause, timeline_figure


def attempt(g: int, t: float, world: int, steps: range, *, ended_by: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Rank 0's events of one attempt: a step every 0.1 s from ``t``, a snapshot every 20 steps."""
    base = {"generation": g, "rank": 0, "source": f"gen-{g:06d}-rank-00000"}
    out = [base | {"time": t, "kind": "start", "world_size": world, "run_id": "job", "agent": "agent-a"},
           base | {"time": t, "kind": "world", "world_size": world, "step": steps.start, "global_batch": 32},
           base | {"time": t + 0.1, "kind": "first_step", "step": steps.start + 1}]
    for i, step in enumerate(steps):
        now = t + 0.1 * (i + 1)
        if step % 10 == 0:
            out.append(base | {"time": now, "kind": "progress", "step": step, "loss": 1.0 / step, "samples_per_s": 320.0})
        if step % 20 == 0:
            out.append(base | {"time": now, "kind": "snapshot_saved", "step": step, "snapshot": f"s{step}",
                               "blocking_s": 0.001, "write_s": 0.01})
        if step % 50 == 0:
            out.append(base | {"time": now, "kind": "eval", "step": step, "eval_loss": 2.0 / step,
                               "eval_accuracy": min(0.99, step / 200), "eval_samples": 100})
    if ended_by is not None:
        out.append(base | {"time": t + 0.1 * len(steps) + 0.05, "step": steps.stop - 1} | ended_by)
    return out


def run_events(world_after: int) -> list[dict[str, Any]]:
    return (attempt(1, 0.0, 2, range(1, 101), ended_by={"kind": "failure", "error": "RuntimeError: [pair.cc:553] "
                                                        "Connection closed by peer [127.0.0.1]:4242"})
            + [{"time": 10.5, "kind": "snapshot_failed", "generation": 1, "rank": 0, "step": 100, "snapshot": "s100",
                "error": "No space left on device"},
               {"time": 14.0, "kind": "resume", "generation": 2, "rank": 0, "step": 100, "steps_recomputed": 0}]
            + attempt(2, 14.0, world_after, range(101, 201), ended_by={"kind": "end", "status": "finished"}))


def test_the_picture_names_each_recovery_breaks_lines_at_it_and_shows_the_test_metric(tmp_path: Path) -> None:
    fig, summary = timeline_figure(str(tmp_path), run_events(world_after=1))
    loss_ax, rate_ax, world_ax = fig.axes[:3]
    assert len(summary.gaps) == 1 and summary.gaps[0].cause == "peer lost (connection closed)"
    assert "peer lost (connection closed)" in [t.get_text() for t in loss_ax.texts], "the cause on the plot"
    (training, *_) = [line for line in loss_ax.lines if line.get_label() == "training loss"]
    assert any(math.isnan(v) for v in training.get_xdata()), "no straight line drawn across the pause"
    metric_ax = fig.axes[3]
    assert metric_ax.get_ylabel() == "test accuracy" and len(metric_ax.lines[0].get_xdata()) == 4
    assert world_ax.get_ylabel() == "world size"
    legend = [t.get_text() for t in rate_ax.get_legend().get_texts()]
    assert legend == ["snapshot (10)", "snapshot write failed (1)"]


def test_a_world_size_that_never_changed_gets_no_panel_and_steps_can_be_the_x_axis(tmp_path: Path) -> None:
    fig, _ = timeline_figure(str(tmp_path), run_events(world_after=2), x_axis="steps")
    panels = [ax for ax in fig.axes if ax.get_ylabel() in ("loss", "samples / s", "world size")]
    assert [ax.get_ylabel() for ax in panels] == ["loss", "samples / s"]
    assert "world size 2 throughout" in fig._suptitle.get_text()
    assert panels[-1].get_xlabel() == "optimizer step"
    with pytest.raises(ValueError, match="use time or steps"):
        timeline_figure(str(tmp_path), run_events(world_after=2), x_axis="epochs")


@pytest.mark.parametrize(("events", "cause"), [
    ([{"kind": "stop", "signal": "SIGTERM", "by_agent": "a node is waiting to join"}], "node joined"),
    ([{"kind": "stop", "signal": "SIGTERM", "by_agent": "the agent is shutting down on SIGTERM"}], "node stopped (SIGTERM)"),
    ([{"kind": "failure", "error": "peer lost: rank 3 stopped heartbeating 2.0s ago (dist.heartbeat_seconds=2)"}],
     "rank 3 hung or died"),
    ([{"kind": "stop", "signal": "SIGTERM", "by_agent": None}], "stopped (SIGTERM)"),
    ([{"kind": "failure", "error": "ValueError: bad batch"}], "ValueError"),
    ([{"kind": "progress"}], "workers killed"),
])
def test_each_recovery_is_named_by_what_ended_the_attempt(events: list[dict[str, Any]], cause: str) -> None:
    assert gap_cause(events) == cause


@pytest.mark.parametrize("low, high", [(2.5, 4.5), (0.04, 2.3), (0.9, 1.2)])
def test_the_loss_axis_reads_as_plain_numbers(low: float, high: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from elastic_runner.observe.report import plain_log_scale

    fig, ax = plt.subplots()
    ax.plot([0, 1, 2], [high, (low + high) / 2, low])
    plain_log_scale(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels(minor=False) + ax.get_yticklabels(minor=True) if t.get_text()]
    plt.close(fig)
    assert labels, "the loss axis has labelled ticks"
    assert all(re.fullmatch(r"[0-9.]+", text) for text in labels), labels
