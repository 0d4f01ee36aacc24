"""Prometheus instruments of a worker, in the project's own registry.

Names follow Prometheus conventions: prefix ``elastic_runner_``, base units in
the name, ``_total`` for counters, bounded labels only (``rank``). Counters
that describe the whole job rather than this process (restarts, membership
changes, recoveries) are restored from the snapshot and exported through a
custom collector, because a prometheus_client ``Counter`` cannot start at a
restored value.

Each worker serves ``/metrics`` on ``metrics.port + LOCAL_RANK``. A busy port
or ``metrics.port: 0`` never stops training: a warning, then the instruments
are still updated (cheap) but not served.
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import __version__

log = logging.getLogger(__name__)

# One series per instrument: the *_created timestamps double the series for no use here.
disable_created_metrics()

PREFIX = "elastic_runner_"
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SAVE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _JobCounters(Collector):
    """Job-level totals that survive process restarts (restored from snapshots)."""

    def __init__(self, rank: str) -> None:
        self.rank = rank
        self.values: dict[str, float] = {
            "restarts": 0, "membership_changes": 0, "recoveries": 0,
        }
        self.gauges: dict[str, float] = {"resume_generation": 0}
        self.help = {
            "restarts": "Worker-group restarts torchrun performed on this node (TORCHELASTIC_RESTART_COUNT).",
            "membership_changes": "Times the world size changed between training attempts.",
            "recoveries": "Training attempts that resumed from a snapshot.",
            "resume_generation": "Generation (training attempt number) of this process.",
        }

    def collect(self) -> Iterable[Metric]:
        for name, value in self.values.items():
            family = CounterMetricFamily(PREFIX + name, self.help[name], labels=["rank"])
            family.add_metric([self.rank], value)
            yield family
        for name, value in self.gauges.items():
            gauge = GaugeMetricFamily(PREFIX + name, self.help[name], labels=["rank"])
            gauge.add_metric([self.rank], value)
            yield gauge


class Metrics:
    def __init__(self, rank: int, local_rank: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rank = str(rank)
        self.local_rank = local_rank
        self.port: int | None = None
        self._server: Any = None
        r = self.registry
        labels = ["rank"]

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=r).labels(self.rank)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(self.rank)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(self.rank)

        self.steps = counter("steps", "Optimizer steps completed by this process.")
        self.samples = counter("samples", "Training samples this rank consumed.")
        self.step_duration = histogram("step_duration_seconds", "Wall time of one optimizer step.", STEP_BUCKETS)
        self.data_wait = histogram("data_wait_seconds", "Time per step spent waiting for input batches.", STEP_BUCKETS)
        self.loss = gauge("loss", "Training loss (mean over the global batch) at the last logged step.")
        self.lr = gauge("learning_rate", "Learning rate of the first parameter group.")
        self.step = gauge("step", "Current optimizer step of the job.")
        self.epoch = gauge("epoch", "Current epoch.")
        self.world_size = gauge("world_size", "Ranks in the current training attempt.")
        self.global_batch = gauge("global_batch_size", "Samples per optimizer step over all ranks.")
        self.micro_batch = gauge("micro_batch_size", "Largest micro-batch per rank.")
        self.accumulation = gauge("accumulation_steps", "Gradient-accumulation micro-steps per optimizer step.")
        self.snapshot_blocking = histogram("snapshot_blocking_seconds", "Time a snapshot save blocked training (copy to host).", SAVE_BUCKETS)
        self.snapshot_write = histogram("snapshot_write_seconds", "Time to serialise, fsync and publish a snapshot (background).", SAVE_BUCKETS)
        self.snapshot_size = gauge("snapshot_size_bytes", "Size of the newest snapshot.")
        self.snapshot_last = gauge("last_snapshot_timestamp_seconds", "Unix time of the newest published snapshot.")
        self.snapshot_failures = counter("snapshot_failures", "Snapshot writes that failed.")
        self.snapshot_interval = gauge("snapshot_interval_steps", "Steps between periodic snapshots chosen by "
                                       "snapshot.every_steps: auto.")
        self.memory_interval = gauge("memory_interval_steps", "Steps between refreshes of a sharded model's node-memory "
                                     "copy (snapshot.memory_every_steps).")
        self.recovery = gauge("recovery_duration_seconds", "This worker's start in the attempt to its first completed "
                              "step, for a resumed attempt: its process's start, or where it kept its process "
                              "(recovery.in_process), when it took its place or rebuilt its group.")
        self.recomputed = gauge("steps_recomputed", "Steps redone after the last failure (progress lost).")
        self.goodput = gauge("goodput_ratio", "Share of the job's wall time spent on steps that count (not recomputed, "
                             "not restarting or waiting for rendezvous, not blocked by snapshots), at the last logged step.")
        self.eval_loss = gauge("eval_loss", "Test loss at the last evaluation (reduced over ranks).")
        self.eval_accuracy = gauge("eval_accuracy_ratio", "Test accuracy at the last evaluation (0..1).")
        self.eval_metric = Gauge(PREFIX + "eval_metric", "Every metric of the last evaluation (eval.metrics).",
                                 ["rank", "metric"], registry=r)
        self.nonfinite = counter("nonfinite_steps", "Steps whose gradient was not finite and that were skipped "
                                 "(train.on_nonfinite: skip).")
        self.step_local = gauge("step_local_seconds", "This rank's local time per step (batches, forward, backward, "
                                "update: all but the wait for the gradient sync), over the last logging window.")
        self.step_local_ratio = gauge("step_local_ratio", "This rank's local time per step over the median rank's, "
                                      "over the last logging window (recovery.straggler_ratio).")
        self.straggler = gauge("straggler", "1 while this rank is named a straggler (recovery.straggler_ratio).")
        self.fingerprint_checks = counter("fingerprint_checks", "Checks of the replicas' fingerprints "
                                          "(recovery.fingerprint_every_steps).")
        self.fingerprint_interval = gauge("fingerprint_interval_steps", "Steps between fingerprint checks (chosen "
                                          "from their measured cost under recovery.fingerprint_every_steps: auto).")
        self.verified_step = gauge("verified_step", "The newest step whose replicas' fingerprints agreed: a "
                                   "rollback returns to a snapshot of this step or before.")
        self.job = _JobCounters(self.rank)
        r.register(self.job)
        build = Info(PREFIX + "build", "Versions of this worker.", registry=r)
        import torch

        build.info({
            "version": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": str(torch.version.cuda or "none"),
        })

    # -- serving ---------------------------------------------------------------------------

    def serve(self, base_port: int, bind: str = "auto") -> int | None:
        if base_port <= 0:
            log.debug("metrics.port is 0: /metrics is not served")
            return None
        from prometheus_client import start_http_server

        address = bind
        if bind == "auto":
            address = "0.0.0.0" if os.environ.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1"
        port = base_port + self.local_rank
        try:
            self._server = start_http_server(port, addr=address, registry=self.registry)
        except OSError as exc:
            log.warning("metrics: cannot serve on %s:%d (%s); training continues without /metrics. "
                        "Choose a free metrics.port (each worker uses port + LOCAL_RANK).", address, port, exc.strerror)
            return None
        self.port = port
        log.info("metrics: serving /metrics on http://%s:%d", address, port)
        return port

    def close(self) -> None:
        server = self._server[0] if isinstance(self._server, tuple) else self._server
        if server is not None and hasattr(server, "shutdown"):
            server.shutdown()
            server.server_close()
        self._server = None

    def set_eval(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.eval_metric.labels(self.rank, name).set(value)
        if "loss" in metrics:
            self.eval_loss.set(metrics["loss"])
        if "accuracy" in metrics:
            self.eval_accuracy.set(metrics["accuracy"])

    # -- job-level state ---------------------------------------------------------------------

    def restore(self, counters: dict[str, Any]) -> None:
        for key in ("membership_changes", "recoveries"):
            if key in counters:
                self.job.values[key] = float(counters[key])

    def set_restarts(self, value: int) -> None:
        self.job.values["restarts"] = float(value)

    def set_generation(self, generation: int) -> None:
        self.job.gauges["resume_generation"] = float(generation)
