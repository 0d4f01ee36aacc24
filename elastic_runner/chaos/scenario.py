"""A chaos scenario: the job to run and the faults to inject, from CLI options or YAML."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FAULT_TYPES = ("kill-worker", "kill-agent", "kill-node", "join", "hang", "preempt", "restart-etcd", "corrupt-snapshot",
               "fill-disk", "slow-node", "corrupt-param", "nan-batch", "spare-takeover")


class ScenarioError(ValueError):
    """A scenario option or file that cannot work, with what to change."""


@dataclass
class FaultSpec:
    at: float  #: seconds after all started agents train in one world (when ``step`` is None)
    type: str
    step: int | None = None  #: or: once the job has started this step (the same experiment on any machine)
    #: or (random by step): once the job has run this many steps since the previous fault was injected.
    #: Relative, not a fixed plan: the steps run while a fault is judged (an absorbed one needs seconds of
    #: training to tell) would otherwise let the job run ahead of the plan and end before its last fault.
    after_steps: int | None = None
    drawn: bool = False  #: drawn at random (``--faults``): a skipped one is replaced when ``count`` is set

    @property
    def when(self) -> str:
        if self.after_steps is not None:
            return f"{self.after_steps} steps after the previous fault"
        return f"step {self.step}" if self.step is not None else f"{self.at:g} s"


@dataclass
class Scenario:
    config: str
    run_dir: str
    overrides: list[str] = field(default_factory=list)
    nnodes: str = "1:3"
    agents: int = 2
    nproc_per_node: int = 1
    rdzv_backend: str = "c10d"
    etcd_endpoint: str | None = None  #: an existing etcd; None with etcd-v3 starts one
    launcher: str = "elastic-runner"
    faults: list[FaultSpec] = field(default_factory=list)
    random_types: list[str] = field(default_factory=list)
    every: tuple[float, float] = (8.0, 15.0)
    #: Random faults every MIN:MAX steps instead of seconds (``every`` is then unused).
    every_steps: tuple[int, int] | None = None
    #: Exactly this many random faults (a skipped one is drawn again), instead of until ``duration``.
    count: int | None = None
    seed: int = 0
    duration: float = 60.0  #: no new faults after this many seconds of stepping
    hang_seconds: float = 4.0
    fill_seconds: float = 8.0  #: how long fill-disk keeps the snapshot volume full
    slow_seconds: float = 10.0  #: how long slow-node keeps a node's workers throttled
    #: Replace a killed or preempted agent after this many seconds, keeping ``agents`` running (None: never).
    supervise: float | None = None
    settle_seconds: float = 1.0  #: after a recovery, before the next fault
    reference: bool = False
    #: Require the final model to be bitwise the reference's (implies ``reference``): for runs whose every step
    #: trained at the reference's world size (worker kills, graceful stops, a lost node replaced before the job
    #: trains without it); off by default, as soaks that change the world size match in distribution only.
    bitwise: bool = False
    #: Agents of the fault-free reference run (default: ``agents``); the final losses are compared unless
    #: both runs kept one world size.
    reference_agents: int | None = None
    loss_tolerance: float = 0.1
    timeout: float = 600.0
    #: Every agent its own run.dir (``RUN_DIR/node-N``), as nodes without a shared filesystem have: snapshot.dir
    #: must be a bucket; a lost node (kill-node) takes its directory and memory along; the verdict reads the run's
    #: records back from the bucket.
    private_dirs: bool = False

    @property
    def min_agents(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_agents(self) -> int:
        return int(self.nnodes.split(":")[-1])

    def validate(self) -> None:
        if not Path(self.config).is_file():
            raise ScenarioError(f"config {self.config!r} not found: pass --config with an existing YAML file")
        try:
            lo, hi = self.min_agents, self.max_agents
        except ValueError as exc:
            raise ScenarioError(f"nnodes {self.nnodes!r} must be MIN:MAX, e.g. 1:3") from exc
        if not 1 <= lo <= hi:
            raise ScenarioError(f"nnodes {self.nnodes!r}: need 1 <= MIN <= MAX")
        if not lo <= self.agents <= hi:
            raise ScenarioError(f"agents={self.agents} must lie within nnodes {self.nnodes}")
        if self.bitwise and self.reference_agents is not None and self.reference_agents != self.agents:
            raise ScenarioError(f"bitwise needs the reference at the job's own size: reference_agents="
                                f"{self.reference_agents} differs from agents={self.agents}")
        if self.reference_agents is not None and not lo <= self.reference_agents <= hi:
            raise ScenarioError(f"reference_agents={self.reference_agents} must lie within nnodes {self.nnodes}")
        wanted = [f.type for f in self.faults] + list(self.random_types)
        for t in wanted:
            if t not in FAULT_TYPES:
                raise ScenarioError(f"unknown fault {t!r}: choose from {', '.join(FAULT_TYPES)}")
        on_disk = sorted({t for t in wanted if t in ("corrupt-snapshot", "fill-disk")})
        if self.private_dirs and on_disk:
            raise ScenarioError(f"{' and '.join(on_disk)} damage a snapshot directory; with private_dirs the snapshots "
                                "are in a bucket: leave them out")
        if "restart-etcd" in wanted and self.rdzv_backend != "etcd-v3":
            raise ScenarioError("restart-etcd needs --rdzv-backend etcd-v3")
        if "restart-etcd" in wanted and self.etcd_endpoint is not None:
            raise ScenarioError("restart-etcd needs an etcd the chaos tool starts itself (omit --etcd-endpoint)")
        if self.rdzv_backend not in ("c10d", "etcd-v3"):
            raise ScenarioError(f"rdzv backend {self.rdzv_backend!r}: use c10d or etcd-v3")
        if self.every[0] <= 0 or self.every[1] < self.every[0]:
            raise ScenarioError(f"every={self.every}: need 0 < MIN <= MAX seconds")
        if self.every_steps is not None and not 0 < self.every_steps[0] <= self.every_steps[1]:
            raise ScenarioError(f"every_steps={self.every_steps}: need 0 < MIN <= MAX steps")
        if self.count is not None and (self.count < 1 or not self.random_types):
            raise ScenarioError(f"count={self.count}: give a positive number of faults and the types to draw (--faults)")
        if self.slow_seconds <= 0:
            raise ScenarioError(f"slow_seconds={self.slow_seconds}: give the seconds a node stays slow (> 0)")
        if "slow-node" in wanted:
            self._check_stragglers_can_be_named(self._job_config())
        if "corrupt-param" in wanted:
            self._check_replicas_are_compared(self._job_config())
        if "nan-batch" in wanted:
            self._check_nonfinite_rolls_back(self._job_config())
        if set(wanted) & {"corrupt-param", "nan-batch"}:
            self._check_rollbacks_allowed(self._job_config())
        if self.fill_seconds <= 0:
            raise ScenarioError(f"fill_seconds={self.fill_seconds}: give the seconds the volume stays full (> 0)")
        if self.supervise is not None and self.supervise < 0:
            raise ScenarioError(f"supervise={self.supervise}: give the seconds before a lost agent is replaced (>= 0)")
        if self.every_steps is not None and self.count is None:
            raise ScenarioError("random faults by step (--every-steps) need --count N: a step has no end like --duration")
        by_step = {f.step is not None for f in self.faults} | ({self.every_steps is not None} if self.random_types else set())
        if len(by_step) > 1:
            raise ScenarioError("faults are placed either by time (T:TYPE, --every) or by step (step:N:TYPE, "
                                "--every-steps), not both in one scenario")

    def _job_config(self) -> Any:
        """The job's config with the scenario's overrides, or None where it is wrong (the job itself says how)."""
        from ..config import ConfigError, load_config

        try:
            return load_config(self.config, list(self.overrides))
        except ConfigError:
            return None

    def _check_stragglers_can_be_named(self, cfg: Any) -> None:
        """slow-node's verdict needs the job to name stragglers within the slow seconds: its config must let it."""
        if cfg is None:
            return
        why = None
        if cfg.recovery.straggler_ratio is None:
            why = "recovery.straggler_ratio is null (nobody is named)"
        elif cfg.parallel.strategy != "ddp" or cfg.dist.gradient_sync != "ordered":
            why = "stragglers are named under parallel.strategy: ddp with dist.gradient_sync: ordered only"
        elif cfg.recovery.straggler_window_seconds >= self.slow_seconds:
            why = (f"recovery.straggler_window_seconds ({cfg.recovery.straggler_window_seconds:g}) is not shorter than "
                   f"slow_seconds ({self.slow_seconds:g}): the node would be fast again before it could be named; "
                   "--set recovery.straggler_window_seconds=3, or a longer --slow-seconds")
        if why:
            raise ScenarioError(f"slow-node: {why}")

    def _check_replicas_are_compared(self, cfg: Any) -> None:
        """corrupt-param's verdict needs the job to compare its replicas' fingerprints: its config must let it."""
        if cfg is None:
            return
        if not cfg.fingerprints:
            raise ScenarioError("corrupt-param: the job compares no fingerprints (recovery.fingerprint_every_steps: "
                                "null, or not parallel.strategy: ddp with dist.gradient_sync: ordered), so a flipped "
                                "bit would go unseen; leave recovery.fingerprint_every_steps at auto or set a number")

    @staticmethod
    def _check_nonfinite_rolls_back(cfg: Any) -> None:
        """nan-batch's verdict needs the job to roll back from a non-finite loss, not stop or skip."""
        if cfg is not None and cfg.train.on_nonfinite != "rollback":
            raise ScenarioError(f"nan-batch: the job's train.on_nonfinite is {cfg.train.on_nonfinite} (a NaN loss would "
                                "stop it, or be skipped unrecorded); --set train.on_nonfinite=rollback")

    def _check_rollbacks_allowed(self, cfg: Any) -> None:
        """Each flipped bit and each NaN batch costs a rollback: the job must not stop at recovery.max_rollbacks."""
        if cfg is None:
            return
        kinds = ("corrupt-param", "nan-batch")
        rollbacks = sum(f.type in kinds for f in self.faults) + (
            self.count or 0 if set(kinds) & set(self.random_types) else 0)
        if rollbacks > cfg.recovery.max_rollbacks:
            raise ScenarioError(f"corrupt-param, nan-batch: up to {rollbacks} rollback(s), but the job stops at the "
                                f"rollback after recovery.max_rollbacks ({cfg.recovery.max_rollbacks}), as it must for "
                                f"a fault no rollback cures; --set recovery.max_rollbacks={rollbacks}")

    def schedule(self) -> list[FaultSpec]:
        """The fixed faults plus random ones (seeded): ``count`` of them, or until ``duration`` seconds; by
        time or by step, in order."""
        planned = list(self.faults)
        if self.random_types:
            rng = random.Random(self.seed)
            last: FaultSpec | None = None
            while self.count is None or sum(f.drawn for f in planned) < self.count:
                spec = self.draw(rng, last)
                if self.count is None and spec.at >= self.duration:
                    break
                planned.append(spec)
                last = spec
        return sorted(planned, key=lambda f: f.at)

    def draw(self, rng: random.Random, after: FaultSpec | None) -> FaultSpec:
        """The next random fault, one interval after ``after`` (or after the start)."""
        kind = rng.choice(self.random_types)
        if self.every_steps is not None:
            steps = rng.randint(*self.every_steps)
            return FaultSpec(at=(after.at if after is not None else 0.0) + steps, type=kind, after_steps=steps,
                             drawn=True)  # ``at``: the order only
        return FaultSpec(at=round((after.at if after is not None else 0.0) + rng.uniform(*self.every), 2), type=kind,
                         drawn=True)


def parse_fault_list(text: str) -> list[FaultSpec]:
    """``"10:kill-worker,25:join"`` -> faults at 10 s and 25 s; ``"step:200:kill-worker"`` -> once the job
    has started step 200."""
    faults = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        if item.startswith("step:"):
            _, n, kind = (item.split(":", 2) + ["", ""])[:3]
            if not n.isdigit() or not kind:
                raise ScenarioError(f"fault {item!r}: write step:STEP:TYPE, e.g. step:200:kill-worker")
            faults.append(FaultSpec(at=float(n), type=kind.strip(), step=int(n)))
            continue
        at, sep, kind = item.partition(":")
        if not sep:
            raise ScenarioError(f"fault {item!r}: write SECONDS:TYPE or step:STEP:TYPE, e.g. 10:kill-worker")
        try:
            faults.append(FaultSpec(at=float(at), type=kind.strip()))
        except ValueError as exc:
            raise ScenarioError(f"fault {item!r}: {at!r} is not a number of seconds") from exc
    return faults


def load_scenario_file(path: str) -> Scenario:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"cannot read scenario {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ScenarioError(f"scenario {path!r} must be a mapping of options")
    faults = [FaultSpec(at=float(f.get("at", f.get("step", 0))), type=str(f["type"]),
                        step=int(f["step"]) if "step" in f else None) for f in data.pop("faults", []) or []]
    rand = data.pop("random", None) or {}
    known = set(Scenario.__dataclass_fields__) - {"faults", "random_types", "every", "seed", "every_steps", "count"}
    unknown = set(data) - known
    if unknown:
        raise ScenarioError(f"scenario {path!r}: unknown option(s) {sorted(unknown)}; valid: {sorted(known | {'faults', 'random'})}")
    scenario = Scenario(**data, faults=faults)
    if rand:
        scenario.random_types = list(rand.get("types", []))
        scenario.every = tuple(rand.get("every", scenario.every))  # type: ignore[assignment]
        scenario.every_steps = tuple(rand["every_steps"]) if "every_steps" in rand else None  # type: ignore[assignment]
        scenario.count = int(rand["count"]) if "count" in rand else None
        scenario.seed = int(rand.get("seed", 0))
    return scenario
