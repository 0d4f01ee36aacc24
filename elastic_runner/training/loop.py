"""The training loop: steps until the run's end, and what happens between two steps.

Read :meth:`Trainer.fit` top to bottom. For each step the sampler says which samples this rank
takes; :meth:`Trainer.train_step` writes the audit record, runs the step's arithmetic
(:class:`~elastic_runner.training.step.TrainStep`: forward, loss, backward, gradient sync), and then,
under the Checkpointer's step lock, applies the update and advances the sampler and the
:class:`~elastic_runner.training.state.TrainState` — so a thread that keeps the state of a failing
attempt sees whole steps only. Then the between-step duties run: progress, evaluation, a snapshot
when one is due, a stop request (a snapshot, then :class:`GracefulStop`), and the agent's request to park for a
new membership (the step kept in node memory, then :class:`MembershipChange`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch
from torch import nn

from ..data.layout import split_even
from ..data.sampler import StepPlan
from ..data.sources import BatchSource
from ..observe.failure_story import failure_story
from ..observe.events import recent_events
from ..snapshot.shards import is_dtensor
from . import injected_faults
from .fingerprint import FingerprintCheck, ReplicasDiverged, RollbackImpossible, TooManyRollbacks, Verdict
from .gradients import NonFiniteGradient, NonFiniteRollback

if TYPE_CHECKING:
    from ..config import Config
    from ..observe.events import EventLog
    from ..observe.metrics import Metrics
    from ..dist import Dist
    from ..lifecycle import StopRequest
    from .bookkeeping import StepBooks
    from .checkpointer import Checkpointer
    from .evaluation import Evaluator
    from .parts import TrainingParts
    from .step import TrainStep

log = logging.getLogger(__name__)


class Watchdog(Protocol):
    """The peer watchdog as the loop sees it (:class:`elastic_runner.worker.watchdog.PeerWatchdog`): told when the
    attempt's last collective is done."""

    def stop(self, done: bool = True) -> None: ...


class ParkChannel(Protocol):
    """How the agent asks this worker to park (:class:`elastic_runner.recovery.handover.Handover`)."""

    def ready(self) -> None: ...

    def requested(self) -> bool: ...


class GracefulStop(Exception):
    """Raised after a stop signal was honoured: snapshot written (``saved``; not of a diverged state), exit 0."""

    def __init__(self, signal_name: str, saved: bool = True) -> None:
        super().__init__(signal_name)
        self.saved = saved


class MembershipChange(Exception):
    """Raised at a step boundary when the agent asked this worker to park for a new membership (a node joins or
    left; :mod:`elastic_runner.recovery.handover`): the step is kept in node memory, the process stays."""


@dataclass
class AttemptStart:
    """How this attempt began, for the recovery metric and the failure story."""

    #: This worker's start in the attempt (wall clock): its process's start, a standby's placement, or when a kept
    #: worker took its place or rebuilt its group.
    started_at: float
    resumed: bool
    #: Rank 0 of a resumed attempt: what it resumed from (the ``resume`` event).
    resume_info: dict[str, Any] | None = None


class Trainer:
    def __init__(self, cfg: Config, dist: Dist, parts: TrainingParts, step: TrainStep, books: StepBooks,
                 evaluator: Evaluator, source: BatchSource, checkpointer: Checkpointer, *, total_steps: int,
                 start: AttemptStart, stop: StopRequest, events: EventLog, metrics: Metrics,
                 watchdog: Watchdog | None, on_first_step: Callable[[], None] | None = None,
                 park: ParkChannel | None = None) -> None:
        self.cfg, self.dist, self.parts, self.step, self.books = cfg, dist, parts, step, books
        self.evaluator, self.source, self.checkpointer = evaluator, source, checkpointer
        self.total_steps, self.start, self.stop = total_steps, start, stop
        self.events, self.metrics, self.watchdog = events, metrics, watchdog
        self._first_step_done = False
        self._on_first_step = on_first_step  #: e.g. the records' upload, at once (see RecordSync.soon)
        #: The agent's requests to leave the attempt for a new membership (in-process recovery).
        self._park = park
        #: Replicas' fingerprints compared (recovery.fingerprint_every_steps): where there are replicas to compare.
        shards = dist.env.local_world_size if cfg.parallel.strategy == "hsdp" else 1  # hsdp: a node's ranks' shards
        self.fingerprints = (FingerprintCheck(cfg.recovery.fingerprint_every_steps, cfg.logging.every_steps,
                                              parts.state.step, dist.device, shards)
                             if cfg.fingerprints and dist.world_size > shards else None)
        if self.fingerprints is not None:
            checkpointer.verified_step = self.fingerprints.verified_step
        checkpointer.never_keep_diverged(step.gradients.first_nonfinite)
        #: Steps skipped by rule (:meth:`skip_step`): the config's and those that non-finite rollbacks added.
        self._skips = set(parts.state.skipped_steps) | set(cfg.train.skip_steps)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        state, sampler, epochs = self.parts.state, self.parts.sampler, self.cfg.train.epochs
        self.books.start_training()
        self.stop.training = True  # from here a stop saves a snapshot at the next step boundary
        if self._park is not None:
            self._park.ready()  # and the agent may ask this worker to park at one
        while state.step < self.total_steps:
            if sampler.epoch_done():
                with self.checkpointer.mutating():
                    sampler.next_epoch()
                continue
            if epochs is not None and sampler.epoch >= epochs:
                break
            batches = self.source.batches(self._micro_index_lists(self._plans_until_limit()), epoch=sampler.epoch)
            for plan in self._plans_until_limit():
                self.train_step(plan, batches)
                self.after_step(plan)
        return self.finish()

    def _plans_until_limit(self) -> Iterator[StepPlan]:
        step = self.parts.state.step
        for plan in self.parts.sampler.plans():
            if step >= self.total_steps:
                return
            step += 1
            yield plan

    def _micro_index_lists(self, plans: Iterator[StepPlan]) -> Iterator[list[int]]:
        for plan in plans:
            for micro in split_even(plan.indices, self.step.layout.accumulation):
                if micro:
                    yield list(micro)

    def train_step(self, plan: StepPlan, batches: Iterator[Any]) -> None:
        parts, step = self.parts, self.parts.state.step + 1
        if step in self._skips:
            self.skip_step(step, plan, batches)
            return
        injected = injected_faults.REQUEST  # None but in a job the chaos tool started
        if injected is not None and injected.take_nan():
            self.step.poisoned = True
            self.events.emit("chaos_nan", step=step, interval_steps=self.cfg.logging.every_steps)
        if injected is not None and injected.slowed_by != self.step.slowed_by:
            self.step.slowed_by = injected.slowed_by
            self.events.emit("chaos_slowed", step=step, factor=injected.slowed_by)
        self.books.before(step, plan)  # the audit record: before any collective
        result = self.step.compute(step, plan, batches)
        self.checkpointer.sync_buffers()  # a collective: outside the lock, a lost peer may break it
        with self.checkpointer.mutating():  # the saved state changes here, and only here
            self.step.update(result)
            parts.sampler.advance(plan)
            parts.state.step = step
            parts.state.samples_total += plan.global_count
            self.books.count_productive()
        self.books.after(step, plan, result)

    # ------------------------------------------------------------------ between steps

    def skip_step(self, step: int, plan: StepPlan, batches: Iterator[Any]) -> None:
        """A step skipped by rule (train.skip_steps, or a non-finite rollback's): its batch is consumed and recorded
        as skipped in the audit trail, nothing is computed and no update made; the learning-rate schedule advances,
        so the steps after it are those of the run without the rule, less one update."""
        parts = self.parts
        self.books.before(step, plan, skipped=True)
        result = self.step.skip(plan, batches)
        with self.checkpointer.mutating():
            self.step.update(result)
            parts.sampler.advance(plan)
            parts.state.step = step
            parts.state.samples_total += plan.global_count
        if self.dist.rank == 0:
            self.events.emit("step_skipped", step=step, epoch=plan.epoch, samples=plan.global_count)
            log.warning("step %d skipped by rule (train.skip_steps%s): its %d samples are consumed, not trained on",
                        step, ", added by a non-finite rollback" if step not in self.cfg.train.skip_steps else "",
                        plan.global_count)

    def after_step(self, plan: StepPlan) -> None:
        """Between two steps: what reads the device happens here, and only at its steps (a logging step, a capture),
        so that a step that neither logs nor captures never makes the host wait for a GPU (tests/sync_probe.py)."""
        step = self.parts.state.step
        gradients = self.step.gradients
        self.checkpointer.check_writer()
        injected = injected_faults.REQUEST  # None but in a job the chaos tool started
        if injected is not None and injected.requested:
            self.events.emit("chaos_corrupted", step=step, **injected.corrupt(self.parts.model),
                             interval_steps=self.fingerprints.every if self.fingerprints is not None else 0)
        if not self._first_step_done:
            self._first_step_done = True
            self._first_step(step)
        last = step >= self.total_steps
        if step % self.cfg.logging.every_steps == 0 or last:
            try:
                gradients.check()  # the same steps on every rank: a diverged run stops here, naming its step
            except NonFiniteGradient as exc:
                if gradients.on_nonfinite != "rollback":
                    raise
                self.roll_back_nonfinite(exc)
            if gradients.on_nonfinite == "skip":
                self.books.skipped_on_device(step, gradients.newly_skipped())
            self.report_progress(step, plan.epoch, last)
        else:
            self.books.tick(step)
        every = self.cfg.train.eval_every_steps
        if every and step % every == 0 and not last:
            self.evaluate()
        due = self.checkpointer.capture_due(step, last)
        if any(due) and gradients.diverged():
            due = (False, False)  # never a snapshot of a diverged state: the next logging step stops the run
        before_save = time.monotonic()
        self.checkpointer.maybe_save(step, last, due)
        self.books.not_productive(time.monotonic() - before_save)
        if self.stop.requested:
            diverged = gradients.diverged()
            if diverged and gradients.on_nonfinite != "rollback":
                gradients.stop_here()
            self.events.emit("stop", step=step, signal=self.stop.signal_name, by_agent=self.stop.agent_reason,
                             **({"not_saved": "the gradient was not finite since the last logging step"}
                                if diverged else {}))
            if not diverged:  # (rollback: a diverged state is never saved; a resume meets the step again and rolls back)
                self.checkpointer.save("stop", sync=True)
            raise GracefulStop(self.stop.signal_name, saved=not diverged)
        if self._park is not None and self._park.requested():
            if gradients.diverged() and gradients.on_nonfinite != "rollback":  # (rollback: the keeper refuses it)
                gradients.stop_here()
            self.events.emit("park", step=step)
            # As a failure would keep it (where it is stored already, or there is no memory tier, the next attempt
            # resumes from where it is): the next attempt's resume agrees on the newest step every rank can have.
            self.checkpointer.keep("membership change")
            raise MembershipChange(f"the agent asked for a new membership at step {step}")

    def report_progress(self, step: int, epoch: int, last: bool) -> None:
        """The progress line; at a fingerprint check's step, every rank's fingerprint rides along and a mismatch
        rolls the job back (:meth:`roll_back`)."""
        check, mine = self.fingerprints, None
        if check is not None and check.due(step, last):
            value = check.compute(self.parts.model, self.parts.optimizer)
            mine = check.slots(value, self.dist.env.group_rank, self.books.pace_s(step))
        theirs = self.books.report_progress(step, epoch, self.parts.optimizer.param_groups[0]["lr"],
                                            local=self.step.clock.take(), mine=mine)
        if check is None or mine is None:
            return
        interval = check.every  # the one in force until this check (auto may choose another from its cost)
        verdict = check.judge(step, theirs)
        self.metrics.fingerprint_checks.inc()
        self.metrics.fingerprint_interval.set(check.every)
        if not verdict.agreed:
            self.roll_back(verdict, check.verified_step, interval)
        self.checkpointer.verified_step = check.verified_step
        self.metrics.verified_step.set(check.verified_step)

    def roll_back(self, verdict: Verdict, verified: int, interval: int) -> None:
        """Replicas differ at ``verdict.step``: the states no check vouched for (after ``verified``) are taken out
        of every resume, and every rank leaves the attempt (:class:`ReplicasDiverged`: restarted, resuming from the
        newest vouched-for state), or stops the job if rollbacks keep coming (:class:`TooManyRollbacks`)."""
        step, rank, recovery = verdict.step, self.dist.rank, self.cfg.recovery
        replicas = self.dist.world_size // (self.fingerprints.shards if self.fingerprints is not None else 1)
        who = ("no majority says which replica is wrong (" + ("two replicas" if replicas == 2 else
                                                              "no value held by most ranks") + "): all are suspect"
               if verdict.undecided else
               ", ".join(f"rank {r} (node {n})" for r, n in zip(verdict.suspects, verdict.nodes)) +
               (" holds" if len(verdict.suspects) == 1 else " hold") + " a state that differs from the other ranks'")
        reason = f"taken after step {verified}, the last whose replicas' fingerprints agreed; at step {step} {who}"
        # First, on every rank and before anything waits for a peer: no thread keeps this state from here (a watchdog
        # that sees a peer leave first, a failure below), and no snapshot after the agreeing check stays to be resumed
        # from — the next fault may take rank 0's node, the suspect's, or both, in the middle of what follows.
        early = self.checkpointer.set_aside_after(verified, reason)
        found = {"step": step, "verified_step": verified, "suspects": verdict.suspects, "nodes": verdict.nodes,
                 "copies": replicas, "interval_steps": interval}
        # Found, by every rank (a suspect's own event carries its host): the record survives whoever is lost next.
        self.events.emit("replica_mismatch", **found, status="found", moved_aside=early)
        earlier = self._rollbacks_since(time.time() - recovery.rollback_window_seconds) if rank == 0 else 0
        earlier = int(self.dist.broadcast_object(earlier))  # before the slow part: every rank decides alike
        stop = earlier >= recovery.max_rollbacks
        moved, stuck = self.checkpointer.discard_after(verified, reason)
        status = "stopped" if stop or stuck else "rolled_back"
        if rank == 0:
            self.events.emit("replica_mismatch", **found, status=status, moved_aside=sorted(set(moved) | set(early)),
                             not_moved=stuck, rollbacks_before=earlier)
        line = (f"step {step}: the replicas' fingerprints differ: {who} (silent corruption: a flipped bit or a "
                f"miscomputing device); the snapshots after step {verified}, the last whose fingerprints agreed, "
                f"are moved aside" + (f" ({', '.join(moved)})" if moved else "") + " and removed from node memory; ")
        if stuck:
            raise RollbackImpossible(
                line + f"but {', '.join(stuck)} could not be moved aside in {self.checkpointer.store.location}, and a "
                "restart would resume from it: stopping (exit status 3, not restarted); move it aside (or delete "
                "it) and start the job again")
        if stop:
            raise TooManyRollbacks(
                line + f"stopping (exit status 3, not restarted): {earlier} rollbacks in the last "
                f"{recovery.rollback_window_seconds:.0f} s already (recovery.max_rollbacks: {recovery.max_rollbacks}); "
                "take the suspect node out and start the job again (it resumes from the newest state a check "
                "vouched for)")
        raise ReplicasDiverged(line + "rolling back: every worker restarts from the newest state a check vouched "
                                      "for")

    def roll_back_nonfinite(self, exc: NonFiniteGradient) -> None:
        """``train.on_nonfinite: rollback``: the gradient of ``exc.step`` was not finite (every rank read it at this
        logging step). No state after the step before it is kept or resumed (no snapshot was taken of one: a capture
        skips a diverged state), and every rank leaves the attempt (:class:`NonFiniteRollback`): its process runs the
        next one from the newest snapshot with the step skipped; or, if rollbacks keep coming, the job stops
        (:class:`TooManyRollbacks`)."""
        step, recovery = exc.step, self.cfg.recovery
        # Rank 0 waits for its snapshot writer here while every rank's watchdog still beats (after the broadcast its
        # peers leave the attempt: a long wait then would look like rank 0's death to its own watchdog).
        moved, stuck = self.checkpointer.discard_after(step - 1, f"taken after step {step - 1}: the gradient of step "
                                                                 f"{step} was not finite")
        earlier = self._rollbacks_since(time.time() - recovery.rollback_window_seconds) if self.dist.rank == 0 else 0
        earlier, moved, stuck = self.dist.broadcast_object([earlier, moved, stuck])  # every rank decides alike
        who = (f"the loss of rank {', '.join(map(str, exc.ranks))} was {exc.value}" if exc.ranks
               else "the gradient overflowed")
        status = "stopped" if stuck or earlier >= recovery.max_rollbacks else "rolled_back"
        if self.dist.rank == 0:
            self.events.emit("nonfinite_rollback", step=step, ranks=exc.ranks, value=str(exc.value), status=status,
                             rollbacks_before=earlier, moved_aside=moved, not_moved=stuck)
        line = f"step {step}: {who} (train.on_nonfinite: rollback); "
        if stuck:
            raise RollbackImpossible(line + f"{', '.join(stuck)} in {self.checkpointer.store.location} holds a state "
                                     "after it and could not be moved aside: stopping (exit status 3, not restarted)")
        if status == "stopped":
            raise TooManyRollbacks(
                line + f"stopping (exit status 3, not restarted): {earlier} rollbacks in the last "
                f"{recovery.rollback_window_seconds:.0f} s already (recovery.max_rollbacks: {recovery.max_rollbacks}); "
                "the run diverges whatever batch it skips: resume with a lower optim.lr or optim.grad_clip_norm")
        raise NonFiniteRollback(step, exc.ranks, line + f"rolling back: every worker resumes, in its process, from "
                                                        f"the newest snapshot and skips step {step}'s batch")

    def _rollbacks_since(self, since: float) -> int:
        try:  # rank 0 records each rollback once: only its files written to in the window are read
            events = recent_events(self.cfg.run.dir, since, sources="gen-*-rank-00000")
        except OSError:
            return 0
        kinds = ("replica_mismatch", "nonfinite_rollback")
        return sum(1 for e in events if e["kind"] in kinds and e.get("status") == "rolled_back" and e.get("rank") == 0)

    def _first_step(self, step: int) -> None:
        since_start = time.time() - self.start.started_at
        if self.start.resumed:
            self.metrics.recovery.set(since_start)
        # "All ranks stepping" for tools: the last rank's first_step of a generation.
        self.events.emit("first_step", step=step, since_process_start_s=since_start, resumed=self.start.resumed)
        if self._on_first_step is not None:
            self._on_first_step()
        if self.start.resume_info is not None:
            self.tell_story(self.start.resume_info)

    def tell_story(self, resume: dict[str, Any]) -> None:
        """One line on the terminal: what ended the previous attempt and how this one recovered."""
        try:
            story = failure_story(self.cfg.run.dir, self.parts.state.generation, self.dist.world_size, resume,
                                  time.time())
        except (OSError, ValueError, KeyError, TypeError) as exc:  # the log is help, never a reason to stop
            log.debug("no failure story: %s", exc)
            return
        if story:
            # A failure is a warning; a node that joined is news.
            log.log(logging.INFO if " → training at world size " in story else logging.WARNING, "%s", story)
            self.events.emit("story", line=story)

    def evaluate(self) -> dict[str, float]:
        result = self.evaluator.evaluate(self.step.autocast)
        if result:
            self.step.evaluating()
            self.books.report_eval(self.parts.state.step, result)
        return result

    def finish(self) -> dict[str, Any]:
        self.books.close()
        result: dict[str, Any] = dict(self.evaluate())
        if self.watchdog is not None:
            self.watchdog.stop(done=True)  # the last collective: peers may now exit at any time
        # Every rank records a digest of its replica (equal digests prove the replicas stayed identical), or of
        # its shards under fsdp/hsdp (a run ends as another when every rank's digest is the same).
        result["params_sha256"] = state_digest(self.parts.model)
        self.checkpointer.save("final", sync=True)
        if self.books.audit is not None and self.dist.rank == 0:
            self.books.audit.end(self.parts.state.step)
        return result | {"step": self.parts.state.step}


def state_digest(model: nn.Module) -> str:
    """SHA-256 over the model's state_dict (names, dtypes, shapes, bytes), device independent; of a sharded
    tensor, this rank's slice (with the whole tensor's shape)."""
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        t = local.detach().to("cpu").contiguous()
        sha.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        # reshape(-1): a 0-dim tensor (BatchNorm's num_batches_tracked) cannot be viewed as bytes
        sha.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return sha.hexdigest()
