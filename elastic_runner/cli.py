"""``elastic-runner``: the command-line entry point.

    elastic-runner train --config FILE [--set k=v ...]    one worker (as python -m elastic_runner.train)
    elastic-runner launch [torchrun flags] -m elastic_runner.train ...   torchrun with elastic defaults
    elastic-runner snapshot inspect RUN_DIR               JSON summary of the snapshots
    elastic-runner snapshot export RUN_DIR --out FILE     plain model state_dict
    elastic-runner snapshot persist RUN_DIR               write this node's in-memory state to disk
    elastic-runner snapshot gc [--older-than 24h]         free node memory no run needs
    elastic-runner audit RUN_DIR                          exactly-once check of the audit trail
    elastic-runner config [FILE] [--set ...] [--docs]     validate / print the effective config
    elastic-runner data prepare-text IN.txt --out DIR     token files (character vocabulary) for data.name: tokens
    elastic-runner data index --config FILE               build the shard index of data.sources ahead of a job
    elastic-runner chaos --config FILE --run-dir DIR ...  break a local job on purpose, verify nothing was lost
    elastic-runner report RUN_DIR [--out run.png]         summary and timeline picture of a run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from . import __version__


def _audit(args: argparse.Namespace) -> int:
    from .observe.audit import check_audit
    from .observe.records_view import run_view

    from .snapshot import SnapshotError

    try:
        report = check_audit(run_view(args.run_dir, args.records_from))
    except (SnapshotError, OSError) as exc:
        print(f"elastic-runner audit: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.render())
    return 0 if report.ok else 1 if report.audited else 2


def _config(args: argparse.Namespace) -> int:
    from .config import ConfigError, dump_yaml, load_config, reference_markdown

    if args.docs:
        print(reference_markdown())
        return 0
    from .config.imports import check_references

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # import paths find modules here, as they do in a worker
    try:
        cfg = load_config(args.file, args.overrides)
        check_references(cfg)
    except ConfigError as exc:
        print(f"elastic-runner: config error: {exc}", file=sys.stderr)
        return 2
    print(dump_yaml(cfg), end="")
    return 0


def _data(args: argparse.Namespace) -> int:
    from .config import ConfigError
    from .data.tokens import prepare_text

    if args.data_cmd == "index":
        return _index(args)
    try:
        meta = prepare_text(args.input, args.out, args.val_fraction)
    except ConfigError as exc:
        print(f"elastic-runner: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: vocabulary of {meta['vocab_size']} characters, {meta['train_tokens']:,} training and "
          f"{meta['val_tokens']:,} validation tokens ({meta['dtype']}); train with data.name: tokens, "
          f"data.path: {args.out}")
    return 0


def _index(args: argparse.Namespace) -> int:
    """Every source's shard index, built where it is missing (what a job's first worker would do), and a summary."""
    from .config import ConfigError, load_config
    from .config.sources import parse_pack, parse_sources
    from .data.packing import load_tokenizer
    from .data.shards import index_directory, open_source

    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.data.sources is None:
            raise ConfigError("data.sources", "is not set", "This command builds the shard index of data.sources")
        pack = parse_pack(cfg.data.pack)
        tokenizer = load_tokenizer(cfg.data.tokenizer) if pack is not None else None
        for spec in parse_sources(cfg.data.sources):
            source = open_source(spec, pack, tokenizer)
            counted = tokenizer if pack is not None and spec.format != "tokens" else None
            unit = "windows" if pack is not None else "items"
            print(f"{spec.label}: {len(source.shards)} shards, {sum(s.tokens for s in source.shards):,} "
                  f"{'tokens' if pack is not None else 'items'}, {len(source):,} {unit}; index in "
                  f"{index_directory(spec, counted)}")
    except ConfigError as exc:
        print(f"elastic-runner: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_snapshot_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("snapshot", help="inspect or export a run's snapshots")
    ssub = p.add_subparsers(dest="snapshot_cmd", required=True)
    pi = ssub.add_parser("inspect", help="JSON summary of RUN_DIR's snapshots")
    pi.add_argument("run_dir")
    pi.add_argument("--verify", action="store_true", help="also check every checksum (reads every file)")
    pe = ssub.add_parser("export", help="write the newest model state_dict (no 'module.' prefixes)")
    pe.add_argument("run_dir")
    pe.add_argument("--out", required=True, help="output file, loadable with torch.load(FILE, weights_only=True)")
    pe.add_argument("--snapshot", default=None, help="a specific snapshot name instead of the newest")
    pp = ssub.add_parser("persist", help="write this node's in-memory copy of RUN_DIR's newest state to its "
                                         "snapshot directory (after a final snapshot failed for lack of space)")
    pp.add_argument("run_dir")
    pp.add_argument("--shm-dir", default=None, help="the node-memory base (default: ELASTIC_RUNNER_SHM_DIR or /dev/shm)")
    pg = ssub.add_parser("gc", help="remove this node's in-memory snapshots (/dev/shm) that no run needs")
    pg.add_argument("--older-than", default="24h", metavar="AGE",
                    help="also remove copies last written longer ago than AGE (30m, 24h, 7d; default 24h), even "
                         "if newer than their run's durable snapshots")
    pg.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    pg.add_argument("--shm-dir", default=None, help="the node-memory base (default: ELASTIC_RUNNER_SHM_DIR or /dev/shm)")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # `elastic-runner report RUN | head`: the reader left; say nothing more (no traceback) and
        # keep Python from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it


def _main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        # Hand over untouched: the worker has its own parser (and --local_rank).
        from .train import main as train_main

        return train_main(argv[1:])
    if argv and argv[0] == "launch":
        # torchrun's own parser handles every flag and PET_* variable.
        from .agent.launch import main as launch_main

        return launch_main(argv[1:])
    from .config import add_overrides_option

    parser = argparse.ArgumentParser(prog="elastic-runner", description="Elastic, fault-tolerant PyTorch training.")
    parser.add_argument("--version", action="version", version=f"elastic-runner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="run one training worker (see: elastic-runner train --help)")
    sub.add_parser("launch", help="torchrun with elastic defaults (see: elastic-runner launch --help)")

    _add_snapshot_parser(sub)
    pa = sub.add_parser("audit", help="replay RUN_DIR/audit and check every sample was used exactly once")
    pa.add_argument("run_dir")
    pa.add_argument("--json", action="store_true", help="machine-readable report")
    from .observe.records_view import RECORDS_FROM_HELP

    pa.add_argument("--records-from", default=None, metavar="URL", help=RECORDS_FROM_HELP)
    pc = sub.add_parser("config", help="validate a config and print the effective values")
    pc.add_argument("file", nargs="?", default=None)
    add_overrides_option(pc)
    pc.add_argument("--docs", action="store_true", help="print the config reference (Markdown)")
    pd = sub.add_parser("data", help="prepare datasets")
    dsub = pd.add_subparsers(dest="data_cmd", required=True)
    pt = dsub.add_parser("prepare-text", help="UTF-8 text -> train.bin/val.bin/meta.json (character tokens)")
    pt.add_argument("input", help="a UTF-8 text file")
    pt.add_argument("--out", required=True, help="directory for train.bin, val.bin and meta.json")
    pt.add_argument("--val-fraction", type=float, default=0.1, help="share of the text (its end) held out (0.1)")
    pi = dsub.add_parser("index", help="build the shard index of every one of data.sources, ahead of a job")
    pi.add_argument("--config", "-c", required=True, help="the job's YAML config")
    add_overrides_option(pi)
    from . import chaos
    from .observe import report

    chaos.add_parser(sub)
    report.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "snapshot":
        from .snapshot import cli as snapshot_cli  # imports torch: only when needed

        return snapshot_cli.run(args)
    if args.command == "audit":
        return _audit(args)
    if args.command == "config":
        return _config(args)
    if args.command == "data":
        return _data(args)
    if args.command == "chaos":
        return chaos.run(args)
    if args.command == "report":
        return report.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
