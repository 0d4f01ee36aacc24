"""What is recorded about each step, apart from its arithmetic: audit, metrics, goodput clock, progress.

:class:`StepBooks` hangs off the step: :meth:`~StepBooks.before` writes the audit record (before any
collective: see :mod:`elastic_runner.observe.audit` for why the order matters),
:meth:`~StepBooks.count_productive` moves the goodput clock inside the step lock (the clock is part
of the saved state and rolls back with it), :meth:`~StepBooks.after` observes the metrics, and
:meth:`~StepBooks.report_progress` writes the progress line every ``logging.every_steps``. Only rank 0
writes progress lines and events that speak for the whole job.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..observe.goodput import publish_goodput
from ..observe.logs import Progress
from ..env import ask_to_exclude_this_node
from ..observe.stragglers import Straggler, StragglerWatch
from .step_clock import Timed

if TYPE_CHECKING:
    from ..config import Config
    from ..data.layout import BatchLayout
    from ..data.sampler import StepPlan
    from ..observe.audit import AuditWriter
    from ..observe.events import EventLog
    from ..observe.metrics import Metrics
    from ..dist import Dist
    from .state import TrainState
    from .step import StepResult

log = logging.getLogger(__name__)


class StepBooks:
    def __init__(self, cfg: Config, dist: Dist, state: TrainState, layout: BatchLayout, total_steps: int, *,
                 events: EventLog, metrics: Metrics, audit: AuditWriter | None,
                 tokens_per_sample: int | None = None) -> None:
        self.cfg, self.dist, self.state, self.layout = cfg, dist, state, layout
        self.events, self.metrics, self.audit = events, metrics, audit
        self.rank0 = dist.rank == 0
        self.total_steps = total_steps
        self.tokens_per_sample = tokens_per_sample  #: a language model's window: its rate is told in tokens/s
        # The terminal shows one bar, rank 0's.
        self.progress = Progress(total_steps, state.step, cfg.logging.every_steps, cfg.logging.format,
                                 cfg.logging.progress_bar if self.rank0 else "off")
        self._window_loss = torch.zeros(2, dtype=torch.float64, device=dist.device)
        self._window_started = time.monotonic()
        self._window_samples = 0
        self._window_first_step = state.step
        self._productive_mark = time.monotonic()  #: end of the time already counted as productive
        self._published_at: float | None = None  #: when local rank 0 last left the clock for its agent
        self._step_started = 0.0
        self._evicting = False  #: a node was taken out in this attempt (recovery.evict_stragglers): no other one
        # Where a slow rank is told from a waiting one (the wait for the gradient sync is timed apart): ordered ddp.
        names = cfg.parallel.strategy == "ddp" and cfg.dist.gradient_sync == "ordered"
        self.stragglers = StragglerWatch(cfg.recovery.straggler_ratio if names else None,
                                         cfg.recovery.straggler_window_seconds)

    # -- around each step ----------------------------------------------------------------------------------

    def start_training(self) -> None:
        """Start-up and restore are not training: the productive clock starts here."""
        self._productive_mark = time.monotonic()

    def before(self, step: int, plan: StepPlan, skipped: bool = False) -> None:
        self._step_started = time.perf_counter()
        if self.audit is not None:
            self.audit.step(step=step, epoch=plan.epoch, start=plan.start, global_count=plan.global_count,
                            indices=plan.indices, micro_batch=self.layout.micro_size,
                            accumulation=self.layout.accumulation, segments=plan.segments, skipped=skipped)

    def count_productive(self) -> None:
        """The time since the last mark was training (called under the step lock, with the step's commit)."""
        now = time.monotonic()
        self.state.productive_s += now - self._productive_mark
        self._productive_mark = now

    def not_productive(self, seconds: float) -> None:
        """Time that held the step without training (a snapshot's blocking copy) is lost time."""
        self._productive_mark += seconds

    def after(self, step: int, plan: StepPlan, result: StepResult) -> None:
        m = self.metrics
        self._window_loss += result.loss
        self._window_samples += plan.global_count
        if not result.apply:
            m.nonfinite.inc()
            if self.rank0:
                self.events.emit("nonfinite_skipped", step=step)
        m.steps.inc()
        m.samples.inc(len(plan.indices))
        m.step_duration.observe(time.perf_counter() - self._step_started)
        m.data_wait.observe(result.data_wait_s)

    def skipped_on_device(self, step: int, count: int) -> None:
        """Steps an optimizer skipped on the device (a non-finite gradient, ``train.on_nonfinite: skip``) since the
        last logging step: counted there, not at each step (that would wait for the device)."""
        if count:
            self.metrics.nonfinite.inc(count)
            if self.rank0:
                self.events.emit("nonfinite_skipped", step=step, count=count, on_device=True)

    # -- between steps ---------------------------------------------------------------------------------------

    def tick(self, step: int) -> None:
        if self.rank0:
            self.progress.tick(step)

    def note(self, text: str) -> None:
        """A line for the terminal (rank 0's): above the progress bar while one shows."""
        if self.rank0:
            self.progress.note(text)

    def pace_s(self, step: int) -> float:
        """This rank's wall time per step in the current logging window so far (0 before its first step)."""
        steps = step - self._window_first_step
        return (time.monotonic() - self._window_started) / steps if steps > 0 else 0.0

    def report_progress(self, step: int, epoch: int, lr: float, local: Timed = Timed(0.0, 0, 0.0),
                        mine: torch.Tensor | None = None) -> list[float]:
        """The loss over the window since the last report (a collective), the rate, goodput: a progress line;
        ``local``: this rank's steps timed in the window (:class:`~.step_clock.StepClock`);
        ``mine``: floats of this rank's (on its device; every rank passes as many at the same step) that every rank
        learns — returned: every rank's, rank by rank (empty without ``mine``)."""
        m, state = self.metrics, self.state
        world, rank = self.dist.world_size, self.dist.rank
        timed = self.cfg.recovery.straggler_ratio is not None
        # Each rank's local time in its own slots of the sum that adds the loss up: every rank learns every rank's
        # (adding zeros is exact), with no collective of its own.
        now = time.monotonic()
        window_s = max(1e-9, now - self._window_started)
        timing = torch.zeros(4 * world if timed else 0, dtype=torch.float64)
        if timed:
            timing[4 * rank:4 * rank + 4] = torch.tensor(
                [local.local_s, local.steps, self.dist.env.group_rank, local.stepped_s], dtype=torch.float64)
        parts = [self._window_loss, timing.to(self._window_loss.device)]
        if mine is not None:
            blocks = torch.zeros(mine.numel() * world, dtype=torch.float64, device=self._window_loss.device)
            blocks[mine.numel() * rank:mine.numel() * (rank + 1)] = mine
            parts.append(blocks)
        summed = self.dist.all_reduce_sum(torch.cat(parts)).tolist()
        theirs = summed[2 + timing.numel():]
        loss_sum, count = summed[:2]
        self._window_loss.zero_()
        # The window's length for the stragglers: the longest rank's time in steps (the same on every rank, as
        # every decision must be). Not the window's wall time: a restart's first window holds the restore and the
        # rendezvous, and counted as seconds of a fresh process's slow first steps it named ranks that were slow for
        # a fraction of a second (seen in a soak with a 3 s window).
        timings: dict[str, Any] = {}
        if timed:
            times = summed[2:2 + timing.numel()]
            stepped_s = max(times[3::4])
            self._note_stragglers(step, times[0::4], times[1::4], times[2::4], stepped_s)
            # In rank 0's event, not on the terminal: how near each rank came to being named, window by window (a
            # slow node not named in a soak could not be told from the events alone).
            newest = self.stragglers.newest
            if self.rank0 and any(newest):
                timings = {"stepped_s": round(stepped_s, 3),
                           "local_ratios": [round(n[0], 3) if n else None for n in newest],
                           "slow_s": [round(n[1], 2) if n else None for n in newest]}
        window_steps = step - self._window_first_step
        self._window_first_step = step
        rate = self._window_samples / window_s
        self._window_started, self._window_samples = now, 0
        # To the end of training at this window's pace (a restart's first window is short: its pace is the job's).
        eta = (self.total_steps - step) * window_s / window_steps if window_steps > 0 else None
        # A window of steps skipped by rule trained on nothing: it has no loss (0.0 would read as a perfect model).
        loss = loss_sum / count if count > 0 else None
        if loss is not None:
            m.loss.set(loss)
        m.lr.set(lr)
        m.step.set(step)
        m.epoch.set(epoch)
        goodput = state.goodput(time.time())
        if goodput is not None:
            m.goodput.set(goodput)
            if self.dist.env.local_rank == 0:
                every = now - self._published_at if self._published_at is not None else None
                publish_goodput(state.productive_s, state.goodput_wall_s(time.time()), every_s=every)
                self._published_at = now
        fields = {"step": step, "epoch": epoch} | ({"loss": loss} if loss is not None else {"trained": False}) | {
            "samples_per_s": round(rate, 1),
        } | ({"tokens_per_s": round(rate * self.tokens_per_sample)} if self.tokens_per_sample else {}) | {
            "world_size": self.dist.world_size, "lr": lr,
        } | ({"goodput": round(goodput, 4)} if goodput is not None else {}) | (
            {"eta_s": round(eta, 1)} if eta is not None else {})
        if self.rank0:
            # window_steps: how many steps the loss averages (fewer right after a restart)
            self.events.emit("progress", window_steps=window_steps, total_steps=self.total_steps, **fields, **timings)
            self.progress.report(fields)
        return theirs

    def _note_stragglers(self, step: int, local_s: Sequence[float], steps: Sequence[float],
                         nodes: Sequence[float], window_s: float) -> None:
        """Metrics of this rank's local time; a straggler named or cleared: rank 0 says so for the job, the rank
        itself records it (its event carries its host)."""
        watch, rank = self.stragglers, self.dist.rank
        named, cleared = watch.observe(local_s, steps, nodes, window_s)
        if steps[rank] > 0:
            self.metrics.step_local.set(local_s[rank] / steps[rank])
        if rank in watch.ratios:
            self.metrics.step_local_ratio.set(watch.ratios[rank])
        self.metrics.straggler.set(1 if rank in watch.named else 0)
        for found, status in [(s, "named") for s in named] + [(s, "cleared") for s in cleared]:
            if self.rank0:
                line = _straggler_line(found, status, len(local_s), watch.window_s)
                log.log(logging.WARNING if status == "named" else logging.INFO, "%s", line)
                self.events.emit("story", line=line)
            if found.rank == rank:
                self.events.emit("straggler", step=step, rank=rank, node=found.node, ratio=round(found.ratio, 3),
                                 local_s=found.local_s, median_s=found.median_s, steps=found.steps,
                                 seconds=round(found.seconds, 1), window_s=watch.window_s, status=status)
        if named:
            # One node at a time, the slowest: every rank picks the same one at the same step, so two nodes named
            # together never both leave (each agent checks --nnodes' minimum against the world it knows).
            self._evict(max(named, key=lambda s: (s.ratio, -s.rank)), len(local_s), watch.window_s)

    def _evict(self, found: Straggler, world: int, window_s: float) -> None:
        """``recovery.evict_stragglers``: the first worker of the straggler's node asks its agent to take the node
        out (every rank decides the same at the same step: the others go on, and park for the round without it).
        Once per attempt: the next node is judged in the world without this one."""
        env = self.dist.env
        if not self.cfg.recovery.evict_stragglers or self._evicting:
            return
        self._evicting = True  # (on every rank: none asks for another node in this attempt)
        if found.node != env.group_rank or env.local_rank != 0:
            return
        line = _straggler_line(found, "named", world, window_s)
        if ask_to_exclude_this_node(line, self.cfg.recovery.exclusion_seconds):
            log.warning("rank %d: this node is a straggler; its agent is asked to take it out of the job for %gs "
                        "(recovery.evict_stragglers)", env.rank, self.cfg.recovery.exclusion_seconds)
        else:
            log.warning("rank %d: this node is a straggler, but no elastic_runner agent runs it: it stays "
                        "(recovery.evict_stragglers needs elastic-runner launch or torchrun with our agent)", env.rank)

    def report_eval(self, step: int, result: dict[str, Any]) -> None:
        if self.rank0:
            self.events.emit("eval", step=step, **result)
            self.progress.line({"step": step} | {k: v for k, v in result.items() if k != "eval_samples"})

    def close(self) -> None:
        if self.rank0:
            self.progress.close()


def _straggler_line(found: Straggler, status: str, world: int, window_s: float) -> str:
    where = f"rank {found.rank} (node {found.node})"
    times = f"{found.local_s * 1000:.1f} ms a step against the median rank's {found.median_s * 1000:.1f} ms"
    if status == "cleared":
        return (f"{where} is no straggler any more: slow for {found.seconds:.0f} s of the last {window_s:g} s, "
                f"{times} in the last logging window")
    others = "the other rank waits" if world == 2 else f"the other {world - 1} ranks wait"
    return (f"{where} is a straggler: its own work (batches, forward, backward, update) has taken at least the "
            f"straggler ratio times the median rank's for {found.seconds:.0f} s of the last {window_s:g} s "
            f"({found.steps} steps), {found.ratio:.2f}x in the last logging window ({times}); {others} for it "
            "every step (its host is in its straggler event and on its metrics endpoint, elastic_runner_straggler)")
