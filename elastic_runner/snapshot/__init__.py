"""Durable training snapshots: atomic, asynchronous, verified, fenced; and the node-memory tier.

- ``store``           where snapshots live: naming, atomic commit, generation fencing, quarantine.
- ``object_store``    the same contract in a bucket (``s3://``, ``gs://``); ``open_store`` picks by location.
- ``format``          what is inside a snapshot, how it is written and verified (checksums, ``weights_only``).
- ``publish``         write one snapshot and publish it, fenced, pruning the old ones.
- ``writer``          save without stalling training: the writer thread, or the writer process through
- ``shm``             a shared-memory arena,
- ``writer_process``  the process that serialises, hashes, fsyncs and publishes off the training interpreter.
- ``loader``          the newest complete and intact snapshot.
- ``memory``          the node-memory tier: the newest state kept on every node that survives.
- ``selection``       which state a (re)started job resumes from: the newest of every node's memory and the disk.
- ``space``           room for snapshots on the volume.
- ``interval``        ``snapshot.every_steps: auto`` (Young/Daly).
- ``cli``             ``elastic-runner snapshot inspect|export|persist|gc``.
"""

from .format import load_snapshot, read_meta
from .loader import Loaded, find_newest, load_exact
from .store import (
    AlreadyCommittedError,
    CorruptSnapshotError,
    LocalStore,
    ShardedStore,
    SnapshotError,
    SnapshotRef,
    SnapshotStore,
    SnapshotUnavailableError,
    StaleWriterError,
)
from .object_store import ObjectStore, open_store
from .writer import SaveResult, SnapshotWriter, require_ok

__all__ = [
    "AlreadyCommittedError", "CorruptSnapshotError", "Loaded", "LocalStore", "ObjectStore", "SaveResult",
    "ShardedStore", "SnapshotError", "SnapshotRef", "SnapshotStore", "SnapshotUnavailableError", "SnapshotWriter",
    "StaleWriterError", "find_newest", "load_exact", "load_snapshot", "open_store", "read_meta", "require_ok",
]
