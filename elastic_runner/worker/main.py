"""The worker's command line: its arguments and config read, then the process run (:func:`.process.run`).

``python -m elastic_runner.train`` (:mod:`elastic_runner.train`, the door) and the agent's zygote, which forks
workers that never exec (:mod:`elastic_runner.agent.zygote`), both start here.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from ..config import ConfigError, add_overrides_option, load_config
from ..observe.logs import say
from ..env import EnvError, WorkerEnv
from ..lifecycle import EXIT_USAGE
from .process import run


class _WorkerArguments(argparse.ArgumentParser):
    """Every worker of a node parses the same command line: the node's terminal shows a mistake in it once."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            self.print_usage(sys.stderr)
            say(f"{self.prog}: error: {message}")
        sys.exit(EXIT_USAGE)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _WorkerArguments(prog="elastic-runner train", description="Train from a YAML config (one worker).")
    parser.add_argument("--config", "-c", required=True, help="YAML config file, e.g. configs/quickstart.yaml")
    add_overrides_option(parser)
    # torch.distributed.launch passed the local rank as an argument.
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@record
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        env = WorkerEnv.from_environ(legacy_local_rank=args.local_rank)
    except (ConfigError, EnvError) as exc:
        # Every worker of the node read the same file: the node's terminal shows the error once.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            say(f"elastic_runner: config error: {exc}")
        return EXIT_USAGE
    return run(cfg, env)

