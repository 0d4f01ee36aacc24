"""``elastic-runner chaos``: break a live local job on purpose and prove nothing was lost.

    elastic-runner chaos --config configs/quickstart.yaml --run-dir runs/chaos1 \\
        --faults kill-worker,kill-agent,kill-node,join,hang,preempt,corrupt-snapshot --every 6:10 --seed 1 --duration 60
    elastic-runner chaos --config configs/quickstart.yaml --run-dir runs/chaos2 --set snapshot.dir=/mnt/small \\
        --at step:200:fill-disk --fill-seconds 10
    elastic-runner chaos --scenario scenario.yaml

Exit status 0 when every invariant held, 1 when one was violated, 2 for a
scenario that cannot run.
"""

from __future__ import annotations

import argparse
import signal
import sys

from .scenario import FAULT_TYPES, Scenario, ScenarioError, load_scenario_file, parse_fault_list


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("chaos", help="inject faults into a local elastic job and verify it lost nothing",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="training config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--scenario", help="YAML scenario file (options below override it)")
    p.add_argument("--run-dir", help="run directory for the job (must be new); reports go to RUN_DIR/chaos/")
    p.add_argument("--nnodes", default=None, help="MIN:MAX agents (default 1:3)")
    p.add_argument("--agents", type=int, default=None, help="agents at the start (default 2)")
    p.add_argument("--nproc-per-node", type=int, default=None)
    p.add_argument("--rdzv-backend", choices=["c10d", "etcd-v3"], default=None)
    p.add_argument("--etcd-endpoint", default=None, help="use this etcd instead of starting one")
    p.add_argument("--launcher", choices=["elastic-runner", "torchrun"], default=None)
    p.add_argument("--at", default=None, metavar="T:TYPE,...",
                   help="faults at fixed times (seconds after all agents train together), e.g. 10:kill-worker,25:join, "
                        "or at steps (the same experiment on any machine): step:200:kill-worker,step:450:join")
    p.add_argument("--faults", default=None, help=f"fault types drawn at random intervals: {', '.join(FAULT_TYPES)}")
    p.add_argument("--every", default=None, metavar="MIN:MAX", help="random interval between faults in seconds (default 8:15)")
    p.add_argument("--every-steps", default=None, metavar="MIN:MAX", help="random faults by steps instead of seconds: "
                   "each one MIN-MAX steps after the previous one was injected (needs --count)")
    p.add_argument("--count", type=int, default=None, help="inject exactly this many random faults (a skipped one is "
                   "drawn again) instead of until --duration")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="no new faults after this many seconds (default 60)")
    p.add_argument("--hang-seconds", type=float, default=None, help="how long a hung worker stays stopped (default 4)")
    p.add_argument("--fill-seconds", type=float, default=None,
                   help="how long fill-disk keeps the snapshot volume full (default 8; the volume must be small, "
                        "at most 2 GiB free: put snapshot.dir on a tmpfs)")
    p.add_argument("--slow-seconds", type=float, default=None,
                   help="how long slow-node keeps a node's workers throttled to a quarter of their compute (default 10)")
    p.add_argument("--supervise", type=float, default=None, metavar="SECONDS",
                   help="keep --agents agents running: replace a killed or preempted agent after SECONDS, as a "
                        "Kubernetes Job restarts a lost pod (default: lost agents stay lost)")
    p.add_argument("--reference", action="store_true", help="first run the config without faults and compare the final models")
    p.add_argument("--bitwise", action="store_true",
                   help="require the final model to be bitwise the reference's (implies --reference): for runs that "
                        "train at one world size throughout; off by default, as soaks that change it match in distribution")
    p.add_argument("--loss-tolerance", type=float, default=None, help="relative final-loss tolerance when the world size changed (default 0.1)")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (default 600)")
    p.add_argument("--private-dirs", action="store_true",
                   help="give every agent its own run.dir (RUN_DIR/node-N), as nodes without a shared filesystem "
                        "have: snapshot.dir must be a bucket (s3://, gs://); kill-node deletes the node's directory "
                        "and memory; the audit and report are read from the bucket")


def build_scenario(args: argparse.Namespace) -> Scenario:
    given = {
        "config": args.config, "run_dir": args.run_dir, "nnodes": args.nnodes, "agents": args.agents,
        "nproc_per_node": args.nproc_per_node, "rdzv_backend": args.rdzv_backend, "etcd_endpoint": args.etcd_endpoint,
        "launcher": args.launcher, "seed": args.seed, "duration": args.duration, "hang_seconds": args.hang_seconds,
        "fill_seconds": args.fill_seconds, "slow_seconds": args.slow_seconds,
        "loss_tolerance": args.loss_tolerance, "timeout": args.timeout, "supervise": args.supervise,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if args.scenario:
        scenario = load_scenario_file(args.scenario)
        for key, value in given.items():
            setattr(scenario, key, value)
    else:
        if not args.config or not args.run_dir:
            raise ScenarioError("give --config and --run-dir (or a --scenario file)")
        scenario = Scenario(**given)
    scenario.overrides = list(scenario.overrides) + list(args.overrides)
    if args.at:
        scenario.faults = parse_fault_list(args.at)
    if args.faults:
        scenario.random_types = [f.strip() for f in args.faults.split(",") if f.strip()]
    if args.every:
        lo, _, hi = args.every.partition(":")
        try:
            scenario.every = (float(lo), float(hi or lo))
        except ValueError as exc:
            raise ScenarioError(f"--every {args.every!r}: write MIN:MAX seconds, e.g. 8:15") from exc
    if args.every_steps:
        lo, _, hi = args.every_steps.partition(":")
        if not lo.isdigit() or not (hi or lo).isdigit():
            raise ScenarioError(f"--every-steps {args.every_steps!r}: write MIN:MAX steps, e.g. 100:300")
        scenario.every_steps = (int(lo), int(hi or lo))
    if args.count is not None:
        scenario.count = args.count
    if args.reference:
        scenario.reference = True
    if args.bitwise:
        scenario.bitwise = True
    if args.private_dirs:
        scenario.private_dirs = True
    if scenario.bitwise:
        scenario.reference = True
    if not scenario.faults and not scenario.random_types:
        raise ScenarioError("no faults to inject: give --at, --faults or a scenario with faults/random")
    return scenario


def run(args: argparse.Namespace) -> int:
    from .runner import ChaosRun

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # SIGTERM's default action skips every `finally`: turn it into an exception so
    # the job's processes are always stopped (by PID) before we exit.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    try:
        scenario = build_scenario(args)
        verdict, report = ChaosRun(scenario, out=lambda line: print(line, flush=True)).run()
    except ScenarioError as exc:
        print(f"elastic-runner chaos: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("elastic-runner chaos: interrupted; the job's processes were stopped", file=sys.stderr)
        return 130
    print()
    for name, (ok, detail) in verdict.checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    r = report["recovery"]
    if r.get("count"):
        print(f"recovery min/median/max: {r['min_s']}/{r['median_s']}/{r['max_s']} s over {r['count']} fault(s); "
              f"uptime {report['uptime_fraction']}")
    print(f"report: {scenario.run_dir}/chaos/report.md")
    return 0 if verdict.ok else 1

