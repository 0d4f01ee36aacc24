"""``ElasticRunnerAgent``: torch's ``LocalElasticAgent`` with these corrections, and observers.

- **Stopped workers are killed, not waited for.** Stopping a worker group sends SIGTERM and waits up to the shutdown
  timeout (30 s) before SIGKILL; a worker in the stopped state (SIGSTOP, a debugger, a wedged cgroup) cannot handle
  SIGTERM, so that wait is pure loss: it is SIGKILLed at once.
- **Configuration errors are not retried.** A worker that exits with status 2
  (:data:`elastic_runner.lifecycle.EXIT_USAGE`: invalid config, incompatible snapshot) or 3 (the gradient
  became NaN or inf) would fail identically on every restart; the agent stops instead of burning its restarts.
- **A stop signal is never lost** (:mod:`.stop_signal`): one that torch's handler raised inside some ``except
  Exception`` stops the agent at its next look.
- **A round a member never starts in is left, not fatal, and not waited out.** A node that dies right
  after a round is sealed (a SIGKILL between the seal and its workers' rank assignment) never writes
  its part of the round's store; torch's agent waits ``read_timeout`` (60 s) for it and then raises,
  and every other agent of the round with it: the whole job ended (seen in a 1,000-fault soak). The
  agent joins the next round instead, which forms without the dead node, and it stops waiting as
  soon as the rendezvous counts that node dead (:mod:`elastic_runner.agent.round_members`).
- **A member gone is a membership change.** Workers whose peer died while they wait for it outside a
  collective (in the process group's start, for a node killed right after it was seated) waited for
  ``dist.init_timeout_seconds`` (30 s); the agent restarts them for the next round as soon as the
  rendezvous counts the member dead (:class:`~elastic_runner.agent.round_members.MemberWatch`).
- **No lazy imports on the recovery path.** torch's log formatter imports ``torch._dynamo`` (~2.5 s) the first time
  it formats an exception, and torch logs one exactly when a worker fails; that record goes to our DEBUG log
  unformatted (:mod:`elastic_runner.agent.terminal`), so the import never happens there.

- **A failed worker is replaced alone** (``recovery.in_process``, :mod:`elastic_runner.agent.worker_context`; who
  is replaced and when every worker restarts instead is the recovery policy's: :mod:`elastic_runner.recovery.policy`):
  torch's process context ends every worker of the node when one fails, and torch's agent then restarts every
  worker of the job through a new rendezvous round. With in-process recovery a worker killed or crashed (not rank
  0's, whose process hosts the job's store, and not one that exited with a job-ending status or because its
  peers were lost) is started again alone, in the same context, with the same rank: no rendezvous round, the
  other agents uninvolved, the other workers kept (they rebuild their process group with it:
  :mod:`elastic_runner.recovery.regroup`). Each replacement counts as a restart against ``--max-restarts``.
  With ``recovery.standby`` the node keeps a standby worker which has built the workload ahead and takes the failed
  worker's place instead of a new process (:mod:`elastic_runner.worker.standby`; when it starts, and how often again:
  :mod:`.standby_schedule`).
- **A new round keeps the workers** (``recovery.in_process``, :mod:`elastic_runner.agent.kept_round`): for a node
  that joins or is lost, or a restart of another node's workers, the running workers park at a step boundary and
  are handed their places in the new round instead of being stopped and started again; workers that park on their
  own (their peer lost, no replacement announced) make the agent start that round.

Observers (agent metrics and events, :mod:`elastic_runner.agent.metrics`) hear of every
rendezvous round, failed worker group and restart. The private methods overridden here are
checked by :data:`elastic_runner.torch_patches.AGENT_CORRECTIONS`; ``elastic-runner launch``
uses torch's agent unchanged when they no longer fit.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException

from ..env import REPLACES_VAR, announce_stopping
from ..lifecycle import EXIT_DIVERGED, EXIT_NOT_DURABLE, EXIT_USAGE, proc_state, process_start_time
from ..recovery.liveness import offer as offer_liveness
from ..recovery.policy import Action, Decision, after_worker_failure, for_new_round
from ..recovery.regroup import announce_replacements
from ..snapshot import SnapshotError
from ..snapshot.format import signing_key_from_environment
from . import fast_rendezvous, kept_round, stop_signal
from .beat import AgentBeat
from .config_check import ConfigRecord, refuse_if_config_differs
from .exclusion import leave_if_asked, refuse_if_excluded
from .finish import failed_after_finishing, wait_at_exit
from .round_members import MemberWatch, WatchfulStore, gone_check
from .spare import SpareWait, WarmSeat
from .standby_schedule import StandbySchedule
from ..torch_patches import KEEPING_WORKERS, usable
from .worker_context import KeepingContext, as_keeping

log = logging.getLogger(__name__)

#: Rounds in a row a node leaves because a member never started in them, before torch's error ends it.
ROUND_RETRIES = 5

_PROCESS_START = process_start_time()


class ElasticRunnerAgent(LocalElasticAgent):
    #: Callables ``(event, **fields)`` given to every new agent (torch's launcher
    #: constructs the agent itself; see elastic_runner.agent.metrics).
    default_observers: list[Any] = []
    #: The workers' ``recovery.in_process`` (set from their config where the agent can read it): a failed worker
    #: is replaced alone, the others kept.
    in_process: bool = False
    #: The workers' ``recovery.standby``: with ``in_process``, the node keeps a standby worker that takes a failed
    #: worker's place (:mod:`elastic_runner.worker.standby`).
    standby: bool = False
    #: This node's configuration as the running job's is compared with (:mod:`.config_check`; None: nothing to compare).
    config_digest: dict[str, str] | None = None
    liveness: Any = None  #: its liveness port (recovery.liveness; None: none), named in its node key while it joins

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.observers: list[Any] = list(type(self).default_observers)
        self._restart_reason = "a new rendezvous round"
        self._rounds = 0
        self._stopping_group = False
        self._members = MemberWatch()
        self._keeping: KeepingContext | None = None
        self._standbys = StandbySchedule(self._notify)
        #: The hand-over to each local worker (in-process recovery across rounds: :mod:`.kept_round`), where offered.
        self._places: list[Any] | None = None
        self._handing_over = False
        #: The job's key (``auth_key_file``), which signs what this agent tells the workers in the job's store.
        try:
            self._job_key = signing_key_from_environment()
        except SnapshotError as exc:  # the workers meet it too, and exit 2 with its line (the job stops there)
            log.debug("the job's key cannot be read here: %s", exc)
            self._job_key = None
        self._beat = AgentBeat(key=self._job_key)  #: its heartbeat, while its workers are kept across failures
        self._warm_seat = WarmSeat(wanted=type(self).in_process and type(self).standby)  #: a spare's workers, ahead
        self._config_record = ConfigRecord(self._job_key, type(self).config_digest)
        offer_liveness(self._worker_group.spec.rdzv_handler, type(self).liveness, self._job_key)

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        # An excluded node (recovery.evict_stragglers) leaves before its first round, not after it cost the others one.
        refuse_if_excluded(self._worker_group.spec.rdzv_handler, self._job_key)  # (and one of another config: exit 2)
        refuse_if_config_differs(self._worker_group.spec.rdzv_handler, self._job_key, type(self).config_digest)
        try:
            return super().run(role)
        except Exception as exc:
            # An agent told to stop whose stopping failed somewhere (a store request cut short by the signal, the
            # rendezvous host gone first) is stopped all the same: the launcher must not close the rendezvous.
            stop = exc if isinstance(exc, SignalException) else stop_signal.behind(exc) or stop_signal.as_exception()
            if stop is None:
                raise
            # Stopped by a signal (preempted, drained): torch has stopped this node's workers. Leave the rendezvous
            # now, where it can say so (etcd-v3's lease protocol), so that the others' next round does not wait the
            # dead-node window for this node.
            leave = getattr(self._worker_group.spec.rdzv_handler, "leave", None)
            if callable(leave) and not self._live_worker_pids():  # (its workers still running: the window, as before)
                try:
                    leave()
                except Exception:  # noqa: BLE001 - its lease expires in the window, as before
                    log.debug("could not leave the rendezvous", exc_info=True)
            if stop is exc:
                raise
            raise stop from exc

    def _notify(self, event: str, **fields: Any) -> None:
        for observer in self.observers:
            try:
                observer(event, **fields)
            except SignalException:
                raise  # a stop signal that reached the agent inside an observer: still the agent's stop
            except Exception:  # noqa: BLE001 - observers must never take the agent down
                log.debug("agent observer failed", exc_info=True)

    # -- rendezvous --------------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        began = time.time()
        spare = SpareWait(worker_group.spec.rdzv_handler, self._notify,
                          local_world_size=worker_group.spec.local_world_size,
                          on_wait=lambda nodes: self._warm_seat.waits(
                              worker_group.spec, nodes, self._start_method,
                              busy=lambda: self._handing_over or bool(self._live_worker_pids())))
        for attempt in range(1, ROUND_RETRIES + 2):
            stop_signal.raise_if_received()  # (a stop swallowed in a store request of the round before)
            try:
                super()._rendezvous(worker_group)
                break
            except (DistStoreError, DistNetworkError) as exc:
                stop = stop_signal.behind(exc)
                if stop is not None:  # a SIGTERM/SIGINT that reached the agent inside a store request: stop
                    raise stop from exc
                if attempt > ROUND_RETRIES:
                    raise
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                log.warning("A member of the new round did not take its part (%s): most likely it died right after the "
                            "round was sealed. This node joins the next round (%d of %d).", first_line, attempt,
                            ROUND_RETRIES)
        # The first round's start from the agent process's start: its own start-up (a joining node pays it all).
        startup = {"startup_s": round(began - _PROCESS_START, 3)} if not self._rounds else {}
        self._rounds += 1
        self._members.watch(worker_group.spec.rdzv_handler, self._member_gone)
        self._config_record.round_done(worker_group.spec.rdzv_handler, worker_group.group_rank)
        # The etcd-v3 lease protocol says so itself; torch's handler through our patch of it.
        early = getattr(worker_group.spec.rdzv_handler, "completed_early", fast_rendezvous.completed_early)
        self._notify("rendezvous", seconds=time.monotonic() - started, world_size=worker_group.group_world_size,
                     group_rank=worker_group.group_rank, completed_early=bool(early), **startup, **spare.fields())

    def _member_gone(self, member: str) -> None:
        """A member of this round is gone while this node's workers run: torch's loop restarts them for the next
        round (as for a node waiting to join: not a failure, no restart counted)."""
        log.warning("A member of this rendezvous round (%s) is gone: this node's workers %s for the next round "
                    "(they may be waiting for it in the process group's start).", member,
                    "park (in process)" if self._keeping is not None and self._places else "stop")
        self._restart_reason = f"a member of the round ({member}) is gone"
        self._notify("member_gone", member=member)

    def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int, spec: Any) -> Any:
        """torch's rank assignment, with waits that end once a member of the round is gone
        (:mod:`elastic_runner.agent.round_members`)."""
        gone = gone_check(spec.rdzv_handler)
        return super()._assign_worker_ranks(WatchfulStore(store, gone) if gone is not None else store, group_rank,
                                            group_world_size, spec)

    # -- stopping ------------------------------------------------------------------------------

    def _live_worker_pids(self) -> list[int]:
        pcontext = getattr(self, "_pcontext", None)
        if pcontext is None:
            return []
        return [pid for pid in pcontext.pids().values() if proc_state(pid) not in ("", "Z", "X")]

    def _announce_stop(self, reason: str) -> None:
        """Say, before torch SIGTERMs them, which workers this agent stops and why: a worker reads it in its private
        directory (:func:`elastic_runner.env.stop_announced`) so that it does not report a person's SIGTERM; the
        event is the run's record of it."""
        pids = self._live_worker_pids()
        if pids:
            announce_stopping(pids, reason)
            self._notify("stopping_workers", pids=pids, reason=reason)

    def _kill_stopped_workers(self) -> None:
        pcontext = getattr(self, "_pcontext", None)
        if pcontext is None:
            return
        for pid in pcontext.pids().values():
            if proc_state(pid) in ("T", "t"):
                log.warning("worker pid %d is stopped (SIGSTOP?) and cannot handle SIGTERM; killing it", pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._kill_stopped_workers()
        self._announce_stop(self._restart_reason)
        self._stopping_group = True  # torch's _stop_workers calls _shutdown: the reason is the one above
        try:
            super()._stop_workers(worker_group)
        finally:
            self._stopping_group = False

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # torch's _stop_workers (its workers restart for a new round) calls this too: the beat pauses then, and goes on
        # in the new round; only the agent's own end closes it (closed, it never beat again after the first restart).
        if self._stopping_group:
            self._beat.pause()
        else:
            self._beat.close()
            self._config_record.close()  # (its record goes stale: the rendezvous id may be used again, another config)
            self._warm_seat.close()
        self._kill_stopped_workers()
        if not self._stopping_group:
            self._announce_stop(f"the agent is shutting down on {death_sig.name}")
        super()._shutdown(death_sig, timeout)

    # -- starting and replacing ------------------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if not self._handing_over:
            self._places = kept_round.handovers(worker_group.spec.local_world_size) if self.in_process else None
            for place in self._places or ():
                place.clear()  # nothing asked of, nor left by, the workers of an earlier round
        with self._warm_seat.seating(self._notify):  # a spare seated: its standbys are its workers
            ids = super()._start_workers(worker_group)
        stop_signal.latch()  # torch's process context has just installed its stop handler (again)
        self._keeping = None
        if self.in_process and usable(KEEPING_WORKERS, log):
            self._keeping = as_keeping(getattr(self, "_pcontext", None))
            if self._keeping is None:
                log.info("recovery.in_process: the workers are not started from a function (ELASTIC_RUNNER_ZYGOTE=0?); "
                         "a failed worker restarts every worker")
        self._standbys.workers_started(self._standby_wanted())
        if self._keeping is not None and self._places:
            self._beat.follow(worker_group.master_addr, worker_group.master_port, worker_group.group_rank)
        return ids

    def _standby_wanted(self) -> bool:
        return self._keeping is not None and self.standby

    def _decide(self, result: RunResult) -> Decision:
        """The recovery policy's answer to the failed workers of ``result`` (:mod:`elastic_runner.recovery.policy`)."""
        return after_worker_failure({rank: f.exitcode for rank, f in result.failures.items()},
                                    finished=failed_after_finishing(result.failures),
                                    keeps_workers=self._keeping is not None, restarts_left=self._remaining_restarts)

    def _replace_failed(self, worker_group: WorkerGroup, result: RunResult, decision: Decision | None = None) -> bool:
        """Start the failed workers again alone, the others kept, where the policy says so (``decision``: its answer,
        asked here if not given); False: every worker restarts, torch's way (or the job ends), and why is logged."""
        decision = decision if decision is not None else self._decide(result)
        keeping = self._keeping
        if decision.action is not Action.REPLACE or keeping is None:
            if decision.action is Action.RESTART_ALL and decision.why:
                log.info("a worker failed (%s); every worker restarts", decision.why)
            return False
        why = self._announce_replacements(keeping, result)
        if why:
            log.info("a worker failed (%s); every worker restarts", why)
            return False
        for rank, failure in sorted(result.failures.items()):
            env = dict(keeping.envs[failure.local_rank]) | {REPLACES_VAR: str(failure.pid)}
            pid, from_standby = keeping.replace(failure.local_rank, env)
            if from_standby:
                self._standbys.took_place()
            worker_group.workers[failure.local_rank].id = pid
            self._remaining_restarts -= 1
            log.warning("worker of rank %d (pid %d) failed with exit status %s; %s as pid %d, the other workers keep "
                        "their process (in process; %d restarts left)", rank, failure.pid, failure.exitcode,
                        "the standby took its place" if from_standby else "started again alone", pid,
                        self._remaining_restarts)
            self._notify("worker_replaced", rank=rank, local_rank=failure.local_rank, pid=failure.pid, new_pid=pid,
                         exitcode=failure.exitcode, standby=from_standby)
        self._standbys.again(self._standby_wanted())
        return True

    def _announce_replacements(self, keeping: KeepingContext, result: RunResult) -> str:
        """Tell the failed workers' peers that replacements come (:func:`announce_replacements`). Why not, or ""."""
        env = keeping.envs[next(iter(result.failures.values())).local_rank]
        return announce_replacements(env["MASTER_ADDR"], int(env["MASTER_PORT"]), sorted(result.failures),
                                     self._job_key)

    # -- monitoring -----------------------------------------------------------------------------

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # A stop signal some `except` swallowed since the last look (torch's loop asks the rendezvous between looks)
        # stops the agent now. When a worker has exited, torch's process context SIGTERMs the others and waits up to
        # 30 s before _stop_workers runs: a stopped sibling must be gone first. (A keeping context leaves them.)
        stop_signal.raise_if_received()
        self._leave_if_asked(worker_group)
        self._standbys.tend(self._keeping)
        pcontext = getattr(self, "_pcontext", None)
        if pcontext is not None and self._keeping is None and \
                any(proc_state(pid) in ("", "Z", "X") for pid in pcontext.pids().values()):
            self._kill_stopped_workers()
            self._announce_stop("a worker of the same node failed")
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY and self._keeping is not None and self._places and \
                kept_round.parked(self._keeping, self._places):
            # Its peer is gone and no agent replaced it alone (a node lost): the next round, the workers kept.
            # (A failure reported in the same look is handled first, as any: its exit status may end the job.)
            self._restart_reason = "a worker's peers were lost"
            self._restart_workers(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        # What the next _restart_workers is for: torch restarts after a failure, or when a node waits to join.
        self._restart_reason = ("a worker failed" if result.state == WorkerState.FAILED
                                else "a node is waiting to join")
        decision = self._decide(result) if result.state == WorkerState.FAILED else None
        if decision is not None and decision.action is Action.FINISH:
            log.warning("rank(s) %s failed (exit status %s) after finishing the job, its final snapshot durable: the "
                        "job is done here; no new round", sorted(result.failures),
                        sorted({f.exitcode for f in result.failures.values()}))
            self._notify("worker_failed_after_finishing", ranks=sorted(result.failures))
            return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in worker_group.workers})
        if result.state == WorkerState.FAILED:
            codes = sorted({f.exitcode for f in result.failures.values()})
            self._notify("worker_failed", exit_codes=codes, count=len(result.failures),
                         failures=[{"rank": rank, "local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode}
                                   for rank, f in sorted(result.failures.items())])
            assert decision is not None
            if self._replace_failed(worker_group, result, decision):
                self._notify("state", state=WorkerState.HEALTHY.name, remaining_restarts=self._remaining_restarts)
                return RunResult(state=WorkerState.HEALTHY)
            if decision.action is Action.STOP and self._remaining_restarts > 0 and decision.final_status is not None:
                why = {EXIT_USAGE: "configuration or resume error", EXIT_DIVERGED: "the gradient became NaN or inf, or the "
                       "replicas kept differing",
                       EXIT_NOT_DURABLE: "the final snapshot could not be written"}
                # DEBUG: the worker printed the cause in one line; the exit status says the rest.
                log.debug("a worker exited with status %d (%s); restarting would fail the same way, "
                          "so the job stops", decision.final_status, why[decision.final_status])
                self._remaining_restarts = 0
        self._notify("state", state=result.state.name, remaining_restarts=self._remaining_restarts)
        return result

    def _leave_if_asked(self, worker_group: WorkerGroup) -> None:
        """A worker of this node asked that the node leave the job (``recovery.evict_stragglers``, :mod:`.exclusion`):
        raises the stop that makes it leave as a preempted node does."""
        leave_if_asked(worker_group.spec.rdzv_handler, self._job_key, worker_group.group_world_size or 1, self._notify)

    def _exit_barrier(self) -> None:
        """torch's exit barrier, except that it stops waiting when a node asks for a new round instead of arriving
        (:mod:`.finish`): the job is finished here, whatever that node does next."""
        group, started = self._worker_group, time.monotonic()
        self._in_exit_barrier = True
        try:
            how = wait_at_exit(self._store, group.group_world_size, self._exit_barrier_timeout,
                               group.spec.rdzv_handler.num_nodes_waiting)
        except SignalException:
            raise
        except Exception as exc:  # noqa: BLE001 - as torch's: the job's part here is done either way
            log.warning("the exit barrier failed after %.1fs (%s: %s); this agent ends", time.monotonic() - started,
                        type(exc).__name__, exc)
            return
        finally:
            self._in_exit_barrier = False
        if how == "new round":
            log.warning("a node asked for a new round after this one finished the job (its worker failed late); not "
                        "waiting for it: it resumes from the final snapshot on its own")
        elif how == "timeout":
            log.warning("not every agent reached the end within %.0fs; this agent ends", self._exit_barrier_timeout)

    def _count_out_lost(self, worker_group: WorkerGroup, lost: tuple[int, ...]) -> None:
        """Tell the rendezvous which members of the round this node's workers saw lost (their agents' beat stood
        still), where it can count them out now (etcd-v3's lease protocol); else the next round waits for their
        leases or heartbeats as before."""
        count_out = getattr(worker_group.spec.rdzv_handler, "count_out", None)
        if not lost or not callable(count_out):
            return
        try:
            names = count_out(lost)  # (never this agent's own node: count_out skips it)
        except SignalException:
            raise
        except Exception:  # noqa: BLE001 - the round then waits the dead-node window, as before
            log.debug("could not count the lost nodes out of the round", exc_info=True)
            return
        if names:
            self._notify("members_counted_out", members=names, group_ranks=list(lost))

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        stop_signal.raise_if_received()  # (swallowed in the rendezvous's answer that asked for this restart)
        self._notify("restart")
        if not self._keep_for_next_round(worker_group):
            self._beat.pause()  # its workers restart: survivors elsewhere stop waiting for an announcement from it
            super()._restart_workers(worker_group)

    def _keep_for_next_round(self, worker_group: WorkerGroup) -> bool:
        """The next round with this node's workers kept, where the recovery policy says so (False: torch restarts)."""
        keeping, places = self._keeping, self._places
        decision = for_new_round(offered=keeping is not None and bool(places),
                                 park=lambda: kept_round.park(keeping, places, self._restart_reason))
        if decision.action is not Action.KEEP or keeping is None or not places:
            return False
        started = time.monotonic()
        self._count_out_lost(worker_group, kept_round.lost_agents(keeping, places, worker_group.group_world_size))
        old = {w.local_rank: w.global_rank for w in worker_group.workers}
        self._standbys.cancel()
        worker_group.state = WorkerState.STOPPED
        self._handing_over = True
        try:
            with kept_round.handing_over(keeping, places) as outcome:
                self._initialize_workers(worker_group)
        finally:
            self._handing_over = False
        ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        kept = [(local, pid) for local, pid, was_kept in outcome if was_kept]
        log.warning("%s: this node's workers kept their processes for the new round (in process: %s) in %.3fs%s",
                    self._restart_reason, ", ".join(f"pid {pid} rank {old.get(local)} → {ranks.get(local)}"
                                                    for local, pid in kept), time.monotonic() - started,
                    "".join(f"; local rank {local} started again as pid {pid}"
                            for local, pid, was_kept in outcome if not was_kept))
        self._notify("workers_kept", reason=self._restart_reason, seconds=round(time.monotonic() - started, 3),
                     kept=[{"local_rank": local, "pid": pid, "rank": ranks.get(local)} for local, pid in kept],
                     started=[{"local_rank": local, "pid": pid} for local, pid, was_kept in outcome if not was_kept])
        return True
