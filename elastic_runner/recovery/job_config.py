"""The configuration a running job trains with, so that a node with another one is refused before it joins.

A node that joins a running job (a spare beyond ``--nnodes``' maximum, a replacement, one more node) with a
configuration that differs from the job's would cost every node a round, or worse: a different ``optim.lr`` trains
on silently with replicas that are no longer bitwise the same, a different ``logging.every_steps`` hangs a
collective, a different model fails its workers' first resume. So the round's first node records the job's
configuration in the rendezvous' own store (:class:`~.channel.JobConfig`, signed with the job's key), at each round
and again every :data:`REFRESH_S` while the job runs, and a node that starts reads it before its first round: where
a key differs it leaves with exit status 2 and one line naming the keys (its agent: :mod:`elastic_runner.agent.
config_check`).

What is compared (:func:`digest`): every key of the workers' config (``--config`` with its ``--set`` overrides; a
free-form value such as ``model.params`` as a whole), but
the node's own (:data:`NODE_LOCAL`: where it writes, its ports, its log's look, its loader processes); for a script of
the user's own (``elastic_runner.fit``), the script's bytes (not its arguments, which often name a node's own
paths); and torch's and elastic_runner's versions. Only the config's section.key names and hashes go into the
store, never a value or a path; with the job's key the hashes are keyed (HMAC), so that a reader of the store
without the key cannot guess even a value from a small set (``optim.lr: 0.1``) by hashing candidates.

A record is the job's only while the job runs: one older than :data:`STALE_S` (the job stopped; its rendezvous id
used again with another configuration) is not compared against. The round's first node does not write over a fresh
record of another node that differs from its own (a node that got in unchecked, in the job's first round, cannot
make its configuration the job's). Nodes of the job's first round have nothing to read yet: they are compared by the
snapshots they resume (:mod:`elastic_runner.training.compatibility`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import sys
import time
from typing import Any, Callable, Sequence

from .channel import Channel, JobConfig
from .exclusions import scope_context

log = logging.getLogger(__name__)

#: Keys that may differ from node to node: they say where a node writes, how it is watched and how its log looks,
#: and how many loader processes it runs, not what the job computes or when its collectives run.
NODE_LOCAL: frozenset[str] = frozenset({
    "run.dir", "snapshot.dir", "data.num_workers", "logging.level", "logging.format", "logging.progress_bar",
    "recovery.health_check", "recovery.standby",
})
#: Sections whose every key is a node's own (how it is watched).
NODE_LOCAL_SECTIONS: frozenset[str] = frozenset({"metrics"})
#: Seconds between the round's first node's records of the job's configuration while the job runs (one store write,
#: from a thread of its own).
REFRESH_S = 2.0
#: A record older than this is a stopped job's (its writer was lost, or the job ended): not compared against, so that
#: the job's rendezvous id can be used again with another configuration a few seconds after the job ended, however it
#: ended. On etcd-v3 the record's lease is this long. A record dated more than this into the future (clocks apart) is
#: not compared against either.
STALE_S = 3 * REFRESH_S
_HASH_CHARS = 12


def node_local_keys() -> str:
    """:data:`NODE_LOCAL` and :data:`NODE_LOCAL_SECTIONS`, for a line that says what may differ by node."""
    return ", ".join(sorted(NODE_LOCAL) + [f"{section}.*" for section in sorted(NODE_LOCAL_SECTIONS)])


def _hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]


def _keys(cfg: Any) -> Any:
    """``(section.key, value)`` of ``cfg``: one level, so that a free-form value (``model.params``, ``data.sources``)
    is hashed whole and its own keys, which may name paths or buckets, never reach the store."""
    for section, body in cfg.to_dict().items():
        for key, value in body.items():
            yield f"{section}.{key}", value


def _versions() -> dict[str, Any]:
    import torch

    from .. import __version__

    return {"torch": torch.__version__, "elastic_runner": __version__}


def digest(cfg: Any | None = None, script: Sequence[str] | None = None) -> dict[str, str]:
    """``{dotted key: hash}`` of what must be the same on every node of a job: ``cfg``'s keys (a
    :class:`~elastic_runner.config.Config`) but :data:`NODE_LOCAL`; or, for a script of the user's own, the
    script's bytes (``script[0]``, a path; its arguments are not compared: they often name a node's own paths);
    and the versions of torch and elastic_runner."""
    out = {key: _hash(value) for key, value in _versions().items()}
    if cfg is not None:
        out |= {key: _hash(value) for key, value in _keys(cfg)
                if key not in NODE_LOCAL and key.split(".", 1)[0] not in NODE_LOCAL_SECTIONS}
    elif script:
        try:
            with open(script[0], "rb") as source:
                out["script"] = hashlib.sha256(source.read()).hexdigest()[:_HASH_CHARS]
        except OSError:  # (a module, -m NAME: its name)
            out["script"] = _hash(str(script[0]))
    return out


def keyed(keys: dict[str, str], key: bytes | None) -> dict[str, str]:
    """``keys`` as the store holds them: each hash keyed with the job's key (HMAC-SHA256), where there is one."""
    if key is None:
        return dict(keys)
    return {k: hmac.new(key, f"{k}={v}".encode(), hashlib.sha256).hexdigest()[:_HASH_CHARS] for k, v in keys.items()}


def encode(keys: dict[str, str]) -> str:
    return json.dumps(keys, sort_keys=True, separators=(",", ":"))


def decode(text: str) -> dict[str, str] | None:
    """The keys of a record's ``digest``; None where it is not a mapping of strings (nobody's word)."""
    try:
        keys = json.loads(text)
    except ValueError:
        return None
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        return None
    return keys


def differing(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The keys whose hashes differ, or that one side has and the other not, sorted."""
    return sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))


class JobConfigs:
    """The record of job ``run_id``'s configuration in ``store`` (the rendezvous' own), signed with ``key``."""

    def __init__(self, store: Any, run_id: str, key: bytes | None, clock: Callable[[], float] = time.time,
                 scope: str = "") -> None:
        self.channel = Channel(store, key, scope_context(scope))  # (bound to the run's scope, as exclusions are)
        self.run_id, self._clock, self._key = run_id, clock, key

    def record(self, node: str, keys: dict[str, str]) -> JobConfig:
        """Record ``keys`` (a :func:`digest`) as the running job's, written by ``node``."""
        message = JobConfig(self.run_id, node, self._clock(), encode(keyed(keys, self._key)))
        self.channel.send(message)
        return message

    def differing(self, ours: dict[str, str], running: JobConfig) -> list[str]:
        """The keys of ``ours`` (a :func:`digest`) that differ from the ``running`` job's record."""
        return differing(keyed(ours, self._key), decode(running.digest) or {})

    def running(self) -> JobConfig | None:
        """The running job's record: None where there is none, it is not the job's word, or it is not fresh."""
        found = self.channel.read(JobConfig, JobConfig(self.run_id, "", 0.0, "").key())
        if found is None or abs(self._clock() - found.written) > STALE_S or decode(found.digest) is None:
            return None
        return found


def script_of(args: Sequence[Any]) -> list[str] | None:
    """The user's script and its arguments in the worker command torch's launcher runs (``python -u SCRIPT
    ARGS``, or ``-m MODULE ARGS``); None where there is none."""
    items = [str(a) for a in args]
    while items and items[0] == "-u":
        items = items[1:]
    if items[:1] == ["-m"]:
        items = items[1:]
    return items or None


def for_this_node(cfg: Any | None, entrypoint: Any, args: Sequence[Any], ours: bool) -> dict[str, str] | None:
    """This node's :func:`digest`: of the workers' config where it loads here (``ours``: the program is
    ``-m elastic_runner.train``), else of the script torch runs. None where nothing comparable is known: our worker
    with a config that does not load here (its workers exit 2 with the reason), or a binary entrypoint of its own
    (``--no-python``)."""
    if ours:
        return digest(cfg) if cfg is not None else None
    if entrypoint != sys.executable:
        return None
    script = script_of(args)
    return digest(script=script) if script else None
