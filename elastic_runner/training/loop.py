"""TrainState and the training loop.

Read :meth:`Trainer.fit` top to bottom: for each step the sampler says which
samples this rank takes, the audit records them, the micro-batches run
forward/backward (the task's loss on the batch as collated) with gradient sync
only on the last one, the gradient becomes the exact mean over the global batch
(:mod:`elastic_runner.training.gradients`), the optimizer steps, and then the
between-step duties run (progress, evaluation, snapshot, stop request).
Everything that must survive a restart lives in objects with ``state_dict()``,
owned by the :class:`~elastic_runner.training.checkpointer.Checkpointer`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from ..config import Config
from ..data.sampler import StepPlan
from ..data.sources import BatchSource, shard
from ..observe.audit import AuditWriter
from ..observe.events import EventLog
from ..observe.failure_story import failure_story
from ..observe.goodput import publish_goodput
from ..observe.logs import Progress, RankZero
from ..observe.metrics import Metrics
from ..worker.dist import EMPTY, Dist
from ..worker.lifecycle import StopRequest
from ..workload.tasks import Task
from .gradients import StepGradients
from .layout import BatchLayout, split_even
from .rng import seed_step, step_seed

if TYPE_CHECKING:
    from ..worker.watchdog import PeerWatchdog
    from .checkpointer import Checkpointer

log = logging.getLogger(__name__)


class GracefulStop(Exception):
    """Raised after a stop signal was honoured: snapshot written, exit 0."""


@dataclass
class TrainState:
    """Job-level progress that is not already inside the model/optimizer/sampler."""

    step: int = 0  #: optimizer steps completed (the next step is step + 1)
    generation: int = 0  #: training attempt that produced this state
    samples_total: int = 0  #: samples consumed over all epochs, all ranks
    membership_changes: int = 0
    recoveries: int = 0
    lr_scale: float = 1.0  #: the learning-rate factor the optimizer state was built with
    world_history: list[dict[str, Any]] = field(default_factory=list)
    # The live goodput clock (elastic_runner.observe.goodput). Kept in the state, so a resume rolls it back with the
    # steps: time spent on steps that are later recomputed, or lost with a process, never counts.
    productive_s: float = 0.0  #: seconds of training that count (snapshot blocking and restarts excluded)
    closed_sessions_s: float = 0.0  #: wall time of the job's earlier sessions, each up to its last saved state
    session_started: float = 0.0  #: wall clock at which this session's first attempt began (0: not yet)
    state_time: float = 0.0  #: wall clock of this state (set when it is captured: state_dict)
    session_agents: list[str] = field(default_factory=list)  #: agents seen in this session (newest 64)

    def state_dict(self) -> dict[str, Any]:
        # The state's wall-clock time is when it is captured (a snapshot), not kept up to date every step.
        return asdict(self) | {"state_time": time.time()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)

    def enter_generation(self, generation: int, world_size: int, resumed: bool) -> None:
        previous = self.world_history[-1]["world_size"] if self.world_history else None
        if previous is not None and previous != world_size:
            self.membership_changes += 1
        if resumed:
            self.recoveries += 1
        self.generation = generation
        self.world_history.append({"generation": generation, "step": self.step, "world_size": world_size, "time": time.time()})

    def start_clock(self, now: float, agents: list[str], resumed: bool, by_hand: bool) -> bool:
        """Count this attempt into the job's wall time; True when it begins a new session. A resume is a
        recovery (its gap is lost time) unless every agent of the attempt is new to the session (every
        node was started again by hand) or, without agent names, the worker was started by hand
        (``by_hand``): then the pause between the two sessions is nobody's loss."""
        seen = set(self.session_agents)
        new_session = not resumed or not self.session_started or (
            bool(agents) and bool(seen) and seen.isdisjoint(agents)) or (not agents and by_hand)
        known = list(self.session_agents)
        if new_session:
            if resumed and self.session_started:
                self.closed_sessions_s += max(0.0, self.state_time - self.session_started)
            self.session_started, known = now, []
        self.session_agents = (known + [a for a in dict.fromkeys(agents) if a not in known])[-64:]
        self.state_time = now
        return new_session

    def goodput_wall_s(self, now: float) -> float:
        """The job's wall time so far: its earlier sessions and this one."""
        return self.closed_sessions_s + (now - self.session_started) if self.session_started else 0.0

    def goodput(self, now: float) -> float | None:
        """Productive time over the job's wall time so far (None before the clock started)."""
        wall = self.goodput_wall_s(now)
        return min(1.0, self.productive_s / wall) if wall > 0 else None


@dataclass
class Components:
    """Everything the loop drives, built by :mod:`elastic_runner.worker.attempt`."""

    cfg: Config
    dist: Dist
    model: nn.Module  #: the un-wrapped model (state_dict keys without ``module.``)
    ddp: nn.Module
    task: Task  #: the loss and the evaluation metrics
    layout: BatchLayout
    source: BatchSource
    test_source: BatchSource | None
    test_size: int
    total_steps: int
    checkpointer: Checkpointer  #: owns optimizer, schedule, scaler, sampler and TrainState; saves them
    events: EventLog
    metrics: Metrics
    audit: AuditWriter | None
    stop: StopRequest
    started_at: float  #: process start (wall clock), for the recovery duration
    resumed: bool
    watchdog: PeerWatchdog | None = None  #: told when the last collective is done
    #: Rank 0 of a resumed attempt: what it resumed from (the ``resume`` event), for the failure story.
    resume_info: dict[str, Any] | None = None


class Trainer:
    def __init__(self, c: Components) -> None:
        self.c = c
        self.cfg = c.cfg
        ckpt = c.checkpointer
        self.checkpointer = ckpt
        # The parts the checkpointer saves; the loop changes them only under ckpt.mutating().
        self.state, self.sampler, self.optimizer = ckpt.state, ckpt.sampler, ckpt.optimizer
        self.scheduler, self.scaler = ckpt.scheduler, ckpt.scaler
        self.gradients = StepGradients(c.dist, c.model, c.cfg.optim.grad_clip_norm, c.cfg.train.on_nonfinite,
                                       self.scaler)
        self.rank0 = RankZero(c.dist.rank)
        self.progress = Progress(c.total_steps, c.cfg.logging.every_steps, c.cfg.logging.format, c.cfg.logging.progress_bar)
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(c.cfg.train.precision)
        self._window_loss = torch.zeros(2, dtype=torch.float64, device=c.dist.device)
        self._window_started = time.monotonic()
        self._window_samples = 0
        self._window_first_step = self.state.step
        self._productive_mark = time.monotonic()  #: end of the time already counted as productive
        self._published_at: float | None = None  #: when local rank 0 last left the clock for its agent
        self._first_step_done = False
        self._training = False
        self.last_eval: dict[str, float] = {}

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        c, state, sampler = self.c, self.state, self.sampler
        epochs = self.cfg.train.epochs
        self._productive_mark = time.monotonic()  # start-up and restore are no training
        c.stop.training = True  # from here a stop saves a snapshot at the next step boundary
        while state.step < c.total_steps:
            if sampler.epoch_done():
                with self.checkpointer.mutating():
                    sampler.next_epoch()
                continue
            if epochs is not None and sampler.epoch >= epochs:
                break
            plans = self._plans_until_limit()
            batches = c.source.batches(self._micro_index_lists(self._plans_until_limit()), epoch=sampler.epoch)
            for plan in plans:
                self.train_step(plan, batches)
                self.after_step(plan)
        return self.finish()

    def _plans_until_limit(self) -> Iterator[StepPlan]:
        step = self.state.step
        for plan in self.sampler.plans():
            if step >= self.c.total_steps:
                return
            step += 1
            yield plan

    def _micro_index_lists(self, plans: Iterator[StepPlan]) -> Iterator[list[int]]:
        for plan in plans:
            for micro in split_even(plan.indices, self.c.layout.accumulation):
                if micro:
                    yield list(micro)

    def train_step(self, plan: StepPlan, batches: Iterator[Any]) -> None:
        c, layout, scaler, task = self.c, self.c.layout, self.scaler, self.c.task
        step = self.state.step + 1
        started = time.perf_counter()
        if c.audit is not None:
            # Before any collective: see the audit module for why this order matters.
            c.audit.step(step=step, epoch=plan.epoch, start=plan.start, global_count=plan.global_count,
                         indices=plan.indices, micro_batch=layout.micro_size, accumulation=layout.accumulation)
        seed_step(step_seed(self.cfg.run.seed, step, c.dist.rank), c.dist.device)
        if not self._training:  # (a walk over every module: only after an evaluation switched it off)
            c.ddp.train()
            self._training = True
        micro_lists = list(split_even(plan.indices, layout.accumulation))
        data_wait, weighted = 0.0, None
        step_loss = torch.zeros(2, dtype=torch.float64, device=c.dist.device)  # (weighted) loss sum, weight
        for i, micro in enumerate(micro_lists):
            sync = i == len(micro_lists) - 1
            with contextlib.nullcontext() if sync else c.ddp.no_sync():  # type: ignore[operator]
                if micro:
                    t0 = time.perf_counter()
                    batch = next(batches)
                    data_wait += time.perf_counter() - t0
                    with self._autocast():
                        losses, weights = task.compute_loss(c.ddp, batch, len(micro))
                        loss = self.gradients.loss_for_backward(losses, weights, plan.global_count, task.where)
                    weighted = weights is not None
                    w = weights.detach().double() if weights is not None else None
                    step_loss[0] += (losses.detach().double() * w).sum() if w is not None else losses.detach().double().sum()
                    step_loss[1] += w.sum() if w is not None else len(micro)
                else:
                    # No sample for this rank in this micro-step: join the gradient sync with zeros.
                    loss = c.ddp(EMPTY)
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
        apply = self.gradients.finish(step, weighted, step_loss, self.optimizer)
        self._window_loss += step_loss
        self.checkpointer.sync_buffers()
        # Everything that changes the saved state happens under the step lock, so a
        # watchdog thread that keeps a failing attempt's state sees a whole step, and a
        # step interrupted half-way is never kept.
        with self.checkpointer.mutating():
            if apply and scaler is not None:
                scaler.step(self.optimizer)
                scaler.update()
            elif apply:
                self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.sampler.advance(plan)
            self.state.step = step
            self.state.samples_total += plan.global_count
            now = time.monotonic()
            self.state.productive_s += now - self._productive_mark
            self._productive_mark = now
        if not apply:
            c.metrics.nonfinite.inc()
            self.rank0(c.events.emit, "nonfinite_skipped", step=step)
        self._window_samples += plan.global_count
        c.metrics.steps.inc()
        c.metrics.samples.inc(len(plan.indices))
        c.metrics.step_duration.observe(time.perf_counter() - started)
        c.metrics.data_wait.observe(data_wait)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.c.dist.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ between steps

    def tell_story(self, resume: dict[str, Any]) -> None:
        """One line on the terminal: what ended the previous attempt and how this one recovered."""
        try:
            story = failure_story(self.cfg.run.dir, self.state.generation, self.c.dist.world_size, resume, time.time())
        except (OSError, ValueError, KeyError, TypeError) as exc:  # the log is help, never a reason to stop
            log.debug("no failure story: %s", exc)
            return
        if story:
            # A failure is a warning; a node that joined is news.
            log.log(logging.INFO if " → training at world size " in story else logging.WARNING, "%s", story)
            self.c.events.emit("story", line=story)

    def after_step(self, plan: StepPlan) -> None:
        c, step = self.c, self.state.step
        self.checkpointer.check_writer()
        if not self._first_step_done:
            self._first_step_done = True
            since_start = time.time() - c.started_at
            if c.resumed:
                c.metrics.recovery.set(since_start)
            # "All ranks stepping" for tools: the last rank's first_step of a generation.
            c.events.emit("first_step", step=step, since_process_start_s=since_start, resumed=c.resumed)
            if c.resume_info is not None:
                self.tell_story(c.resume_info)
        last = step >= c.total_steps
        if step % self.cfg.logging.every_steps == 0 or last:
            self.report_progress(plan)
        else:
            self.rank0(self.progress.tick, step, None, None)
        every = self.cfg.train.eval_every_steps
        if every and step % every == 0 and not last:
            self.evaluate()
        before_save = time.monotonic()
        self.checkpointer.maybe_save(step, last)
        self._productive_mark += time.monotonic() - before_save  # the time a snapshot held the step is lost
        if c.stop.requested:
            c.events.emit("stop", step=step, signal=c.stop.signal_name, by_agent=c.stop.agent_reason)
            self.checkpointer.save("stop", sync=True)
            raise GracefulStop(c.stop.signal_name)

    def report_progress(self, plan: StepPlan) -> None:
        c, step = self.c, self.state.step
        loss_sum, count = c.dist.all_reduce_sum(self._window_loss.clone()).tolist()
        self._window_loss.zero_()
        window_steps = step - self._window_first_step
        self._window_first_step = step
        now = time.monotonic()
        rate = self._window_samples / max(1e-9, now - self._window_started)
        self._window_started, self._window_samples = now, 0
        loss = loss_sum / max(1.0, count)
        lr = self.optimizer.param_groups[0]["lr"]
        c.metrics.loss.set(loss)
        c.metrics.lr.set(lr)
        c.metrics.step.set(step)
        c.metrics.epoch.set(plan.epoch)
        goodput = self.state.goodput(time.time())
        if goodput is not None:
            c.metrics.goodput.set(goodput)
            if c.dist.env.local_rank == 0:
                now = time.monotonic()
                every = now - self._published_at if self._published_at is not None else None
                publish_goodput(self.state.productive_s, self.state.goodput_wall_s(time.time()), every_s=every)
                self._published_at = now
        fields = {
            "step": step, "epoch": plan.epoch, "loss": loss, "samples_per_s": round(rate, 1),
            "world_size": c.dist.world_size, "lr": lr,
        } | ({"goodput": round(goodput, 4)} if goodput is not None else {})
        if self.rank0.active:
            # window_steps: how many steps the loss averages (fewer right after a restart)
            c.events.emit("progress", window_steps=window_steps, **fields)
            self.progress.line(fields)

    def evaluate(self) -> dict[str, float]:
        """The task's metrics over the whole test set (each rank a shard, sums gathered)."""
        c = self.c
        if c.test_source is None or c.test_size == 0:
            return {}
        c.ddp.eval()
        self._training = False
        indices = list(shard(c.test_size, c.dist.rank, c.dist.world_size))
        batch = self.cfg.data.eval_batch_size
        chunks = [indices[i:i + batch] for i in range(0, len(indices), batch)]
        sums: dict[str, float] = {}
        with torch.no_grad(), self._autocast():
            for chunk, data in zip(chunks, c.test_source.batches(chunks)):
                for key, value in c.task.eval_sums(c.model, data, len(chunk)).items():
                    sums[key] = sums.get(key, 0.0) + value
        totals: dict[str, float] = {}
        samples = 0.0
        for rank_sums, count in c.dist.all_gather_object((sums, len(indices))):
            samples += count
            for key, value in rank_sums.items():
                totals[key] = totals.get(key, 0.0) + value
        metrics = c.task.finalize(totals, samples)
        result = {f"eval_{k}": v for k, v in metrics.items()} | {"eval_samples": int(samples)}
        c.metrics.set_eval(metrics)
        self.last_eval = result
        if self.rank0.active:
            c.events.emit("eval", step=self.state.step, **result)
            self.progress.line({"step": self.state.step} | {k: v for k, v in result.items() if k != "eval_samples"})
        return result

    def finish(self) -> dict[str, Any]:
        c = self.c
        self.rank0(self.progress.close)
        result: dict[str, Any] = dict(self.evaluate())
        if c.watchdog is not None:
            c.watchdog.stop(done=True)  # the last collective: peers may now exit at any time
        # Every rank records a digest of its replica: equal digests prove DDP kept them identical.
        result["params_sha256"] = state_digest(c.model)
        self.checkpointer.save("final", sync=True)
        if c.audit is not None and c.dist.rank == 0:
            c.audit.end(self.state.step)
        return result | {"step": self.state.step}


def state_digest(model: nn.Module) -> str:
    """SHA-256 over the model's state_dict (names, dtypes, shapes, bytes), device independent."""
    import hashlib

    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        sha.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        # reshape(-1): a 0-dim tensor (BatchNorm's num_batches_tracked) cannot be viewed as bytes
        sha.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return sha.hexdigest()


def planned_total_steps(cfg: Config, sampler: Any, done: int) -> int:
    """The step the run ends at, from where it stands now: ``done`` steps taken, the
    sampler's position, and the *current* global batch (with batch.per_rank_size it
    changes with the world size, so a fixed epochs * steps_per_epoch would be wrong)."""
    limits = []
    if cfg.train.max_steps is not None:
        limits.append(cfg.train.max_steps)
    if cfg.train.epochs is not None:
        if sampler.epoch >= cfg.train.epochs:
            limits.append(done)
        else:
            later_epochs = cfg.train.epochs - sampler.epoch - 1
            limits.append(done + sampler.steps_left_in_epoch() + later_epochs * sampler.steps_per_epoch())
    return max(done, min(limits)) if limits else math.inf  # type: ignore[return-value]


def refresh_schedule(scheduler: Any, cfg: Any, total_steps: int) -> None:
    """A restored built-in schedule follows the current config (e.g. a longer train.max_steps).

    LambdaLR restores its factor's fields from the snapshot; the run length and
    warm-up of *this* configuration are what the remaining steps must follow.
    """
    from ..workload.optim import ScheduleFactor

    for factor in getattr(scheduler, "lr_lambdas", []):
        if isinstance(factor, ScheduleFactor):
            factor.total_steps = max(1, total_steps)
            factor.warmup_steps = cfg.warmup_steps
            factor.step_size = cfg.step_size
            factor.gamma = cfg.gamma
            factor.min_lr_ratio = cfg.min_lr_ratio


def rescale_lr(optimizer: torch.optim.Optimizer, scheduler: Any, old: float, new: float) -> None:
    """batch.scale_lr: linear — the restored rates were scaled for the old world size."""
    if not old or old == new:
        return
    ratio = new / old
    for group in optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]
