"""Agent-level Prometheus metrics and events: what only torchrun's agent knows.

torch's agent publishes through ``torch.distributed.elastic.metrics``
(worker-group state, remaining restarts, durations of its operations via
``@prof``) to a null handler by default. :class:`TorchMetricsBridge` is a
``MetricHandler`` that turns those into Prometheus instruments;
:meth:`AgentMetrics.observe` takes the richer notifications of
:class:`~elastic_runner.agent.agent.ElasticRunnerAgent` (rendezvous rounds
and their durations, failed workers and their exit codes, restarts) and also
writes them to the run's event log, where ``elastic-runner report`` and the
chaos tool read them.

Served on ``ELASTIC_RUNNER_AGENT_METRICS_PORT`` (0 or unset: off), bound to
all interfaces inside Kubernetes and to 127.0.0.1 elsewhere
(``ELASTIC_RUNNER_AGENT_METRICS_BIND`` overrides).
"""

from __future__ import annotations

import logging
import math
import os
import platform
import re
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics

from .. import __version__
from ..observe.events import EventLog
from ..env import GOODPUT_FILE_VAR
from ..torch_patches import torch_version

log = logging.getLogger(__name__)

# One series per instrument: the *_created timestamps double the series for no use here.
disable_created_metrics()

PREFIX = "elastic_runner_agent_"
STATES = ("INIT", "HEALTHY", "UNHEALTHY", "STOPPED", "SUCCEEDED", "FAILED", "UNKNOWN")
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class AgentMetrics:
    def __init__(self, events: EventLog | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.events = events
        self.current_state = "INIT"
        self.remaining_restarts = Gauge(PREFIX + "remaining_restarts", "Restarts this agent may still make (of --max-restarts).", registry=r)
        self.state = Gauge(PREFIX + "worker_group_state", "1 for the worker group's current state, 0 for the others.", ["state"], registry=r)
        self.set_state("INIT")
        self.restarts = Counter(PREFIX + "restarts", "Worker-group restarts by this agent (failures and membership changes).", registry=r)
        self.failures = Counter(PREFIX + "worker_failures", "Worker-group failures this agent detected.", registry=r)
        self.replaced = Counter(PREFIX + "workers_replaced", "Failed workers this agent started again alone, the others kept "
                                "(recovery.in_process).", registry=r)
        self.kept = Counter(PREFIX + "workers_kept", "Workers this agent kept in their process through a new rendezvous "
                            "round (recovery.in_process).", registry=r)
        self.counted_out = Counter(PREFIX + "nodes_counted_out", "Nodes this agent counted out of the rendezvous before "
                                   "their leases expired: its workers saw their agents stop beating (etcd-v3, "
                                   "recovery.in_process).", registry=r)
        self.rendezvous = Counter(PREFIX + "rendezvous", "Rendezvous rounds this agent completed.", registry=r)
        self.rendezvous_duration = Histogram(PREFIX + "rendezvous_duration_seconds", "Time from joining to a complete rendezvous round.",
                                             buckets=DURATION_BUCKETS, registry=r)
        self.nodes = Gauge(PREFIX + "nodes", "Nodes (agents) in the current rendezvous round.", registry=r)
        self.spare = Gauge(PREFIX + "spare", "1 while this node waits as a spare: the round is full (--nnodes' "
                           "maximum) and it takes the next free seat.", registry=r)
        self.goodput = Gauge(PREFIX + "goodput_ratio", "Share of the job's wall time spent on steps that count, now: "
                             "the clock this node's workers keep, moved on while they train and while they do not "
                             "(a restart, a rendezvous). NaN until a worker has logged a step.", registry=r)
        self.goodput.set_function(self._goodput)
        self.operation_duration = Histogram(PREFIX + "operation_duration_seconds",
                                            "Duration of torch agent operations (torch.distributed.elastic.metrics @prof).",
                                            ["operation"], buckets=DURATION_BUCKETS, registry=r)
        self.operations = Counter(PREFIX + "operations", "torch agent operations by outcome.", ["operation", "outcome"], registry=r)
        Info(PREFIX + "build", "Versions of this agent.", registry=r).info({
            "version": __version__, "python": platform.python_version(), "torch": torch_version(),
        })
        self._server: Any = None

    # -- our agent's notifications -------------------------------------------------------

    def observe(self, event: str, **fields: Any) -> None:
        if event == "state":
            self.set_state(fields["state"])
            self.remaining_restarts.set(fields["remaining_restarts"])
            return
        if event == "rendezvous":
            self.rendezvous.inc()
            self.rendezvous_duration.observe(fields["seconds"])
            self.nodes.set(fields["world_size"])
            self.spare.set(0)
        elif event == "spare_waiting":
            self.spare.set(1)
        elif event == "worker_failed":
            self.failures.inc()
        elif event == "restart":
            self.restarts.inc()
        elif event == "worker_replaced":
            self.replaced.inc()
        elif event == "workers_kept":
            self.kept.inc(len(fields.get("kept", ())))
        elif event == "members_counted_out":
            self.counted_out.inc(len(fields.get("members", ())))
        if self.events is not None:
            self.events.emit(f"agent_{event}", **fields)

    def _goodput(self) -> float:
        from ..observe.goodput import agent_goodput

        path = os.environ.get(GOODPUT_FILE_VAR)
        value = agent_goodput(path, time.time(), training=self.current_state == "HEALTHY") if path else None
        return math.nan if value is None else value

    def set_state(self, state: str) -> None:
        self.current_state = state
        for s in STATES:
            self.state.labels(s).set(1 if s == state else 0)

    # -- serving ---------------------------------------------------------------------------

    def serve(self) -> int | None:
        raw = os.environ.get("ELASTIC_RUNNER_AGENT_METRICS_PORT", "0") or "0"
        try:
            port = int(raw)
        except ValueError:
            log.warning("ELASTIC_RUNNER_AGENT_METRICS_PORT=%r is not a port number; agent metrics are not served", raw)
            return None
        if port <= 0:
            return None
        bind = os.environ.get("ELASTIC_RUNNER_AGENT_METRICS_BIND") or (
            "0.0.0.0" if os.environ.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1")
        from prometheus_client import start_http_server

        try:
            self._server = start_http_server(port, addr=bind, registry=self.registry)
        except OSError as exc:
            log.warning("agent metrics: cannot serve on %s:%d (%s); the job runs without them", bind, port, exc.strerror)
            return None
        log.info("agent metrics: serving /metrics on http://%s:%d", bind, port)
        return port


class TorchMetricsBridge:
    """A ``torch.distributed.elastic.metrics.MetricHandler`` feeding :class:`AgentMetrics`."""

    _DURATION = re.compile(r"^(?P<op>.+)\.duration\.ms$")
    _OUTCOME = re.compile(r"^(?P<op>.+)\.(?P<outcome>success|failure)$")
    _WORKERS = re.compile(r"^workers\.[^.]+\.(?P<what>.+)$")

    def __init__(self, metrics: AgentMetrics) -> None:
        self.metrics = metrics

    def emit(self, metric_data: Any) -> None:
        name, value = metric_data.name, metric_data.value
        try:
            if m := self._WORKERS.match(name):
                what = m.group("what")
                if what == "remaining_restarts":
                    self.metrics.remaining_restarts.set(value)
                elif what.upper() in STATES and value:
                    self.metrics.set_state(what.upper())
            elif m := self._DURATION.match(name):
                self.metrics.operation_duration.labels(_short(m.group("op"))).observe(value / 1000.0)
            elif m := self._OUTCOME.match(name):
                self.metrics.operations.labels(_short(m.group("op")), m.group("outcome")).inc(value)
        except Exception:  # noqa: BLE001 - metrics must never take the agent down
            log.debug("could not export torch metric %s", name, exc_info=True)


def install_bridge(metrics: AgentMetrics) -> None:
    from torch.distributed.elastic import metrics as torch_metrics

    bridge = TorchMetricsBridge(metrics)

    class _Handler(torch_metrics.MetricHandler):  # type: ignore[misc]
        def emit(self, metric_data: Any) -> None:
            bridge.emit(metric_data)

    torch_metrics.configure(_Handler())  # default group: every torchelastic metric


def _short(operation: str) -> str:
    """``SimpleElasticAgent._rendezvous`` -> ``rendezvous`` (a bounded label set)."""
    return operation.rsplit(".", 1)[-1].lstrip("_")
