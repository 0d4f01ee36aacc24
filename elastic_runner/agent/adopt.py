"""Make a torchrun agent ours: the same set-up for ``elastic-runner launch`` and for a plain
``torchrun -m elastic_runner.train``.

Applied to the agent process just before torch's ``launch_agent`` builds its agent:

- **Zygote workers** (:mod:`elastic_runner.agent.zygote`) when the program is ``-m elastic_runner.train``:
  the entrypoint becomes a function forked from a pre-imported server instead of a new interpreter.
- **Faster rounds** (:mod:`elastic_runner.agent.fast_rendezvous`) and **our agent**
  (:class:`elastic_runner.agent.agent.ElasticRunnerAgent`), each only where its canary says the torch
  internals it relies on are still there (:mod:`elastic_runner.torch_patches`).
- **Agent metrics** on ``ELASTIC_RUNNER_AGENT_METRICS_PORT`` and the agent's event log.
- **A quiet terminal** (:mod:`elastic_runner.agent.terminal`): torch's tracebacks of handled worker failures
  go to DEBUG.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Sequence

from .zygote import WORKER_MODULE, worker_config

log = logging.getLogger(__name__)


def worker_program(entrypoint: Any, args: Sequence[Any]) -> list[str] | None:
    """The worker's own arguments when torch would start ``python [-u] -m elastic_runner.train ARGS``."""
    if entrypoint != sys.executable:
        return None
    items = [str(a) for a in args]
    while items and items[0] == "-u":
        items = items[1:]
    if items[:2] == ["-m", WORKER_MODULE]:
        return items[2:]
    return None


def flag_value(argv: list[str], name: str) -> str | None:
    """Value of --name/--name-with-dashes in argv (before the training script), if given."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(argv):
        if arg in ("-m", "--module"):
            break
        key, sep, value = arg.partition("=")
        if key in spellings:
            return value if sep else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def names_our_worker(argv: list[str]) -> bool:
    """Cheap pre-parse (before torch is imported): is the program ``-m elastic_runner.train``?"""
    for i, arg in enumerate(argv):
        if arg in ("-m", "--module") and i + 1 < len(argv):
            return argv[i + 1] == WORKER_MODULE
        if not arg.startswith("-") and (i == 0 or not argv[i - 1].startswith("--") or "=" in argv[i - 1]):
            return False
    return False


def name_agent(environ: Any = None) -> str:
    """Give this agent process a name its workers inherit (they record it in their ``start`` event; ``report``
    tells a job started again by hand from a recovery by it). Call before the zygote starts."""
    import atexit
    import shutil
    import socket
    import tempfile
    import time

    from ..env import AGENT_ID_VAR, GOODPUT_FILE_VAR

    environ = os.environ if environ is None else environ
    environ[AGENT_ID_VAR] = f"{socket.gethostname()}-{os.getpid()}-{time.time():.0f}"
    # Where local rank 0 leaves the live goodput clock for this agent's metric: a directory of its own
    # (mode 0700), removed when the agent exits; those of agents that were killed, at the next start.
    sweep_private_dirs()
    private = tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, private, True)
    environ[GOODPUT_FILE_VAR] = os.path.join(private, "goodput.json")
    return environ[AGENT_ID_VAR]


PRIVATE_PREFIX = "elastic-runner-agent-"


def sweep_private_dirs(base: str | None = None) -> list[str]:
    """Remove the private directories of this user's agents that are gone (SIGKILLed: no atexit ran)."""
    import glob
    import shutil
    import tempfile

    removed = []
    for path in glob.glob(os.path.join(base or tempfile.gettempdir(), PRIVATE_PREFIX + "*-*")):
        pid = os.path.basename(path)[len(PRIVATE_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except OSError:
            continue  # alive under another user, or not ours to judge
    return removed


def adopt(launcher_api: Any, config: Any, entrypoint: Any, args: Sequence[Any],
          zygote_wanted: bool) -> tuple[Any, list[Any], Callable[[], None]]:
    """Set up this agent process; returns the (entrypoint, args) to hand to torch's ``launch_agent``, and what to
    call once it has returned or raised (the agent's last upload of the node's records: at interpreter exit, the
    store's client can no longer run its requests)."""
    from . import fast_rendezvous, zygote
    from .agent import ElasticRunnerAgent
    from .metrics import AgentMetrics, install_bridge
    from .terminal import quiet_handled_failures
    from ..torch_patches import AGENT_CORRECTIONS, PROCESS_GROUP_ABORT, usable

    _end_if_no_scope()
    from ..recovery.liveness import ALIVE_PORT_VAR

    # Only this agent's own port (below) reaches its workers: one inherited from a process that started this agent
    # names a port nobody here serves, and survivors would count this live node out.
    os.environ.pop(ALIVE_PORT_VAR, None)
    key_file = (getattr(config, "rdzv_configs", None) or {}).get("auth_key_file")
    if key_file:
        from ..snapshot.format import KEY_FILE_VAR

        # Its path (never the key) for the workers: they sign snapshot metadata with the job's key, and take only
        # snapshots signed with it.
        os.environ.setdefault(KEY_FILE_VAR, str(key_file))
    worker_args = worker_program(entrypoint, args)
    if worker_args is not None:
        from ..rendezvous.ports import hold_for_our_workers

        hold_for_our_workers()  # our worker binds MASTER_PORT with SO_REUSEPORT: the offered port stays held
    worker_cfg = worker_config(worker_args) if worker_args is not None else None
    from ..recovery.job_config import for_this_node

    config_digest = for_this_node(worker_cfg, entrypoint, args, ours=worker_args is not None)
    from ..env import agent_private_dir

    private = agent_private_dir()  # name_agent's directory
    if private and _keeps_workers_across_rounds(worker_cfg, zygote_wanted):
        from ..recovery.handover import HANDOVER_DIR_VAR

        # Where its workers are handed their places in a new round. Only here: elsewhere (torch's own agent, a
        # binary entrypoint) they would park for a round that nobody hands them.
        os.environ[HANDOVER_DIR_VAR] = private
        _serve_liveness()
    if zygote_wanted and worker_args is not None:
        # forked from this agent, which has imported torch by now
        from ..config.locations import is_url

        zygote.start_warming(compiled=worker_cfg is not None and worker_cfg.model.compile,
                             object_store=worker_cfg is not None and bool(worker_cfg.snapshot.dir)
                             and is_url(worker_cfg.snapshot.dir))
        entrypoint, args = zygote.worker_main, worker_args
        config.start_method = "forkserver"
        # After the zygote's fork (the check would be a thread, or a child, it inherited), while it warms up; a node
        # that leaves need not wait for it.
        _end_if_unhealthy(_start_health_check(worker_cfg, config))
        if not zygote.wait_warm():  # before this agent takes part in any round (see WARM_WAIT_S)
            log.warning("the worker zygote is not warm after %gs; this node joins the rendezvous anyway",
                        zygote.WARM_WAIT_S)
    else:
        _end_if_unhealthy(_start_health_check(worker_cfg, config))  # before this agent takes part in any round
    if _liveness is not None:
        _liveness.start()  # (its thread only now: the zygote forks only from an agent without other threads)
    fast_rendezvous.install()
    quiet_handled_failures()
    agent_metrics = AgentMetrics(agent_events(worker_cfg) if worker_cfg is not None else None)
    finish = upload_agent_events(worker_cfg) if worker_cfg is not None else _nothing
    agent_metrics.serve()
    install_bridge(agent_metrics)
    if usable(AGENT_CORRECTIONS, log):
        ElasticRunnerAgent.default_observers = [agent_metrics.observe]
        # The workers' choice; a script's workers (elastic_runner.fit, no --config) restart every worker.
        ElasticRunnerAgent.in_process = bool(worker_cfg is not None and worker_cfg.in_process)
        ElasticRunnerAgent.standby = bool(worker_cfg is not None and worker_cfg.recovery.standby)
        ElasticRunnerAgent.config_digest = config_digest
        ElasticRunnerAgent.liveness = _liveness
        # torch's launch_agent builds a LocalElasticAgent; ours adds the corrections
        # documented in elastic_runner.agent.agent. Only this process is affected.
        launcher_api.LocalElasticAgent = ElasticRunnerAgent
    usable(PROCESS_GROUP_ABORT, log)
    return entrypoint, list(args), finish


def _serve_liveness() -> None:
    """This agent's liveness port (:mod:`elastic_runner.recovery.liveness`), bound and in the environment its workers
    inherit before the zygote forks, answered once :func:`adopt` starts it after the fork: what survivors ask when
    rank 0's worker's store is gone with its node."""
    from ..env import AGENT_ID_VAR
    from ..recovery.liveness import ALIVE_PORT_VAR, LivenessServer
    from ..snapshot import SnapshotError
    from ..snapshot.format import signing_key_from_environment

    global _liveness
    try:
        key = signing_key_from_environment()
    except SnapshotError as exc:  # the workers meet it too, and exit 2 with its line
        log.debug("the job's key cannot be read here: %s", exc)
        return
    try:
        _liveness = LivenessServer(os.environ.get(AGENT_ID_VAR, ""), key)
    except Exception as exc:  # noqa: BLE001 - without it a lost rank 0 node costs the dead-node window, as before
        log.warning("this agent's liveness port could not be bound (%s): if this node hosts the job's store and "
                    "is lost, the next round waits for its lease to expire", exc)
        return
    os.environ[ALIVE_PORT_VAR] = str(_liveness.port)


_liveness: Any = None  #: this agent's liveness port, for the agent's whole life


def _nothing() -> None:
    return None


def _start_health_check(worker_cfg: Any, config: Any) -> Callable[[], str | None]:
    """This node's health check (:mod:`.health`) started; returns how to wait for its finding. Only for our worker
    with its config read here: a script's own devices (elastic_runner.fit) are its to choose, and a config that does
    not load is the workers' to report."""
    from .health import network_problem, start_check, workers_use_gloo

    if worker_cfg is None or not worker_cfg.recovery.health_check:
        return _nothing
    gloo = workers_use_gloo(worker_cfg.dist.backend, worker_cfg.dist.device,
                            worker_cfg.parallel.sharded and worker_cfg.snapshot.in_memory)
    problem, doubt = network_problem(gloo=gloo, max_nodes=int(config.max_nodes), rdzv_backend=str(config.rdzv_backend),
                                     endpoint=str(config.rdzv_endpoint or ""))
    if problem:
        return lambda: problem
    if doubt:
        log.warning("%s", doubt)
    return start_check(worker_cfg.dist.device, int(getattr(config, "nproc_per_node", 1) or 1))


def _end_if_no_scope() -> None:
    """A malformed run scope ends the agent with one line naming the variable, before it joins a round: on etcd-v3 the
    rendezvous would refuse it anyway, and on c10d the lasting records (exclusions, the job's configuration) are
    bound to it."""
    from ..lifecycle import EXIT_USAGE
    from ..rendezvous.options import run_scope

    try:
        run_scope()
    except ValueError as exc:
        log.error("%s", exc)
        raise SystemExit(EXIT_USAGE) from None


def _end_if_unhealthy(finding: Callable[[], str | None]) -> None:
    from ..lifecycle import EXIT_UNHEALTHY

    problem = finding()
    if problem:
        log.error("This node failed its health check and leaves the job before joining it (exit %d; the other nodes "
                  "go on without it): %s. Set recovery.health_check: false to skip the check.", EXIT_UNHEALTHY, problem)
        raise SystemExit(EXIT_UNHEALTHY)


def _keeps_workers_across_rounds(worker_cfg: Any, zygote_wanted: bool) -> bool:
    """Whether this agent hands its workers their places in a new round (:mod:`.kept_round`): ours, with in-process
    recovery, workers started from a function, and the torch internals each part relies on."""
    from ..torch_patches import AGENT_CORRECTIONS, KEEPING_WORKERS, KEPT_ROUNDS

    return bool(worker_cfg is not None and worker_cfg.in_process and zygote_wanted
                and not (AGENT_CORRECTIONS.problems() or KEEPING_WORKERS.problems() or KEPT_ROUNDS.problems()))


def upload_agent_events(cfg: Any) -> Callable[[], None]:
    """With snapshots in a bucket, the agent's own event log is uploaded with the run's records
    (:mod:`~elastic_runner.observe.records`) as the workers' are; the returned function, called when the agent has
    ended, uploads everything of the node's run.dir that the bucket still lacks: its own last events (they come after
    its workers'), and the last records of a worker that failed on its own when no worker followed it on this node."""
    import socket

    from ..config.locations import is_url

    if not (cfg.snapshot.dir and is_url(cfg.snapshot.dir)):
        return _nothing

    import threading
    import time

    mine = f"events/agent-{socket.gethostname()}-{os.getpid()}.jsonl"
    started: list[Any] = []

    def make(wanted: Any) -> Any:
        from ..observe.records import RecordSync, records_url

        return RecordSync(cfg.run.dir, records_url(cfg.snapshot.dir), every_s=cfg.snapshot.records_every_seconds,
                          wanted=wanted)

    def start() -> None:
        # Off the agent's start and its first rendezvous (a join's critical path): the client library's imports
        # would take the GIL from them. The first upload is due after one interval anyway.
        time.sleep(cfg.snapshot.records_every_seconds)
        try:
            started.append(make(lambda relative: relative == mine).start())
        except Exception as exc:  # noqa: BLE001 - the workers' records still go; the store is checked by them
            log.warning("the agent's events will not be uploaded to %s: %s", cfg.snapshot.dir, exc)

    def at_end() -> None:
        try:
            sync = started[0] if started else make(lambda relative: True)
        except Exception:  # noqa: BLE001 - said when it was started
            return
        sync.wanted = lambda relative: True  # the workers are gone: whatever of the node the bucket lacks
        sync.close(final=True)

    threading.Thread(target=start, name="agent-record-sync-start", daemon=True).start()
    return at_end


def agent_events(cfg: Any) -> Any:
    """The agent's own event log in the workers' run directory."""
    import socket

    from ..observe.events import EventLog

    try:
        return EventLog(cfg.run.dir, f"agent-{socket.gethostname()}-{os.getpid()}", role="agent")
    except OSError as exc:
        log.debug("no agent event log: %s", exc)
        return None
