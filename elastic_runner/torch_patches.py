"""Every private torch internal elastic_runner changes or relies on, and whether it still can.

torch's elastic agent and rendezvous have no public extension points for what we correct
(docs/torch-behaviours.md), so a few classes subclass or replace private names. A torch
upgrade that renames or reshapes one of them must not silently turn our behaviour off: each patch
here lists the private symbols it needs, :func:`problems` says which are missing or changed, and

- ``elastic-runner launch`` logs one warning per patch that cannot be applied and runs with
  torch's own behaviour for that part (:func:`usable`);
- the etcd-v3 handler falls back to torch's ``DynamicRendezvousHandler`` the same way;
- ``tests/unit/test_torch_patches.py`` fails, naming the symbol, when a check fails on the torch
  under test, and checks each patch's *behaviour* too (a round completes early, our override is
  called, a configuration error is not restarted...), so that a change of what torch does behind
  an unchanged name is caught as well.

Standard library only at import time (torch is imported by the checks).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DR = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
AGENT_API = "torch.distributed.elastic.agent.server.api"
LOCAL_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent"
LAUNCHER = "torch.distributed.launcher.api"
C10D = "torch.distributed.distributed_c10d"


@dataclass(frozen=True)
class Need:
    """One private torch symbol: ``module`` and a dotted ``path`` inside it.

    ``init_attr``: ``path`` is ``Class.attribute``, an instance attribute the class's ``__init__``
    sets (looked up in its bytecode names or its annotations). ``params``: names the callable at
    ``path`` must accept. ``refers_to``: a global name the function at ``path`` must look up at
    call time (what a module-level swap relies on).
    """

    module: str
    path: str
    init_attr: bool = False
    params: tuple[str, ...] = ()
    refers_to: str = ""

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.path}"

    def problem(self) -> str | None:
        """None when torch still has it as we use it; else what changed, naming the symbol."""
        try:
            target: Any = importlib.import_module(self.module)
        except ImportError as exc:
            return f"{self.module} cannot be imported ({exc})"
        parts = self.path.split(".")
        if self.init_attr:
            parts, attribute = parts[:-1], parts[-1]
        for part in parts:
            if not hasattr(target, part):
                return f"{self.symbol} does not exist"
            target = getattr(target, part)
        if self.init_attr and not _sets_attribute(target, attribute):
            return f"{self.symbol} is no longer set by {target.__qualname__}.__init__"
        if self.params:
            try:
                accepted = inspect.signature(target).parameters
            except (TypeError, ValueError):
                return f"{self.symbol} has no inspectable signature"
            missing = [p for p in self.params if p not in accepted]
            if missing:
                return f"{self.symbol} no longer takes {', '.join(missing)} (now {tuple(accepted)})"
        # Judge torch's own function, not a wrapper of ours around it (elastic_runner.agent.torchrun_hook).
        target = inspect.unwrap(target) if callable(target) else target
        if self.refers_to and self.refers_to not in getattr(getattr(target, "__code__", None), "co_names", ()):
            return f"{self.symbol} no longer looks up {self.refers_to} at call time"
        return None


def _sets_attribute(cls: Any, attribute: str) -> bool:
    for klass in getattr(cls, "__mro__", (cls,)):
        if attribute in getattr(klass, "__annotations__", {}):
            return True
        init = klass.__dict__.get("__init__")
        if init is not None and attribute in getattr(getattr(init, "__code__", None), "co_names", ()):
            return True
    return False


@dataclass(frozen=True)
class TorchPatch:
    name: str  #: what the patch gives the user
    where: str  #: our module that applies it
    without: str  #: what happens when it cannot be applied
    needs: tuple[Need, ...]

    def problems(self) -> list[str]:
        return [p for p in (n.problem() for n in self.needs) if p is not None]


FAST_RENDEZVOUS = TorchPatch(
    name="rendezvous rounds that complete once the previous round is back, with 0.1 s polls",
    where="elastic_runner.agent.fast_rendezvous",
    without="every round waits out last_call_timeout and polls once a second",
    needs=(
        Need(DR, "_RendezvousJoinOp.__call__", params=("ctx", "deadline")),
        Need(DR, "_Action.SYNC"), Need(DR, "_Action.KEEP_ALIVE"), Need(DR, "_Action.MARK_RENDEZVOUS_COMPLETE"),
        Need(DR, "_Action.ADD_TO_REDUNDANCY_LIST"),
        Need(DR, "_delay", params=("seconds",)),
        Need(DR, "_DistributedRendezvousOpExecutor.run", refers_to="_delay"),
        Need(DR, "DynamicRendezvousHandler.next_rendezvous"),
        Need(DR, "DynamicRendezvousHandler._state_holder", init_attr=True),
        Need(DR, "_BackendRendezvousStateHolder._cache_duration", init_attr=True),
        Need(DR, "_RendezvousContext.__init__", params=("node", "state", "settings")),
        Need(DR, "_RendezvousState.participants", init_attr=True),
        Need(DR, "_RendezvousState.wait_list", init_attr=True),
        Need(DR, "_RendezvousState.round", init_attr=True),
        Need(DR, "_RendezvousState.redundancy_list", init_attr=True),
        Need(DR, "_remove_participant_epilogue", params=("state", "settings")),
        Need(DR, "_should_keep_alive", params=("ctx",)),
        Need(DR, "DynamicRendezvousHandler._this_node", init_attr=True),
        Need(DR, "_RendezvousState.last_heartbeats", init_attr=True),
        Need(DR, "_RendezvousState.complete", init_attr=True),
        Need(DR, "DynamicRendezvousHandler._start_heartbeats"),
        Need(DR, "DynamicRendezvousHandler._keep_alive_timer", init_attr=True),
        Need("torch.distributed.elastic.rendezvous.utils", "_PeriodicTimer._ctx", init_attr=True),
    ),
)

OUTAGE_TOLERANT_HANDLER = TorchPatch(
    name="etcd-v3 agents that heartbeat again after an etcd outage longer than the heartbeat window",
    where="elastic_runner.rendezvous.handler",
    without="torch's DynamicRendezvousHandler: after such an outage every agent drops itself from the "
            "rendezvous record, and the next node to arrive starts a second group",
    needs=(
        Need(DR, "_BackendRendezvousStateHolder.__init__", params=("backend", "settings")),
        Need(DR, "_BackendRendezvousStateHolder._sanitize"),
        Need(DR, "_BackendRendezvousStateHolder.sync"),
        Need(DR, "_BackendRendezvousStateHolder._state", init_attr=True),
        Need(DR, "_BackendRendezvousStateHolder._settings", init_attr=True),
        Need(DR, "_BackendRendezvousStateHolder._dirty", init_attr=True),
        Need(DR, "_BackendRendezvousStateHolder._dead_nodes", init_attr=True),
        Need(DR, "_BackendRendezvousStateHolder._last_sync_time", init_attr=True),
        Need(DR, "DynamicRendezvousHandler.__init__",
             params=("node", "settings", "backend_name", "store", "state_holder")),
        Need(DR, "DynamicRendezvousHandler._node_desc_generator.generate"),
        Need(DR, "_NodeDesc"),
    ),
)

AGENT_CORRECTIONS = TorchPatch(
    name="our elastic agent: stopped workers killed at once, configuration errors not restarted, "
         "no lazy imports on the recovery path, agent metrics",
    where="elastic_runner.agent.agent",
    without="torch's LocalElasticAgent",
    needs=(
        Need(LOCAL_AGENT, "LocalElasticAgent._rendezvous", params=("worker_group",)),
        Need(LOCAL_AGENT, "LocalElasticAgent._stop_workers", params=("worker_group",)),
        Need(LOCAL_AGENT, "LocalElasticAgent._shutdown", params=("death_sig", "timeout")),
        Need(LOCAL_AGENT, "LocalElasticAgent._monitor_workers", params=("worker_group",)),
        Need(LOCAL_AGENT, "LocalElasticAgent._restart_workers", params=("worker_group",)),
        Need(LOCAL_AGENT, "LocalElasticAgent._assign_worker_ranks",
             params=("store", "group_rank", "group_world_size", "spec")),
        Need(LOCAL_AGENT, "LocalElasticAgent._pcontext", init_attr=True),
        Need(AGENT_API, "SimpleElasticAgent._exit_barrier"),
        Need(AGENT_API, "SimpleElasticAgent._remaining_restarts", init_attr=True),
        Need(LAUNCHER, "LocalElasticAgent"),
        Need(LAUNCHER, "launch_agent", refers_to="LocalElasticAgent"),
    ),
)

PROCESS_GROUP_ABORT = TorchPatch(
    name="the watchdog aborts a process group stuck on a lost peer (NCCL)",
    where="elastic_runner.dist",
    without="with NCCL a collective on a lost peer ends only at the collective timeout",
    needs=(Need(C10D, "_abort_process_group"),),
)

#: Not in :data:`ALL`: a capability of torch >= 2.14 that torch 2.13 lacks by design, not a correction we apply.
#: :func:`elastic_runner.recovery.rebuild.regroup_method` rebuilds groups the other way where it does not fit.
PROCESS_GROUP_RECONFIGURE = TorchPatch(
    name="process groups reconfigured in place for a new membership (in-process recovery)",
    where="elastic_runner.recovery.rebuild",
    without="the group is destroyed and created again in the same process (~0.1 s on gloo)",
    needs=(
        Need(C10D, "_reconfigure", params=("uuid", "handles", "group", "timeout")),
        Need(C10D, "_get_reconfigure_handle", params=("group",)),
        Need(C10D, "_supports_reconfigure", params=("group",)),
        Need(C10D, "init_process_group", params=("enable_reconfigure",)),
    ),
)

ELASTIC_MP = "torch.distributed.elastic.multiprocessing.api"
ELASTIC_MP_PACKAGE = "torch.distributed.elastic.multiprocessing"  #: where torch's own ``start_processes`` lives
SPAWN = "torch.multiprocessing.spawn"

KEEPING_WORKERS = TorchPatch(
    name="a failed worker replaced while the node's other workers run on (in-process recovery)",
    where="elastic_runner.agent.worker_context",
    without="torch's all-or-nothing policy: a failed worker's siblings are terminated and every worker restarts",
    needs=(
        Need(ELASTIC_MP, "MultiprocessContext._poll"),
        Need(ELASTIC_MP, "MultiprocessContext._pc", init_attr=True),
        Need(ELASTIC_MP, "MultiprocessContext._ret_vals", init_attr=True),
        Need(ELASTIC_MP, "MultiprocessContext._worker_finished_event", init_attr=True),
        Need(ELASTIC_MP, "MultiprocessContext._numa_options", init_attr=True),
        Need(ELASTIC_MP, "PContext.error_files", init_attr=True),
        Need(ELASTIC_MP, "_wrap", params=("local_rank", "fn", "args", "envs", "stdout_redirects", "stderr_redirects",
                                          "ret_vals", "queue_finished_reading_event", "numa_options")),
        Need(SPAWN, "_wrap", params=("fn", "i", "args", "error_file")),
        Need(SPAWN, "ProcessContext.processes", init_attr=True),
        Need(SPAWN, "ProcessContext.sentinels", init_attr=True),
        Need(SPAWN, "ProcessContext.error_files", init_attr=True),
    ),
)

#: What swapping torch's agent's ``start_processes`` for a round relies on (kept_round's and the spare's hand-overs).
_START_PROCESSES_SWAPPED = (
    Need(LOCAL_AGENT, "start_processes", params=("envs",)),
    Need(LOCAL_AGENT, "LocalElasticAgent._start_workers", refers_to="start_processes"),
)

KEPT_ROUNDS = TorchPatch(
    name="a new rendezvous round that keeps the workers (in-process recovery across membership changes)",
    where="elastic_runner.agent.kept_round",
    without="a node that joins or is lost restarts every worker, as torch does",
    needs=_START_PROCESSES_SWAPPED,
)

SEATED_SPARES = TorchPatch(
    name="a spare's workers built while it waits, handed their places when it is seated",
    where="elastic_runner.agent.spare",
    without="a spare starts its workers when it is seated, and they build their workload then",
    needs=(
        *_START_PROCESSES_SWAPPED,
        Need(ELASTIC_MP, "MultiprocessContext", params=("name", "entrypoint", "args", "envs", "start_method",
                                                        "logs_specs")),
        Need(ELASTIC_MP, "PContext.start", refers_to="_start"),
        Need(ELASTIC_MP, "MultiprocessContext._start"),
        Need(ELASTIC_MP, "PContext.stdouts", init_attr=True),
        Need(ELASTIC_MP, "PContext.stderrs", init_attr=True),
        Need(SPAWN, "ProcessContext", params=("processes", "error_files")),
    ),
)

EXCLUSIONS_IN_C10D = TorchPatch(
    name="an evicted node recorded in the c10d rendezvous (recovery.evict_stragglers)",
    where="elastic_runner.recovery.exclusions",
    without="under c10d an evicted node leaves but is not kept out: it may join again at once (etcd-v3 keeps it out)",
    needs=(Need(DR, "DynamicRendezvousHandler._store", init_attr=True),),
)

ALL: tuple[TorchPatch, ...] = (FAST_RENDEZVOUS, OUTAGE_TOLERANT_HANDLER, AGENT_CORRECTIONS, PROCESS_GROUP_ABORT,
                               KEEPING_WORKERS, KEPT_ROUNDS, SEATED_SPARES, EXCLUSIONS_IN_C10D)


def usable(patch: TorchPatch, logger: logging.Logger = log) -> bool:
    """True when ``patch`` can be applied to this torch; otherwise one warning that says what is lost."""
    found = patch.problems()
    if found:
        logger.warning("cannot apply %s (%s) to torch %s: %s; running with torch's behaviour instead: %s",
                       patch.name, patch.where, torch_version(), "; ".join(found), patch.without)
    return not found


def torch_version() -> str:
    """The installed torch's version, for logs and metrics ("unknown" where torch does not import)."""
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return "unknown"
