"""The sections that define how a run is operated: snapshots, audit, metrics, logging, process group.

None of these changes the mathematics of a run; they may change between attempts of one run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import ConfigError, _help
from .locations import location_problem


@dataclass
class SnapshotConfig:
    """Snapshots: where, how often, how many, and the node-memory tier."""

    every_steps: int | Literal["auto"] = _help(
        "Write a durable snapshot every N steps (0: off), or 'auto': the interval that minimises snapshot cost plus "
        "expected redone work (Young/Daly), from the measured cost of a snapshot and the mean time between losses "
        "of the whole job (snapshot.mtbf_hours, learned as the run goes); recomputed after every snapshot and logged.",
        default=50)
    every_seconds: float = _help("Also write one when this many seconds passed since the last (0: off).", default=0.0)
    keep_last: int = _help("Complete snapshots to keep; older ones are deleted once a newer one is complete.", default=3)
    mtbf_hours: float = _help(
        "For every_steps: auto, the prior mean time between losses of the whole job (every node at once, or a "
        "failure without snapshot.in_memory: what only the disk snapshot survives).", default=24.0)
    dir: str | None = _help(
        "Where snapshots live (default: RUN_DIR/snapshots): a directory every node mounts, or an object-store URL "
        "(s3://BUCKET/PREFIX for S3 and S3-compatible services, gs://BUCKET/PREFIX; extras s3, gcs) with run.dir a "
        "local directory on each node. Credentials and endpoint the usual way (AWS_* variables and files, "
        "AWS_ENDPOINT_URL, a pod or instance role; GCS application-default credentials), never in the URL.",
        default=None)
    records_every_seconds: float = _help(
        "With snapshot.dir in object storage: every N seconds each node uploads what it appended to its run.dir's "
        "records (events, audit trail; the effective config) to SNAPSHOT_DIR/records, and each worker once more when "
        "it ends; a node lost with its disk loses at most the last N seconds of its records.", default=15.0)
    async_write: bool = _help(
        "Write periodic snapshots in the background; the step only waits for the copy of the state "
        "into host memory. At most one write is in flight.",
        default=True,
    )
    writer: Literal["auto", "process", "thread"] = _help(
        "Where a background write runs: process (a writer process fed through shared memory: serialisation, "
        "SHA-256 and fsync never hold the training's interpreter, and a CPU state is copied beside the next "
        "forward/backward: a 100 MB state blocks the step ~2 ms instead of ~11), thread (in the worker: cheaper "
        "for a small state), or auto: process for a state of 8 MB or more, thread below.",
        default="auto",
    )
    verify: bool = _help("Check each snapshot's SHA-256 before loading it.", default=True)
    mode: Literal["private", "group"] = _help(
        "Who may read what the run writes (snapshots, node-memory copies, events, audit, effective config): "
        "private (files 0600, directories 0700, the snapshot directory must be this user's) or group (0640/0750, "
        "for a team that shares a volume).",
        default="private",
    )
    allow_mismatch: bool = _help(
        "Resume even if the snapshot was written for a different model/data/optimizer "
        "config (e.g. to fine-tune). The differing keys are logged.",
        default=False,
    )
    resume_from: str | None = _help(
        "Start this run from another run's newest intact snapshot (its snapshot directory, or a bucket's URL), on "
        "purpose: only while this run has no snapshot of its own; read, never changed. Without it a snapshot that "
        "another run wrote (copied into this run's directory) is moved aside, never resumed from.",
        default=None,
    )
    in_memory: bool = _help(
        "When an attempt ends (a peer failed, torchrun restarts the group, SIGTERM), every "
        "surviving node keeps its newest step in shared memory (/dev/shm); the next start "
        "takes the newest step any node holds, so a failure with a survivor loses at most "
        "one step. Costs nothing during training.",
        default=True,
    )

    memory_every_steps: int | Literal["auto"] = _help(
        "Sharded models (parallel.strategy fsdp, hsdp): every N steps each rank copies its shards into its node's "
        "memory (and, with memory_replicas, to another node's), in the background; after a failure the job resumes "
        "from the newest step whose shards the surviving nodes hold together, without a disk read. 'auto': the "
        "interval that minimises refresh cost plus redone work (Young/Daly) from the measured cost of a refresh and "
        "the mean time between failures (snapshot.memory_mtbf_hours, learned as the run goes), the same on every "
        "rank, at most every_steps when that is a number; first refresh at step 10. 0: off (a failure resumes from "
        "the disk snapshot). A replicated model (ddp) keeps its newest step when an attempt ends instead.",
        default="auto",
    )
    memory_mtbf_hours: float = _help(
        "For memory_every_steps: auto, the prior mean time between failures of any worker or node of the job (each "
        "makes the job redo the steps since the last node-memory refresh).", default=6.0)
    memory_replicas: int = _help(
        "Sharded models: 1 also keeps each node's shards in the memory of the next node (in rank order), so the loss "
        "of any one node resumes from memory; 0: own node only. hsdp's nodes hold every shard already (nothing is "
        "sent).",
        default=1,
    )

    def validate(self) -> None:
        if self.memory_every_steps != "auto" and self.memory_every_steps < 0:
            raise ConfigError("snapshot.memory_every_steps", f"got {self.memory_every_steps}, must be >= 0",
                              "Set it to e.g. 10, auto, or 0 to keep sharded state on disk only")
        if not self.memory_mtbf_hours > 0:
            raise ConfigError("snapshot.memory_mtbf_hours", f"got {self.memory_mtbf_hours}, must be > 0",
                              "Set it to the hours you expect between failures of any worker or node, e.g. 6")
        if self.memory_replicas not in (0, 1):
            raise ConfigError("snapshot.memory_replicas", f"got {self.memory_replicas}", "Use 1 (a copy on the next node) or 0")
        if self.every_steps != "auto" and self.every_steps < 0:
            raise ConfigError("snapshot.every_steps", f"got {self.every_steps}, must be >= 0",
                              "Set it to e.g. 50, 0 to disable, or auto")
        if not self.mtbf_hours > 0:
            raise ConfigError("snapshot.mtbf_hours", f"got {self.mtbf_hours}, must be > 0",
                              "Set it to the hours you expect between losses of the whole job, e.g. 24")
        if self.every_seconds < 0:
            raise ConfigError("snapshot.every_seconds", f"got {self.every_seconds}, must be >= 0", "Set it to e.g. 300, or 0 to disable")
        if self.keep_last < 1:
            raise ConfigError("snapshot.keep_last", f"got {self.keep_last}, must be >= 1", "Set snapshot.keep_last to e.g. 3")
        if not self.records_every_seconds > 0:
            raise ConfigError("snapshot.records_every_seconds", f"got {self.records_every_seconds}, must be > 0",
                              "Set it to e.g. 15")
        for key, value in (("snapshot.dir", self.dir), ("snapshot.resume_from", self.resume_from)):
            problem = location_problem(value) if value else None
            if problem is not None:
                raise ConfigError(key, *problem)


@dataclass
class AuditConfig:
    """The audit trail of consumed samples."""

    samples: bool = _help(
        "Append one JSON line per rank per step with the dataset indices it consumed "
        "(RUN_DIR/audit/); 'elastic-runner audit RUN_DIR' checks exactly-once delivery.",
        default=False,
    )


@dataclass
class MetricsConfig:
    """The worker's Prometheus endpoint."""

    port: int = _help(
        "Serve Prometheus /metrics on port + LOCAL_RANK (0: off).", default=0
    )
    bind: str = _help(
        "Address to bind: 'auto' is all interfaces inside Kubernetes (KUBERNETES_SERVICE_HOST "
        "set) and 127.0.0.1 elsewhere.",
        default="auto",
    )

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("metrics.port", f"got {self.port}, must be 0..65535", "Set metrics.port to e.g. 9400, or 0 to disable")


@dataclass
class LoggingConfig:
    """Log level and progress output."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _help("Log level.", default="INFO")
    every_steps: int = _help(
        "Every N steps the loss and rate are read: a progress line (step/total, epoch, loss, samples/s, ETA; also an "
        "event), or the bar's fields where a bar shows.", default=10)
    format: Literal["text", "json"] = _help("Progress line format.", default="text")
    progress_bar: Literal["auto", "on", "off"] = _help(
        "Progress bar on rank 0 (tqdm): steps of the total, epoch, loss, samples/s (tokens/s for a language model), "
        "elapsed and ETA; log records are written above it. auto shows it only when stdout is a terminal; where it "
        "shows, the per-N-steps lines are left to the event log.", default="auto"
    )

    def validate(self) -> None:
        if self.every_steps <= 0:
            raise ConfigError("logging.every_steps", f"got {self.every_steps}, must be positive", "Set logging.every_steps to e.g. 10")


@dataclass
class DistConfig:
    """The process group: backend, device, timeouts and the peer watchdog."""

    backend: Literal["auto", "gloo", "nccl"] = _help(
        "Process-group backend: auto picks nccl when the device is a GPU, gloo otherwise.",
        default="auto",
    )
    device: Literal["auto", "cpu", "cuda"] = _help(
        "auto: cuda:LOCAL_RANK when CUDA is available, else cpu.", default="auto"
    )
    timeout_seconds: float = _help("Timeout of one collective operation.", default=300.0)
    init_timeout_seconds: float = _help(
        "Process-group creation plus the first collective must finish within this time "
        "after a (re)start, or the attempt ends with a clear error instead of hanging.",
        default=30.0,
    )
    heartbeat_seconds: float = _help(
        "A peer whose heartbeat stops for this long (dead node, SIGSTOP, wedged process) "
        "ends the attempt on every rank, also with NCCL whose own timeout is minutes. 0: off.",
        default=5.0,
    )
    gradient_sync: Literal["ordered", "ddp"] = _help(
        "How the gradients are summed over the ranks. ordered: in a bucket layout fixed by the model, so a "
        "resumed run does exactly the arithmetic of an uninterrupted one at every world size; ddp: torch's "
        "DistributedDataParallel, whose first step after every (re)start uses a bucket layout of its own "
        "(bitwise resume below three ranks only).",
        default="ordered",
    )

    def validate(self) -> None:
        if self.gradient_sync not in ("ordered", "ddp"):
            raise ConfigError("dist.gradient_sync", f"got {self.gradient_sync!r}", "Use ordered (default) or ddp")
        if self.heartbeat_seconds < 0:
            raise ConfigError("dist.heartbeat_seconds", f"got {self.heartbeat_seconds}, must be >= 0", "Set it to e.g. 5, or 0 to disable")
        for key in ("timeout_seconds", "init_timeout_seconds"):
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(f"dist.{key}", f"got {value}, must be positive", f"Set dist.{key} to e.g. 30")


@dataclass
class RecoveryConfig:
    """How a job recovers from a failed worker."""

    in_process: bool | Literal["auto"] = _help(
        "Workers keep their process (its interpreter, CUDA context, datasets, DataLoader workers and model with its "
        "compiled code) through a recovery: a worker killed or crashed while its node and rank 0's worker live is "
        "replaced alone and the others rebuild only their process group; for a node that joins or is lost (or "
        "another node's restart) the workers park at a step boundary and take their place in the new rendezvous "
        "round. A worker that cannot park yet, a script's model through elastic_runner.fit, and torch's own agent "
        "restart as without it. auto: true for a replicated model (parallel.strategy: ddp), false for a sharded one "
        "(fsdp, hsdp: in process its shards are kept in node memory at the periodic refreshes only, so a park or a "
        "peer's failure would recompute the steps since, where a restart saves the step it stopped at). false: every "
        "recovery ends every worker and starts new ones (forked from the zygote).",
        default="auto",
    )
    standby: bool = _help(
        "With in_process: each node keeps one standby worker, forked ahead with the config read and the model and "
        "datasets built (a compiled model's forward and backward traced on the first items), that takes a failed "
        "worker's place instead of a new process: the survivors wait for the process group only, not for a start. "
        "Costs one more copy of the model and datasets in each node's memory (on the CPU until it takes a place); "
        "false starts a new process for each failed worker.",
        default=True,
    )
    regroup: Literal["auto", "reconfigure", "recreate"] = _help(
        "With in_process: how the survivors rebuild their process group with a replacement. reconfigure: torch's "
        "process-group reconfigure (torch >= 2.14, gloo): the group's connections are swapped in place, a few "
        "milliseconds. recreate: the group is destroyed and created again in the same process (any torch and "
        "backend, ~0.1 s). auto: reconfigure where this torch build and backend have it and the model is "
        "replicated (ddp), else recreate.",
        default="auto",
    )
    health_check: bool = _help(
        "Before a node takes part in its first rendezvous round, its agent checks the devices its workers will use: "
        "present, and computing a fixed matmul of small integers exactly (in a child process where a GPU driver "
        "is installed); and, for gloo workers of a job that spans machines, that this machine's hostname does not "
        "resolve to a loopback address (where gloo would listen out of the other nodes' reach; a warning where the "
        "job may run on this machine alone). A node that fails leaves with one line and exit status 5, and costs the "
        "others no round.",
        default=True,
    )
    straggler_ratio: float | None = _help(
        "A rank whose local time per step (its batches, forward, backward and update: all but the wait for the "
        "gradient sync, timed with no host sync) is at least this many times the median rank's for more than half "
        "of the last recovery.straggler_window_seconds, or summed over that window with no logging window of it "
        "below halfway between 1 and the ratio, is named a straggler: a warning with its rank and node, a "
        "straggler event (with its host), and elastic_runner_straggler 1 on its metrics endpoint; cleared once it "
        "was that slow for a quarter of the window or less and its sum over the window no longer names it. "
        "Read at logging steps. Names ranks under parallel.strategy: ddp with dist.gradient_sync: ordered; elsewhere "
        "a rank waits for its peers inside forward or backward (fsdp's gathers, torch DDP's reducer), where a slow "
        "rank cannot be told from a waiting one, and only the timings are exported. null: off (nothing timed).",
        default=1.3,
    )
    straggler_window_seconds: float = _help(
        "For straggler_ratio: the span over which a rank is judged, in seconds spent stepping (a restore or an "
        "evaluation between steps does not count): named once it was that slow for more than half of it (a window "
        "below the ratio now and then does not start the count again) or over all of it, so what slows a rank for a "
        "moment (a snapshot, a page-cache miss, a shared machine's scheduler) names nobody.", default=60.0)
    evict_stragglers: bool = _help(
        "For straggler_ratio: a node named a straggler leaves the job and is kept out for exclusion_seconds: its "
        "agent records the exclusion in the rendezvous (etcd-v3 or c10d), stops its workers as a preempted node's "
        "does, and exits with status 6 (its line and a Kubernetes termination message say why); the other nodes go "
        "on without it (their workers kept, in process). An excluded node's agent that starts again before the time "
        "is up leaves at once with the same status. Never takes the job below --nnodes' minimum.", default=False)
    exclusion_seconds: float = _help(
        "For evict_stragglers: how long an evicted node is refused (it may join again after).", default=3600.0)
    fingerprint_every_steps: int | Literal["auto"] | None = _help(
        "Silent corruption (a flipped bit, a miscomputing device) told from bitwise replicas: every this many steps "
        "(at a logging step, and at the last step) each rank sums its parameters and optimizer state as integers on "
        "its device, and the sums ride in the all-reduce of the logged loss; a rank whose sum differs from the "
        "majority's is named (a story line, a replica_mismatch event with its host), and the job rolls back: the "
        "snapshots taken after the last step whose sums agreed are moved aside (corrupt-*, with a REASON) and "
        "removed from node memory, and every worker restarts from the newest state a check vouched for. Two "
        "replicas that differ cannot say which one is wrong: both roll back. Under parallel.strategy: hsdp each rank "
        "sums its shards and is compared with the ranks that hold the same shard on the other nodes (two nodes: two "
        "replicas). auto: on for ddp with dist.gradient_sync: ordered and for hsdp (where replicas are bitwise "
        "identical), as often as costs at most 1 % of step time (measured); off elsewhere (fsdp has no replicas). A number asks for it (and is refused where replicas differ by "
        "design). null: off.", default="auto")
    max_rollbacks: int = _help(
        "For fingerprint_every_steps and train.on_nonfinite: rollback: after this many rollbacks (of both kinds) "
        "within rollback_window_seconds, the next mismatch stops the job (exit status 3, not restarted) naming the "
        "suspect ranks and nodes, and the next non-finite step too: a device that keeps corrupting its replica needs "
        "a person (or its node taken out), a run that diverges whatever batch it skips a lower learning rate.",
        default=3)
    rollback_window_seconds: float = _help(
        "For max_rollbacks: the window in which rollbacks are counted (from the run directory's events).",
        default=3600.0)

    def validate(self) -> None:
        every = self.fingerprint_every_steps
        if every is not None and every != "auto" and (isinstance(every, bool) or not isinstance(every, int)
                                                      or every < 1):
            raise ConfigError("recovery.fingerprint_every_steps", f"got {every!r}, must be a whole number >= 1",
                              "Set it to e.g. 100, auto (as often as costs 1 % of step time), or null (off)")
        if isinstance(self.max_rollbacks, bool) or not isinstance(self.max_rollbacks, int) or self.max_rollbacks < 0:
            raise ConfigError("recovery.max_rollbacks", f"got {self.max_rollbacks!r}, must be a whole number >= 0",
                              "Set it to e.g. 3 (0: the first mismatch stops the job)")
        if isinstance(self.rollback_window_seconds, bool) or not isinstance(self.rollback_window_seconds, (int, float)) \
                or not 0 < self.rollback_window_seconds < float("inf"):
            raise ConfigError("recovery.rollback_window_seconds", f"got {self.rollback_window_seconds!r}, must be "
                              "> 0", "Set it to e.g. 3600")
        if self.straggler_ratio is not None and not (isinstance(self.straggler_ratio, (int, float))
                                                     and 1 < self.straggler_ratio < float("inf")):
            raise ConfigError("recovery.straggler_ratio", f"got {self.straggler_ratio!r}, must be a number > 1 (a "
                              "ratio of 1 or less would name the median rank itself)",
                              "Set it to e.g. 1.3, or null to name no stragglers")
        if not isinstance(self.evict_stragglers, bool):
            raise ConfigError("recovery.evict_stragglers", f"got {self.evict_stragglers!r}, must be true or false",
                              "Set it to true (a straggler's node leaves the job) or false")
        if self.evict_stragglers and self.straggler_ratio is None:
            raise ConfigError("recovery.evict_stragglers", "is true but recovery.straggler_ratio is null (no rank is "
                              "ever named a straggler)", "Set recovery.straggler_ratio, e.g. 1.3")
        if isinstance(self.exclusion_seconds, bool) or not isinstance(self.exclusion_seconds, (int, float)) or \
                not 0 < self.exclusion_seconds < float("inf"):
            raise ConfigError("recovery.exclusion_seconds", f"got {self.exclusion_seconds!r}, must be > 0",
                              "Set it to e.g. 3600")
        if not 0 < self.straggler_window_seconds < float("inf"):
            raise ConfigError("recovery.straggler_window_seconds", f"got {self.straggler_window_seconds!r}, must be "
                              "> 0", "Set it to e.g. 60")


@dataclass
class ParallelConfig:
    """How the model is spread over the ranks: replicated whole (ddp) or sharded (fsdp, hsdp)."""

    strategy: Literal["ddp", "fsdp", "hsdp"] = _help(
        "ddp: every rank holds the whole model, its gradients and optimizer state (dist.gradient_sync says how the "
        "gradients are summed). fsdp: FSDP2 (torch.distributed.fsdp.fully_shard) over all ranks: each rank holds "
        "1/W of the parameters, gradients and optimizer state, and a snapshot is written by every rank, its own "
        "shards only. hsdp: shard within a node, replicate across nodes (a nodes x nproc_per_node mesh; every node "
        "must run the same number of workers). A snapshot of any strategy resumes under any other, at any world size.",
        default="ddp",
    )
    wrap: str | list[str] = _help(
        "The modules sharded as one unit (fsdp, hsdp): a list of class names (e.g. [Block]), or auto: the gpt "
        "model's blocks, a HuggingFace model's _no_split_modules, else each direct child that has parameters. "
        "The root module is always sharded too (what is left).",
        default="auto",
    )
    reshard_after_forward: bool = _help(
        "Free the gathered parameters after each unit's forward pass and gather them again for the backward pass "
        "(least memory); false keeps them to the backward pass (less communication). The root's own parameters "
        "(those outside every unit) are kept either way: the backward pass needs them first.",
        default=True,
    )
    mixed_precision: Literal["none", "bf16"] = _help(
        "none: compute and reduce in the parameters' dtype. bf16: the gathered parameters are cast to bfloat16 for "
        "forward and backward, the gradients reduced in float32 (sharded parameters and optimizer state stay "
        "float32). For GPUs; on CPU bf16 is slow.",
        default="none",
    )
    offload: bool = _help(
        "Keep the sharded parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy), "
        "moved to the GPU only while used; needs a CUDA device.",
        default=False,
    )

    @property
    def sharded(self) -> bool:
        return self.strategy in ("fsdp", "hsdp")

    def validate(self) -> None:
        if self.strategy not in ("ddp", "fsdp", "hsdp"):
            raise ConfigError("parallel.strategy", f"got {self.strategy!r}", "Use ddp (default), fsdp or hsdp")
        if isinstance(self.wrap, str):
            if self.wrap != "auto":
                raise ConfigError("parallel.wrap", f"got {self.wrap!r}",
                                  "Use auto, or a list of module class names such as [Block]")
        elif not (isinstance(self.wrap, list) and self.wrap
                  and all(isinstance(n, str) and n.isidentifier() for n in self.wrap)):
            raise ConfigError("parallel.wrap", f"got {self.wrap!r}",
                              "Use auto, or a non-empty list of module class names such as [Block]")
        if self.mixed_precision not in ("none", "bf16"):
            raise ConfigError("parallel.mixed_precision", f"got {self.mixed_precision!r}", "Use none or bf16")
        if not self.sharded and (self.offload or self.mixed_precision != "none" or self.wrap != "auto"):
            key = "offload" if self.offload else "mixed_precision" if self.mixed_precision != "none" else "wrap"
            raise ConfigError(f"parallel.{key}", f"applies to parallel.strategy fsdp or hsdp, not {self.strategy}",
                              f"Set parallel.strategy: fsdp, or remove parallel.{key}")
