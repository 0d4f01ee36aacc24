"""``elastic-runner launch``: torchrun with defaults that suit elastic jobs.

Same flags as ``torchrun`` (and the same ``PET_*`` environment variables,
which Kubernetes manifests use); everything is passed through to torch's own
launcher. What it changes, each overridable:

- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch's shared rendezvous
  store, a node joining a running job makes the rank-0 agent fail with
  ``DistStoreError ... role_info`` and take the job down, and restarted gloo
  workers can read the previous round's addresses and hang. Workers then use
  their own store on rank 0's node. Set it to 0 to get torch's behaviour.
- Rendezvous settings (``--rdzv_conf``, only keys you did not set):
  ``last_call_timeout=1`` (torch: 30 s): once the minimum number of nodes is
  present, wait 1 s for more instead of 30 before starting; a node that comes
  later joins through one extra round. ``keep_alive_interval=1``,
  ``keep_alive_max_attempt=3``: a dead node is dropped from the rendezvous
  after 3 s instead of 15 s; fewer than 3 s risks split brain (a live but
  busy node declared dead).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

log = logging.getLogger(__name__)

RDZV_DEFAULTS: dict[str, str] = {
    "last_call_timeout": "1",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
}
ENV_DEFAULTS: dict[str, str] = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}


def merge_rdzv_conf(given: str, defaults: dict[str, str] = RDZV_DEFAULTS) -> str:
    """Add our defaults for keys the user did not set; keep the user's order and values."""
    items = [kv for kv in (given or "").split(",") if kv.strip()]
    present = {kv.split("=", 1)[0].strip() for kv in items}
    items += [f"{k}={v}" for k, v in defaults.items() if k not in present]
    return ",".join(items)


def apply_defaults(argv: Sequence[str]) -> "object":
    """Parse torchrun's flags (and PET_* variables) and apply our defaults."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(list(argv))
    if args.rdzv_backend != "static" or args.standalone:
        args.rdzv_conf = merge_rdzv_conf(args.rdzv_conf)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = apply_defaults(sys.argv[1:] if argv is None else argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
    except ChildFailedError as exc:
        # torchrun prints the failure table; we only set the exit status.
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
