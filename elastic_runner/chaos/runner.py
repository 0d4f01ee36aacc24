"""Run a chaos scenario: start the job, break it on schedule, watch it recover, judge it.

Faults are injected no earlier than their scheduled time and never while the
previous one is still being recovered from (plus ``settle_seconds``), so
every recovery is measured on its own. One line is printed per fault and per
recovery. At the end the invariants of :mod:`elastic_runner.chaos.verify` are
checked and a JSON and a Markdown report (and, with the ``report`` extra, the
timeline picture) are written to ``RUN_DIR/chaos/``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ..observe.audit import check_audit, latest_step
from ..config.locations import is_url
from ..observe.events import EventFollower, read_events
from ..observe.records_view import run_view
from ..testing.localjob import LocalJob
from ..training import injected_faults
from .faults import FAULTS, FaultContext, Skip
from .scenario import FaultSpec, Scenario, ScenarioError
from .verdict import verify
from .verify import History, Injected, Verdict, as_dicts, attribute_recoveries, generations, recovery_stats


class ChaosRun:
    def __init__(self, scenario: Scenario, out: Callable[[str], None] = print) -> None:
        self.s = scenario
        self.out = out
        self.run_dir = Path(scenario.run_dir)
        #: the job's events while it runs (on every node's own directory with private_dirs)
        self.live = EventFollower(self.run_dir, "node-*/events/*.jsonl" if scenario.private_dirs else "events/*.jsonl")
        self.history = History()  #: what judging a fault needs from them, kept up to date
        self.faults: list[Injected] = []
        self.t0 = 0.0
        self.replacements = 0  #: agents the supervisor started in place of lost ones
        self._injected_step = 0  #: the step the job had reached when the last fault was injected
        self._reaped_at = 0.0  #: when dead orphans were last collected
        self._short_since: float | None = None
        self.records = self.run_dir  #: where the verdict reads the run's records (a bucket's, fetched: private_dirs)
        self.location = ""  #: snapshot.dir of the job (a directory or a bucket's URL), read once by :meth:`run`

    def log(self, text: str) -> None:
        elapsed = time.time() - self.t0 if self.t0 else 0.0
        self.out(f"[{elapsed:7.1f}s] {text}")

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> tuple[Verdict, dict[str, Any]]:
        s = self.s
        s.validate()
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise ScenarioError(f"run directory {self.run_dir} is not empty: a chaos run starts from scratch, choose a new --run-dir")
        location = self.location = self._snapshot_location()
        if s.private_dirs and not is_url(location):
            raise ScenarioError(f"--private-dirs: the nodes share no directory, so snapshot.dir must be a bucket "
                                f"(s3://BUCKET/PREFIX or gs://...), not {location!r}: add --set snapshot.dir=s3://...")
        if is_url(location):
            _require_empty(location)
        # A NaN batch is skipped by rule (train.on_nonfinite: rollback): the reference, run after the job, skips the steps
        # the job skipped (train.skip_steps), or it could not match bitwise.
        skips = "nan-batch" in {f.type for f in s.faults} | set(s.random_types)
        with self._etcd() as etcd:
            reference = self._reference(etcd) if s.reference and not skips else None
            job = self._job(etcd, self.run_dir)
            try:
                finished, leftover = self._drive(job, etcd)
            finally:
                job.close()
            # With private directories, what the run recorded is what reached the bucket (a lost node took the rest).
            self.records = Path(run_view(location)) if s.private_dirs else self.run_dir
            events = read_events(self.records)
            attribute_recoveries(self.faults, events, self.s.hang_seconds)
            audit = check_audit(self.records)
            if s.reference and skips:
                reference = self._reference(etcd, f"train.skip_steps=[{','.join(map(str, audit.skipped_steps))}]")
        comparison = self._compare(reference, events) if reference is not None else None
        verdict = verify(audit=audit, events=events, faults=self.faults, leftover=leftover, finished=finished,
                         reference=comparison)
        report = self._report(verdict, events, audit.to_dict(), comparison)
        return verdict, report

    @contextlib.contextmanager
    def _etcd(self) -> Iterator[Any]:
        if self.s.rdzv_backend != "etcd-v3" or self.s.etcd_endpoint:
            yield None
            return
        from ..testing.etcd_server import EtcdServer

        server = EtcdServer(data_dir=self.run_dir.with_name(self.run_dir.name + "-etcd") / "data")
        server.start()
        self.out(f"etcd started on {server.endpoint} (pid {server.pid})")
        try:
            yield server
        finally:
            server.stop()

    def _job(self, etcd: Any, run_dir: Path, *extra: str) -> LocalJob:
        s = self.s
        endpoint = s.etcd_endpoint or (etcd.endpoint if etcd is not None else None)
        return LocalJob(config=s.config, run_dir=str(run_dir), overrides=[*s.overrides, "audit.samples=true", *extra],
                        nnodes=s.nnodes, nproc_per_node=s.nproc_per_node, rdzv_backend=s.rdzv_backend,
                        rdzv_endpoint=endpoint, launcher=s.launcher, max_restarts=1000,
                        separate_run_dirs=s.private_dirs and run_dir == self.run_dir,
                        # corrupt-param's hook in the workers (not in the reference run: nothing is injected there)
                        env={injected_faults.ENV: "1"} if run_dir == self.run_dir else {})

    def _reference(self, etcd: Any, *extra: str) -> dict[str, Any]:
        ref_dir = self.run_dir.with_name(self.run_dir.name + "-reference")
        self.out(f"reference run (no faults{', ' + ' '.join(extra) if extra else ''}) in {ref_dir}")
        # Its own snapshots, also when the scenario sets snapshot.dir: sharing them, the job under test
        # would start from the reference's final state.
        job = self._job(etcd, ref_dir, f"snapshot.dir={ref_dir / 'snapshots'}", *extra)
        try:
            for _ in range(self.s.reference_agents or self.s.agents):
                job.start_agent()
            codes = job.wait(timeout=self.s.timeout)
        finally:
            job.close()
        if any(c != 0 for c in codes):
            raise ScenarioError(f"the reference run failed (exit codes {codes}); see {ref_dir}/agent-*.log")
        return {"run_dir": str(ref_dir), "events": read_events(ref_dir)}

    def _drive(self, job: LocalJob, etcd: Any) -> tuple[bool, list[int]]:
        s = self.s
        location = self.location
        ctx = FaultContext(job=job, rng=random.Random(s.seed), min_agents=s.min_agents, max_agents=s.max_agents,
                           hang_seconds=s.hang_seconds, etcd=etcd,
                           snapshot_dir=None if is_url(location) else Path(location),
                           fill_seconds=s.fill_seconds, slow_seconds=s.slow_seconds)
        try:
            return self._inject(job, ctx)
        finally:
            ctx.close()  # a full volume is never left behind

    def _inject(self, job: LocalJob, ctx: FaultContext) -> tuple[bool, list[int]]:
        s = self.s
        for _ in range(s.agents):
            job.start_agent()
        self._wait_stepping(job)
        self.t0 = time.time()
        self.log(f"job stepping with {len(job.running_agents())} agent(s); injecting {len(s.schedule())} fault(s)")
        deadline = time.monotonic() + s.timeout
        announced: set[int] = set()
        pending = collections.deque(s.schedule())
        redraw = random.Random(s.seed + 1)  # replacements for skipped random faults (--count)
        while pending:
            spec = pending.popleft()
            while True:
                self._announce_recoveries(announced)
                self._supervise(job)
                self._reap(job)
                if not job.running_agents():
                    break
                # Wait for the last fault's outcome before the next (a recovery, or its absorption).
                waiting = self.faults and self.faults[-1].outcome is None and time.time() - self.faults[-1].at < 120
                if self._due(spec) and not waiting:
                    break
                if time.monotonic() > deadline:
                    raise ScenarioError(f"timed out after {s.timeout:.0f}s while waiting to inject {spec.type} "
                                        f"at {spec.when}")
                time.sleep(0.1)
            if not job.running_agents():
                self.log("the job ended before all faults were injected")
                break
            if self.faults and self.faults[-1].generation is not None:
                time.sleep(s.settle_seconds)
            at = time.time()
            reached = self._step()
            ctx.targets, ctx.struck_at = [], None
            try:
                description = FAULTS[spec.type](ctx)
            except Skip as why:
                self.log(f"skip   {spec.type}: {why}")
                if spec.drawn and s.count is not None:  # exactly --count faults: draw another one
                    last = max((p for p in pending if p.drawn), key=lambda p: p.at, default=spec)
                    pending.append(s.draw(redraw, last))
                continue
            self._injected_step = reached
            at = ctx.struck_at or at
            lasts = {"hang": s.hang_seconds, "fill-disk": s.fill_seconds, "slow-node": s.slow_seconds}.get(spec.type, 0.0)
            self.faults.append(Injected(type=spec.type, at=at, offset=round(at - self.t0, 2), description=description,
                                        lasts_s=lasts, targets=list(ctx.targets)))
            self.log(f"fault  {spec.type}: {description}")
        while job.running_agents() and time.monotonic() < deadline:
            self._announce_recoveries(announced)
            self._supervise(job)
            self._reap(job)
            time.sleep(0.2)
        self._announce_recoveries(announced)
        finished = not job.running_agents() and any(a.proc.returncode == 0 for a in job.agents)
        if job.running_agents():
            self.log(f"the job did not finish within {s.timeout:.0f}s")
        else:
            self.log(f"job ended; agent exit codes {[a.proc.returncode for a in job.agents]}")
        time.sleep(0.5)  # let orphans (if any) show up before we look
        return finished, job.leftover_processes()

    def _reap(self, job: LocalJob) -> None:
        """Every 2 s, collect the dead processes of killed agents (zombies of ours, as their subreaper)."""
        now = time.monotonic()
        if now - self._reaped_at > 2.0:
            job.reap_orphans()
            self._reaped_at = now

    def _supervise(self, job: LocalJob) -> None:
        """Keep ``--agents`` agents running, as a Kubernetes Job or PyTorchJob restarts a lost pod: an agent
        that was killed or preempted is replaced ``--supervise`` seconds after the job first ran short. Not
        once any agent has exited 0 (the job is finishing); joins above the target stay possible."""
        if self.s.supervise is None:
            return
        running = len(job.running_agents())
        if running >= self.s.agents or not running or any(a.proc.poll() == 0 for a in job.agents):
            self._short_since = None
            return
        now = time.monotonic()
        if self._short_since is None:
            self._short_since = now
        if now - self._short_since >= self.s.supervise:
            agent = job.start_agent()
            self.replacements += 1
            self._short_since = None
            self.log(f"supervisor: {running} of {self.s.agents} agents running; started agent {agent.index} "
                     f"(pid {agent.pid})")

    def _due(self, spec: FaultSpec) -> bool:
        if spec.after_steps is not None:
            return self._step() >= self._injected_step + spec.after_steps
        if spec.step is not None:
            return self._step() >= spec.step
        return time.time() - self.t0 >= spec.at

    def _wait_stepping(self, job: LocalJob) -> None:
        """Wait until every started agent trains in one world. An agent that starts a moment late
        misses the first round (1 s last call) and joins the next: faults timed from a world
        that is about to restart would hit the scale-up instead of the job asked for."""
        expected = self.s.agents * self.s.nproc_per_node
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            events = self._follow()
            full = {e["generation"] for e in events if e["kind"] == "world" and e["world_size"] == expected}
            if any(e["kind"] in ("first_step", "progress") and e.get("generation") in full for e in events):
                return
            if not job.running_agents():
                raise ScenarioError(f"the job ended before it started stepping with all {self.s.agents} agents:\n"
                                    f"{job.logs_tail()}")
            time.sleep(0.2)
        raise ScenarioError(f"the job did not start stepping at world size {expected} ({self.s.agents} agents x "
                            f"{self.s.nproc_per_node}) within 300 s:\n{job.logs_tail()}")

    def _announce_recoveries(self, announced: set[int]) -> None:
        self._follow()
        # Only the faults from the first undecided one on: the others were judged (and announced) already.
        first = next((i for i, f in enumerate(self.faults) if f.outcome is None), len(self.faults))
        attribute_recoveries(self.faults[first:], self.history, self.s.hang_seconds)
        for i, f in enumerate(self.faults[first:], start=first):
            if i in announced or f.outcome is None:
                continue
            announced.add(i)
            if f.outcome != "recovered":
                self.log(f"{f.outcome} {f.type}: " + ("training went on in the same attempt" if f.outcome == "absorbed"
                                                      else "it landed as the job finished"))
                continue
            tier = f"from {f.resumed_tier} " if f.resumed_tier else ""
            lost = f", {f.steps_recomputed} step(s) recomputed" if f.steps_recomputed is not None else ""
            self.log(f"recovered from {f.type} in {f.recovery_s:.2f}s: generation {f.generation}, world size "
                     f"{f.world_size}, resumed step {f.resumed_step} {tier}{lost}".replace("  ", " "))

    def _follow(self) -> list[dict[str, Any]]:
        """The job's events so far; the new ones also go into :attr:`history`."""
        self.history.add(self.live.read_new())
        return self.live.events

    def _step(self) -> int:
        """The highest step the job has started (over every node's directory with private_dirs)."""
        if not self.s.private_dirs:
            return latest_step(self.run_dir)
        return max((latest_step(node) for node in self.run_dir.glob("node-*")), default=0)

    def _snapshot_location(self) -> str:
        from ..config import ConfigError, load_config

        try:
            cfg = load_config(self.s.config, list(self.s.overrides) + [f"run.dir={self.run_dir}"])
        except ConfigError as exc:
            raise ScenarioError(f"the training config does not load: {exc}") from exc
        return str(cfg.snapshot_dir)

    # -- judging ----------------------------------------------------------------------------------

    def _compare(self, reference: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
        sizes = stepping_world_sizes(events)
        ref_sizes = stepping_world_sizes(reference["events"])
        if self.s.bitwise and not (len(sizes) == 1 and sizes == ref_sizes):
            return {"ok": False, "mode": "bitwise", "detail": f"bitwise asked for, but the job trained at world "
                    f"size(s) {sorted(sizes)} and the reference at {sorted(ref_sizes)}: only a run that trains at "
                    "the reference's world size throughout can match it bitwise"}
        if len(sizes) == 1 and sizes == ref_sizes:
            import torch

            from ..snapshot.cli import export

            out = self.run_dir / "chaos"
            out.mkdir(parents=True, exist_ok=True)
            export(self.location if self.s.private_dirs else str(self.run_dir), str(out / "model.pt"))
            export(reference["run_dir"], str(out / "reference-model.pt"))
            a = torch.load(out / "model.pt", weights_only=True)
            b = torch.load(out / "reference-model.pt", weights_only=True)
            same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            return {"ok": same, "mode": "bitwise", "detail": "final model bitwise identical to the reference"
                    if same else "final model differs from the reference although the world size never changed"}
        (ours, what), (ref, _) = _final_loss(events), _final_loss(reference["events"])
        if ours is None or ref is None:
            return {"ok": False, "mode": "loss", "detail": "no final loss recorded"}
        ok = abs(ours - ref) <= self.s.loss_tolerance * abs(ref) + 1e-3
        return {"ok": ok, "mode": "loss", "loss": ours, "reference_loss": ref,
                "detail": f"final {what} loss {ours:.4f} vs reference {ref:.4f} (tolerance {self.s.loss_tolerance:.0%}; "
                          f"world sizes {sorted(sizes)})"}

    def _report(self, verdict: Verdict, events: list[dict[str, Any]], audit: dict[str, Any],
                comparison: dict[str, Any] | None) -> dict[str, Any]:
        out = self.run_dir / "chaos"
        out.mkdir(parents=True, exist_ok=True)
        gens = generations(events)
        stepping = [e for e in events if e["kind"] in ("progress", "first_step", "end")]
        total = (max(e["time"] for e in stepping) - self.t0) if stepping and self.t0 else 0.0
        stats = recovery_stats(self.faults)
        uptime = 1.0 - (stats.get("sum_s", 0.0) / total) if total > 0 else None
        report = {
            "ok": verdict.ok,
            "scenario": {k: v for k, v in vars(self.s).items() if k != "faults"} | {
                "faults": [vars(f) for f in self.s.faults]},
            "faults": as_dicts(self.faults),
            "recovery": stats,
            "replacements": self.replacements,
            "goodput": _goodput_of(self.records, events),
            "outcomes": {o: sum(1 for f in self.faults if f.outcome == o) for o in ("recovered", "absorbed", "job ended")}
            | {"undecided": sum(1 for f in self.faults if f.outcome is None)},
            "steps_recomputed": [f.steps_recomputed for f in self.faults if f.steps_recomputed is not None],
            "uptime_fraction": round(uptime, 4) if uptime is not None else None,
            "wall_seconds": round(total, 2),
            "generations": len(gens),
            "checks": {name: {"ok": ok, "detail": detail} for name, (ok, detail) in verdict.checks.items()},
            "reference": comparison,
            "audit": audit,
        }
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "report.md").write_text(render_markdown(report))
        with contextlib.suppress(Exception):
            from ..observe.report import render_timeline

            render_timeline(str(self.records), str(out / "timeline.png"), events=events)
            report["timeline"] = str(out / "timeline.png")
        return report


def _require_empty(location: str) -> None:
    """A chaos run starts from scratch in the bucket too: objects under ``location`` would be resumed from (and
    their records judged with the run's)."""
    from ..object_client import open_filesystem

    try:
        fs, prefix = open_filesystem(location)
        found = fs.find(prefix.rstrip("/"), maxdepth=None, withdirs=False, detail=False)
    except FileNotFoundError:
        return
    except Exception as exc:  # noqa: BLE001 - credentials, endpoint, bucket: said in one line
        raise ScenarioError(f"cannot list snapshot.dir {location} ({type(exc).__name__}: {str(exc)[:200]}): check "
                            "AWS_ENDPOINT_URL and the credentials, and that the bucket exists") from exc
    if found:
        raise ScenarioError(f"snapshot.dir {location} already holds {len(found)} object(s): a chaos run starts from "
                            "scratch, choose a new prefix")


def _goodput_of(run_dir: Path, events: list[dict[str, Any]]) -> dict[str, Any] | None:
    from ..observe.report import summarize

    try:
        summary = summarize(str(run_dir), events)
    except (ValueError, KeyError) as exc:  # a run that never stepped has no goodput
        return {"error": str(exc)}
    return summary.goodput.to_dict() if summary.goodput is not None else None


def stepping_world_sizes(events: list[dict[str, Any]]) -> set[int]:
    """The world sizes of the generations that took a step (a round that ended before its first step, e.g. a
    node lost right after it formed and replaced at once, does not change the arithmetic)."""
    stepped = {e["generation"] for e in events if e["kind"] in ("first_step", "progress")}
    return {e["world_size"] for e in events if e["kind"] == "world" and e["generation"] in stepped}


def _final_loss(events: list[dict[str, Any]]) -> tuple[float | None, str]:
    """The run's final test loss (its last evaluation), else the loss of its last progress line (one batch's)."""
    evals = [e for e in events if e["kind"] == "eval" and isinstance(e.get("eval_loss"), (int, float))]
    if evals:
        return float(max(evals, key=lambda e: (e["step"], e["time"]))["eval_loss"]), "test"
    progress = [e for e in events if e["kind"] == "progress" and "loss" in e]  # (a window of skipped steps has none)
    if not progress:
        return None, "training"
    last = max(progress, key=lambda e: (e["step"], e["generation"]))
    return float(last["loss"]), "training"


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# Chaos report: {'PASSED' if report['ok'] else 'FAILED'}", ""]
    lines += ["| check | result | detail |", "|---|---|---|"]
    for name, check in report["checks"].items():
        lines.append(f"| {name} | {'ok' if check['ok'] else '**violated**'} | {check['detail']} |")
    r = report["recovery"]
    good = report.get("goodput") or {}
    lost = ", ".join(f"{cause} {seconds} s" for cause, seconds in (good.get("lost_s") or {}).items() if seconds)
    lines += ["", f"Wall time {report['wall_seconds']} s, {report['generations']} generation(s), uptime fraction "
              f"{report['uptime_fraction']}, goodput {good.get('goodput')}" + (f" (lost: {lost})" if lost else "") + ".",
              ""]
    if r.get("count"):
        lines.append(f"Recovery: min {r['min_s']} s, median {r['median_s']} s, max {r['max_s']} s over {r['count']} fault(s).")
    lines += ["", "| t (s) | fault | what | outcome | recovery (s) | resumed step | from | steps recomputed | world size |",
              "|---|---|---|---|---|---|---|---|---|"]
    for f in report["faults"]:
        lines.append(f"| {f['offset']} | {f['type']} | {f['description']} | {f.get('outcome')} | {f['recovery_s']} | "
                     f"{f['resumed_step']} | {f['resumed_tier']} | {f['steps_recomputed']} | {f['world_size']} |")
    return "\n".join(lines) + "\n"
