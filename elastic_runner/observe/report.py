"""``elastic-runner report RUN_DIR --out run.png``: a picture and a summary of a run.

Everything comes from the run's event log (``RUN_DIR/events``) and, when
present, its audit trail. The picture (matplotlib, the ``report`` extra)
shows loss and throughput over wall time, the world size as steps, restarts
and snapshots as marks, and the gaps in which the job was recovering shaded. The summary includes the run's goodput and where
the lost time went (:mod:`elastic_runner.observe.goodput`).
"""

from __future__ import annotations

import argparse
import bisect
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..printable import printable
from .events import read_events, starts_a_session
from .goodput import Goodput
from .goodput import measure as measure_goodput


@dataclass
class Gap:
    start: float
    end: float
    generation: int
    cause: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Session:
    """One start of the job by hand (a ``torchrun``/``launch`` command, a Kubernetes Job): its
    generations up to the next start by hand. Time between sessions is nobody's downtime."""

    first_generation: int
    start: float
    end: float
    reached_a_step: bool  #: or found the run already finished: not a failed start

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass
class RunSummary:
    run_dir: str
    t0: float
    t_end: float
    finished: bool
    final_step: int
    generations: int
    world_sizes: list[int]
    gaps: list[Gap] = field(default_factory=list)
    snapshots: int = 0
    snapshot_blocking_ms: float | None = None
    snapshot_write_ms: float | None = None
    rejected: int = 0
    samples_lost: str = "unknown (run with audit.samples: true)"
    sessions: list[Session] = field(default_factory=list)
    goodput: Goodput | None = None
    #: A mixture's sources (data.sources), from the audit: what the run took from each, and its share.
    sources: list[Any] = field(default_factory=list)
    #: The ``straggler`` events that named a rank (recovery.straggler_ratio), in time order.
    stragglers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def wall(self) -> float:
        """Training wall time: the sessions' time, not the hours between a stop and a resume by hand."""
        if self.sessions:
            return sum(s.seconds for s in self.sessions)
        return max(0.0, self.t_end - self.t0)

    @property
    def failed_starts(self) -> int:
        """Sessions that never reached a training step (a bad config, a missing snapshot, ...)."""
        return sum(1 for s in self.sessions if not s.reached_a_step)

    @property
    def downtime(self) -> float:
        return sum(g.seconds for g in self.gaps)

    @property
    def uptime_fraction(self) -> float | None:
        return (1 - self.downtime / self.wall) if self.wall > 0 else None

    def text(self) -> str:
        recoveries = [g.seconds for g in self.gaps]
        lines = [
            f"run {self.run_dir}: {'finished' if self.finished else 'not finished'} at step {self.final_step} "
            f"after {self.wall:.1f} s of training wall time",
            f"generations: {self.generations}; world sizes: {' -> '.join(map(str, self.world_sizes)) or '?'}",
        ]
        if len(self.sessions) > 1:
            lines.append(f"sessions: {len(self.sessions)} (started or resumed by hand; the time between them is not "
                         f"counted), {self.failed_starts} failed start(s)")
        if recoveries:
            lines.append(f"recoveries: {len(recoveries)}, {min(recoveries):.2f} / {statistics.median(recoveries):.2f} / "
                         f"{max(recoveries):.2f} s (min/median/max); downtime {self.downtime:.1f} s; "
                         f"uptime fraction {self.uptime_fraction:.3f}")
        else:
            lines.append("recoveries: none; uptime fraction 1.000")
        if self.snapshots:
            lines.append(f"snapshots: {self.snapshots} saved (median blocking {self.snapshot_blocking_ms:.1f} ms, "
                         f"median write {self.snapshot_write_ms:.1f} ms), {self.rejected} rejected as damaged")
        if self.goodput is not None:
            lines.append(self.goodput.text())
        lines.append(f"samples lost: {self.samples_lost}")
        if self.stragglers:
            lines.append("stragglers: " + "; ".join(
                f"rank {e['rank']} (node {e['node']}, host {printable(e.get('host') or '?', 80)}) named at step {e.get('step')}, "
                f"{e['ratio']:.2f}x the median rank's own time per step" for e in self.stragglers))
        if self.sources:
            lines.append("mixture: " + ", ".join(
                f"{s.label} {s.share:.4f} of the samples (weight {s.weight_share:.4f}), "
                f"{s.taken / s.samples:.2f} epochs" for s in self.sources))
        return "\n".join(lines)


def summarize(run_dir: str, events: list[dict[str, Any]] | None = None) -> RunSummary:
    events = read_events(run_dir) if events is None else events
    workers = [e for e in events if e.get("role") != "agent"]
    if not workers:
        raise ValueError(f"no events in {run_dir}/events: is it a run directory (run.dir)?")
    by_gen: dict[int, dict[str, Any]] = {}
    for e in workers:
        g = e.get("generation")
        if g is None:
            continue
        info = by_gen.setdefault(g, {"events": []})
        info["events"].append(e)
        if e["kind"] == "start":
            info.setdefault("start", e["time"])
            info["world"] = e["world_size"]
        elif e["kind"] == "first_step" or (e["kind"] == "progress" and "first_step" not in info):
            info.setdefault("first_step", e["time"])
    first = min(by_gen)
    t0 = by_gen[first].get("first_step", by_gen[first].get("start", workers[0]["time"]))
    begins = _session_starts(by_gen)
    gaps = []
    for g in sorted(by_gen):
        if g in begins:
            continue
        prev = by_gen.get(g - 1) or by_gen[max(k for k in by_gen if k < g)]
        prev_end = max(e["time"] for e in prev["events"])
        failures = [e["time"] for e in prev["events"] if e["kind"] in ("failure", "stop", "kept_in_memory")]
        start = min(failures) if failures else prev_end
        # progress stopped at the last progress line before the failure, at the latest
        progress = [e["time"] for e in prev["events"] if e["kind"] == "progress" and e["time"] <= start]
        start = min(start, max(progress, default=start) + 0.0)
        end = by_gen[g].get("first_step", by_gen[g].get("start", start))
        gaps.append(Gap(start=start, end=max(start, end), generation=g, cause=gap_cause(prev["events"])))
    sessions = []
    for i, g in enumerate(sorted(begins)):
        upto = sorted(begins)[i + 1] if i + 1 < len(begins) else None
        gens = [k for k in sorted(by_gen) if k >= g and (upto is None or k < upto)]
        stepped = [by_gen[k]["first_step"] for k in gens if "first_step" in by_gen[k]]
        last = max(e["time"] for k in gens for e in by_gen[k]["events"])
        done = any(e["kind"] == "end" and e.get("status") == "finished" for k in gens for e in by_gen[k]["events"])
        sessions.append(Session(first_generation=g, start=min(stepped, default=last), end=last,
                                reached_a_step=bool(stepped) or done))
    ends = [e for e in workers if e["kind"] == "end" and e.get("status") == "finished"]
    steps = [e.get("step") or 0 for e in workers if isinstance(e.get("step"), int)]
    saved = [e for e in workers if e["kind"] == "snapshot_saved"]
    summary = RunSummary(
        run_dir=str(run_dir), t0=t0, t_end=max(e["time"] for e in workers), finished=bool(ends),
        final_step=max(steps, default=0), generations=len(by_gen),
        world_sizes=_collapse([by_gen[g].get("world") for g in sorted(by_gen) if by_gen[g].get("world")]),
        gaps=gaps, sessions=sessions, snapshots=len(saved), rejected=sum(1 for e in workers if e["kind"] == "snapshot_rejected"),
        stragglers=[e for e in workers if e["kind"] == "straggler" and e.get("status") == "named"],
    )
    summary.goodput = measure_goodput(events, gaps, summary.wall, {gap.generation for gap in gaps})
    if saved:
        summary.snapshot_blocking_ms = 1000 * statistics.median(e["blocking_s"] for e in saved)
        summary.snapshot_write_ms = 1000 * statistics.median(e["write_s"] for e in saved)
    if (Path(run_dir) / "audit").is_dir():
        from .audit import check_audit

        audit = check_audit(run_dir)
        missing = sum(len(e.missing) for e in audit.epochs)
        dup = sum(len(e.duplicates) for e in audit.epochs)
        summary.samples_lost = "0 (audit clean)" if audit.ok else f"{missing} missing, {dup} duplicated (audit FAILED)"
        summary.sources = audit.sources
    return summary


def gap_cause(events: list[dict[str, Any]]) -> str:
    """What ended an attempt, in a few words, from what its workers recorded (most telling first)."""
    stops = [e for e in events if e["kind"] == "stop"]
    failures = [str(e.get("error") or "") for e in events if e["kind"] == "failure"]
    for e in stops:
        reason = str(e.get("by_agent") or "")
        if "waiting to join" in reason:
            return "node joined"
        if "shutting down" in reason:
            return f"node stopped ({e.get('signal') or 'signal'})"
    hung = next((f for f in failures if "stopped heartbeating" in f and not f.startswith("peer lost: another")), None)
    if hung is not None:
        rank = hung.split("rank ", 1)[1].split(" ", 1)[0] if "rank " in hung else "?"
        return f"rank {rank} hung or died"
    if stops:
        return f"stopped ({stops[0].get('signal') or 'by request'})"
    if any("closed by peer" in f or "Read error" in f or "Connection reset" in f for f in failures):
        return "peer lost (connection closed)"
    if failures:
        return failures[0].split(":")[0][:40]
    return "workers killed" if events else "restart"


def _session_starts(by_gen: dict[int, dict[str, Any]]) -> set[int]:
    """The generations that were started by hand rather than by a recovery (:func:`.events.starts_a_session`)."""
    begins: set[int] = set()
    seen: set[str] = set()
    previous: dict[str, Any] | None = None
    for g in sorted(by_gen):
        starts = [e for e in by_gen[g]["events"] if e["kind"] == "start"]
        if previous is None or starts_a_session(starts, seen, previous["events"]):
            begins.add(g)
        seen |= {e["agent"] for e in starts if e.get("agent")}
        previous = by_gen[g]
    return begins


def _collapse(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if not out or out[-1] != v:
            out.append(v)
    return out


#: Above this many recoveries the picture names none of them (the labels would cover the curves).
MAX_NAMED_GAPS = 40


def _broken(points: list[tuple[float, float]], gaps: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """x and y of a line that stops at every gap (a NaN between two points with a gap start between them)
    instead of drawing straight across a pause."""
    starts = sorted(a for a, _ in gaps)
    xs: list[float] = []
    ys: list[float] = []
    for x, y in points:
        if xs:
            i = bisect.bisect_left(starts, xs[-1])
            if i < len(starts) and starts[i] < x:
                xs.append(math.nan)
                ys.append(math.nan)
        xs.append(x)
        ys.append(y)
    return xs, ys


def plain_log_scale(ax: Any) -> None:
    """A log-scale y axis whose tick labels read as plain numbers (3, 0.4), not ``3×10^0``: matplotlib
    still decides which ticks get a label; only how a label is written changes."""
    from matplotlib import ticker

    ax.set_yscale("log")
    for which in ("major", "minor"):
        scientific = ax.yaxis.get_major_formatter() if which == "major" else ax.yaxis.get_minor_formatter()

        def plain(value: float, pos: int | None = None, scientific: Any = scientific) -> str:
            return f"{value:g}" if scientific(value, pos) else ""

        formatter = ticker.FuncFormatter(plain)
        formatter.set_locs = scientific.set_locs  # type: ignore[method-assign]  # the scientific one decides which ticks
        (ax.yaxis.set_major_formatter if which == "major" else ax.yaxis.set_minor_formatter)(formatter)


def _main_metric(evals: list[dict[str, Any]]) -> str | None:
    """The evaluation's main metric besides the loss: accuracy if there is one, else the first other."""
    keys = [k for k in (evals[-1] if evals else {}) if k.startswith("eval_") and k not in ("eval_loss", "eval_samples")
            and isinstance(evals[-1][k], (int, float))]
    return "eval_accuracy" if "eval_accuracy" in keys else (keys[0] if keys else None)


def render_timeline(run_dir: str, out: str, events: list[dict[str, Any]] | None = None,
                    x_axis: str = "time") -> RunSummary:
    """Draw the run's picture (:func:`timeline_figure`) into the PNG file ``out``."""
    fig, summary = timeline_figure(run_dir, events, x_axis)
    import matplotlib.pyplot as plt  # importable: timeline_figure checked

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return summary


def timeline_figure(run_dir: str, events: list[dict[str, Any]] | None = None, x_axis: str = "time") -> tuple[Any, RunSummary]:
    """The run as a picture: loss (and the test metric), throughput and world size (a panel only when it
    changed) over wall time (``x_axis="time"``) or over steps (``"steps"``), every recovery shaded and
    named, lines broken at gaps, snapshots as a rug."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("the picture needs matplotlib: pip install 'elastic-runner[report]'") from exc
    if x_axis not in ("time", "steps"):
        raise ValueError(f"x axis {x_axis!r}: use time or steps")
    events = read_events(run_dir) if events is None else events
    summary = summarize(run_dir, events)
    t0 = summary.t0
    rank0 = [e for e in events if e.get("rank") == 0 and e.get("role") != "agent"]
    progress = sorted((e for e in rank0 if e["kind"] == "progress"), key=lambda e: e["time"])
    evals = sorted((e for e in rank0 if e["kind"] == "eval"), key=lambda e: e["time"])
    worlds = sorted((e for e in rank0 if e["kind"] == "world"), key=lambda e: e["time"])
    saved = [e for e in rank0 if e["kind"] == "snapshot_saved"]
    failed = [e for e in rank0 if e["kind"] == "snapshot_failed"]
    resumes = {e["generation"]: e for e in rank0 if e["kind"] == "resume"}
    by_steps = x_axis == "steps"
    if by_steps:  # a step redone after a recovery is drawn once, as it was finally taken
        progress = sorted({e["step"]: e for e in progress}.values(), key=lambda e: e["step"])

    def x(e: dict[str, Any]) -> float:
        return float(e.get("step") or 0) if by_steps else e["time"] - t0

    # Where each recovery sits on the x axis: in time, from the failure to all ranks stepping again; in
    # steps, from the step training went back to, to the furthest step reached before (the steps redone).
    spans: list[tuple[float, float, str]] = []
    for gap in summary.gaps:
        if by_steps:
            resume = resumes.get(gap.generation) or {}
            back = float(resume.get("step") or 0)
            spans.append((back, back + float(resume.get("steps_recomputed") or 0), gap.cause))
        else:
            spans.append((gap.start - t0, gap.end - t0, gap.cause))
    breaks = [] if by_steps else [(a, b) for a, b, _ in spans]  # training is continuous in steps
    sizes = {w["world_size"] for w in worlds}
    panels = 3 if len(sizes) > 1 else 2
    fig, axes = plt.subplots(panels, 1, figsize=(11, 7.5 if panels == 3 else 6), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, 1.2][:panels]})
    ax_loss, ax_rate = axes[0], axes[1]
    ax_world = axes[2] if panels == 3 else None
    ax_loss.plot(*_broken([(x(e), e["loss"]) for e in progress if "loss" in e], breaks), color="#1f77b4", lw=1.4, label="training loss")
    if evals:
        ax_loss.plot([x(e) for e in evals], [e["eval_loss"] for e in evals], "o", color="#ff7f0e", ms=4, label="test loss")
    ax_loss.set_ylabel("loss")
    plain_log_scale(ax_loss)
    metric = _main_metric(evals)
    if metric is not None:
        ax_metric = ax_loss.twinx()
        name = "test " + metric.removeprefix("eval_").replace("_", " ")
        ax_metric.plot([x(e) for e in evals if metric in e], [e[metric] for e in evals if metric in e], "s--",
                       color="#2ca02c", ms=4, lw=0.8, label=name)
        ax_metric.set_ylabel(name, color="#2ca02c")
        ax_metric.tick_params(axis="y", colors="#2ca02c")
    ax_rate.plot(*_broken([(x(e), e["samples_per_s"]) for e in progress], breaks), color="#555555", lw=1.2)
    ax_rate.set_ylabel("samples / s")
    if ax_world is not None and worlds:
        end = max((x(e) for e in progress), default=0.0) if by_steps else summary.t_end - t0
        xs = [x(w) for w in worlds] + [end]
        ys = [w["world_size"] for w in worlds] + [worlds[-1]["world_size"]]
        ax_world.step(xs, ys, where="post", color="#9467bd", lw=2)
        ax_world.set_ylim(0, max(ys) + 1)
        ax_world.set_ylabel("world size")
    bottom = axes[-1]
    bottom.set_xlabel("optimizer step" if by_steps else "wall time since the first step (s)")
    named = len(spans) <= MAX_NAMED_GAPS
    for ax in axes:
        for i, (a, b, _) in enumerate(spans):
            ax.axvspan(a, b, color="#d62728", alpha=0.15 if named else 0.08, lw=0,
                       label=("steps redone" if by_steps else "recovering") if (ax is ax_loss and i == 0) else None)
            if named:  # hundreds of lines would hide the curves
                ax.axvline(a, color="#d62728", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    if named:
        for a, _, cause in spans:
            ax_loss.annotate(cause[:40], (a, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -4),
                             textcoords="offset points", rotation=90, va="top", fontsize=7, color="#d62728")
    # Snapshots: a rug along the bottom of the throughput panel (failed writes in red), legible at any count.
    rug = ax_rate.get_xaxis_transform()
    if saved:
        ax_rate.vlines([x(e) for e in saved], 0, 0.08, transform=rug, color="#7f7f7f", lw=0.8,
                       alpha=1.0 if len(saved) < 200 else 0.4, label=f"snapshot ({len(saved)})")
    if failed:
        ax_rate.vlines([x(e) for e in failed], 0, 0.14, transform=rug, color="#d62728", lw=1.2,
                       label=f"snapshot write failed ({len(failed)})")
    if saved or failed:
        ax_rate.legend(loc="upper right", fontsize=8)
    handles, labels = ax_loss.get_legend_handles_labels()
    if metric is not None:
        more = ax_metric.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    (ax_metric if metric is not None else ax_loss).legend(handles, labels, loc="upper right", fontsize=8)
    upt = summary.uptime_fraction
    good = summary.goodput.fraction if summary.goodput is not None else None
    world = f", world size {next(iter(sizes))} throughout" if len(sizes) == 1 else ""
    title = Path(run_dir).name
    if upt is not None:
        title += (f": {summary.generations} generation(s), {len(summary.gaps)} recovery(ies), uptime {upt:.1%}"
                  + (f", goodput {good:.1%}" if good is not None else "")
                  + f", samples lost: {summary.samples_lost.split(' (')[0]}{world}")
    fig.suptitle(title, fontsize=11)
    note = ("shaded: steps redone after a recovery" if by_steps else
            "shaded: recovering (failure detected to all ranks stepping again)")
    if spans and not named:
        note += f"; {len(spans)} recoveries, too many to name (see elastic-runner report)"
    fig.text(0.01, 0.006, note, fontsize=8, color="#555555")
    fig.tight_layout(rect=(0.0, 0.025, 1.0, 1.0))
    return fig, summary


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="summarize a run and draw its timeline picture")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG file for the timeline (needs the report extra: matplotlib)")
    p.add_argument("--x", dest="x_axis", choices=["time", "steps"], default="time",
                   help="the picture's x axis: wall time (default) or optimizer steps")
    from .records_view import RECORDS_FROM_HELP

    p.add_argument("--records-from", default=None, metavar="URL", help=RECORDS_FROM_HELP)


def run(args: argparse.Namespace) -> int:
    from .records_view import run_view

    try:
        run_dir = run_view(args.run_dir, args.records_from)  # a bucket's records, fetched, for a run without a shared directory
        if args.out:
            summary = render_timeline(run_dir, args.out, x_axis=args.x_axis)
            print(summary.text())
            print(f"picture: {args.out}")
        else:
            print(summarize(run_dir).text())
    except (ValueError, RuntimeError) as exc:
        print(f"elastic-runner report: {exc}", file=sys.stderr)
        return 1
    return 0
