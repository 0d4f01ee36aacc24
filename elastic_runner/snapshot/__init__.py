"""Durable training snapshots: atomic, asynchronous, verified, fenced."""

from .format import load_snapshot, read_meta
from .loader import Loaded, find_newest, load_exact
from .store import (
    AlreadyCommittedError,
    CorruptSnapshotError,
    LocalStore,
    SnapshotError,
    SnapshotRef,
    SnapshotUnavailableError,
    StaleWriterError,
    open_store,
)
from .writer import SaveResult, SnapshotWriter, require_ok

__all__ = [
    "AlreadyCommittedError", "CorruptSnapshotError", "SnapshotUnavailableError", "Loaded", "LocalStore", "SaveResult", "SnapshotError", "SnapshotRef",
    "SnapshotWriter", "StaleWriterError", "find_newest", "load_exact", "load_snapshot", "open_store",
    "read_meta", "require_ok",
]
