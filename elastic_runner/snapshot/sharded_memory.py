"""Node memory for sharded state (``parallel.strategy: fsdp | hsdp``): every rank's shards in its node's memory and,
with ``snapshot.memory_replicas: 1``, in the next node's too — so the loss of any one node resumes without a disk read.

A replicated model needs none of this: every survivor holds the whole state and keeps its newest step when an attempt
ends (:mod:`.memory`). A sharded model's survivors hold only their own shards, and a dead rank's are gone with it. So
every ``snapshot.memory_every_steps`` steps (:meth:`ShardedMemory.refresh`, at a step boundary, on every rank):

1. each rank copies its slices into host memory (the step waits for this copy only);
2. in a background thread it serialises them (the disk snapshot's part format, :mod:`.shards`), sends them to the
   rank with its local rank on the next node (ring order over nodes) and receives the previous node's, over a
   process group of its own (gloo; the training's collectives are not held up);
3. it writes both parts into its node's memory directory (the node-memory store of :mod:`.memory`, in ``/dev/shm``);
   the node's first rank also writes the rest of the state (``state.pt``, the same on every rank) and, once every part
   the node should hold is there, ``meta.json`` listing them (each with its SHA-256), and publishes the node's copy.

hsdp's nodes hold every shard already: nothing is sent. The next refresh waits for the previous one (on every rank:
they stay in step, so the ring never waits on a rank that skipped one). When: :class:`~.interval.SharedInterval`
(``memory_every_steps: auto`` reduces each refresh's cost over the ranks at the end of its thread).

On a restart (:func:`select_sharded`, a collective) every rank reports the copies its node holds; rank 0 takes the
newest (generation, step) for which the surviving nodes hold every part between them — if it is newer than the newest
disk snapshot — and each rank receives from the holders the parts it needs: its own at an unchanged layout, every
part when the world size or strategy changed (then each rank assembles its new slices from them, as from disk).
Two nodes lost between refreshes leave a part nowhere: the job resumes from disk, and the log says which parts were
missing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch

from .format import load_state_bytes, read_meta, read_verified_bytes, write_snapshot_files
from .interval import SharedInterval
from .loader import Loaded
from .memory import MemoryTier
from .publish import _prune
from . import part_file
from .shards import SHARD_FORMAT, PartReader, check_sharded_meta, part_bytes, part_name, wait_for_parts, write_part_bytes
from .store import SnapshotError, SnapshotRef
from .staging import HostStaging, Pending

log = logging.getLogger(__name__)

#: Memory copies kept per node: the newest may be incomplete on some node when a failure interrupts a refresh.
KEEP = 2


@dataclasses.dataclass(frozen=True)
class Layout:
    """Who holds which part: ``part_id`` names this rank's part (its rank under fsdp, its local rank under hsdp)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    strategy: str
    replicas: int

    @property
    def part_id(self) -> int:
        return self.local_rank if self.strategy == "hsdp" else self.rank

    @property
    def writers(self) -> list[int]:
        """The part ids of a snapshot: every rank under fsdp; under hsdp the first replica's (the first node's ranks:
        the mesh is ranks in order, node by node), whose shards the other nodes repeat."""
        return list(range(self.local_world if self.strategy == "hsdp" else self.world))

    @property
    def ring(self) -> bool:
        """Parts travel to the next node: fsdp over several nodes of equal size, with a replica asked for."""
        return (self.strategy == "fsdp" and self.replicas > 0 and self.world > self.local_world > 0
                and self.world % self.local_world == 0)

    @property
    def send_to(self) -> int:
        return (self.rank + self.local_world) % self.world

    @property
    def receive_from(self) -> int:
        return (self.rank - self.local_world) % self.world

    def node_holds(self) -> list[int]:
        """The part ids this node's copy holds: its own ranks' (and the previous node's with the ring)."""
        if self.strategy == "hsdp":
            return self.writers
        first = self.rank - self.local_rank
        own = list(range(first, first + self.local_world))
        if self.ring:
            previous = (first - self.local_world) % self.world
            own += list(range(previous, previous + self.local_world))
        return sorted(own)


def exchange_group(timeout_s: float) -> Any:
    """The process group the parts travel over (gloo, also under NCCL: they are host bytes); every rank calls it."""
    import torch.distributed as tdist

    return tdist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class ShardedMemory:
    """See the module docstring. Built on every rank; ``tier``: this node's memory store."""

    def __init__(self, tier: MemoryTier, layout: Layout, group: Any, schedule: SharedInterval) -> None:
        self.tier, self.layout, self.group, self.schedule = tier, layout, group, schedule
        self._staging = HostStaging()
        self._thread: threading.Thread | None = None
        #: A GPU's shards on their way to host memory on a side stream (:mod:`.staging`).
        self._device_copy: Pending | None = None
        self.failures = 0

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    def refresh(self, step: int, capture: Callable[[], tuple[dict[str, Any], dict[str, Any]]]) -> float:
        """Copy this rank's shards (and on a node's first rank the rest of the state) for ``step``; the rest happens in
        the background. Returns the seconds the step waited."""
        started = time.perf_counter()
        self.wait()
        self.schedule.refreshing(step)
        ref = SnapshotRef(generation=self.tier.generation, step=step)
        state, meta = capture()
        # On a GPU the copy is queued on a side stream: the step waits for neither it nor the device (wait_staged
        # orders the next optimizer step after it); the thread waits for it before reading the host buffers.
        host = self._staging.copy(state, deferred=True)
        copying = self._device_copy = self._staging.take_pending()
        meta = dict(meta) | {"step": step, "generation": self.tier.generation, "name": ref.name}
        blocked = time.perf_counter() - started
        self._thread = threading.Thread(target=self._write, args=(ref, host, meta, blocked, copying),
                                        name=f"memory-{ref.name}", daemon=True)
        self._thread.start()
        return blocked

    def reserve(self, state: dict[str, Any]) -> None:
        """Allocate the host buffers for the shards of ``state`` off the step (:meth:`HostStaging.reserve`)."""
        self.wait()
        self._staging.reserve(state)

    def wait_staged(self) -> None:
        """Before the tensors change: the step's stream waits (on the device) for a refresh's copy still under way."""
        copying, self._device_copy = self._device_copy, None
        if copying is not None:
            copying.order_before_changes()

    def wait(self, timeout: float | None = None) -> None:
        """Until the refresh in flight is done (at most ``timeout`` seconds)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    def _write(self, ref: SnapshotRef, state: dict[str, Any], meta: dict[str, Any], blocked: float,
               copying: Pending | None = None) -> None:
        started = time.perf_counter()
        try:
            self._copy(ref, state, meta, copying)
        finally:  # every rank, also after a failure: the reduction is a collective
            if self.schedule.fixed is None:
                self._measure(blocked, time.perf_counter() - started)

    def _measure(self, blocked: float, background: float) -> None:
        """Reduce this refresh's cost over the ranks (by maximum) for the next refresh to apply: the same numbers on
        every rank, so every rank picks the same next step."""
        values = self.schedule.measurements(blocked, background, self.layout.rank)
        if self.group is not None:
            import torch.distributed as tdist

            reduced = torch.tensor(values, dtype=torch.float64)
            try:
                tdist.all_reduce(reduced, op=tdist.ReduceOp.MAX, group=self.group)
            except Exception as exc:  # noqa: BLE001 - a peer gone: this attempt is ending anyway
                log.debug("the node-memory interval's reduction failed (%s)", exc)
                return
            values = reduced.tolist()
        self.schedule.pending = values

    def _copy(self, ref: SnapshotRef, state: dict[str, Any], meta: dict[str, Any], copying: Pending | None) -> None:
        layout = self.layout
        try:
            if copying is not None:
                copying.wait()
            data = part_bytes(layout.part_id, state["part"])
            received = self._swap(data) if layout.ring else None
            self.tier.store.ensure()
            staging = self.tier.store.shared_staging(ref)
            write_part_bytes(staging, layout.part_id, data)
            if received is not None:
                write_part_bytes(staging, layout.receive_from, received)
            if layout.local_rank == 0:
                self._publish(ref, staging, state["replicated"], meta)
        except Exception as exc:  # noqa: BLE001 - the disk snapshot remains; training goes on
            self.failures += 1
            log.log(logging.WARNING if self.failures == 1 else logging.DEBUG,
                    "could not copy the shards of step %d into node memory (%s); the disk snapshot remains", ref.step, exc)

    def _swap(self, data: bytes) -> bytes:
        """Send this rank's part to the next node, receive the previous node's (sizes first)."""
        import torch.distributed as tdist

        layout = self.layout
        size_out, size_in = torch.tensor([len(data)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        for work in (tdist.isend(size_out, layout.send_to, group=self.group),
                     tdist.irecv(size_in, layout.receive_from, group=self.group)):
            work.wait()
        out = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        into = torch.empty(int(size_in.item()), dtype=torch.uint8)
        for work in (tdist.isend(out, layout.send_to, group=self.group),
                     tdist.irecv(into, layout.receive_from, group=self.group)):
            work.wait()
        return into.numpy().tobytes()

    def _publish(self, ref: SnapshotRef, staging: Any, replicated: dict[str, Any], meta: dict[str, Any]) -> None:
        store = self.tier.store
        holds = self.layout.node_holds()

        def parts_written() -> dict[str, Any]:
            return {"sharded": {"format": SHARD_FORMAT, "world_size": self.layout.world, "writers": self.layout.writers,
                                "parts": wait_for_parts(staging, holds), "part_ids": holds}}

        write_snapshot_files(staging, replicated, meta, more_meta=parts_written)
        store.publish(staging, ref, entries_synced=True)  # by write_snapshot_files
        _prune(store, KEEP, ref)


# -- restoring --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeCopy:
    """What a rank's node holds of one sharded snapshot in memory."""

    rank: int
    generation: int
    step: int
    part_ids: tuple[int, ...]
    writers: tuple[int, ...]
    fingerprint: dict[str, str]
    run_uid: str

    @property
    def ref(self) -> SnapshotRef:
        return SnapshotRef(generation=self.generation, step=self.step)


def node_copies(memory: ShardedMemory | None) -> list[NodeCopy]:
    """The complete copies this node holds (read from their ``meta.json``; a damaged one is removed)."""
    if memory is None:
        return []
    store, out = memory.tier.store, []
    for ref in store.complete():
        try:
            meta = read_meta(store.path(ref))
            check_sharded_meta(ref.name, meta)
            ids = tuple(int(i) for i in meta["sharded"]["part_ids"])
            writers = tuple(int(i) for i in meta["sharded"]["writers"])
        except (SnapshotError, KeyError, TypeError, ValueError):
            store.remove(ref)
            continue
        out.append(NodeCopy(memory.layout.rank, ref.generation, ref.step, ids, writers, meta.get("fingerprint", {}),
                            str(meta.get("run_uid", ""))))
    return out


def choose(copies: list[NodeCopy], fingerprint: dict[str, str], run_uid: str,
           issued: int) -> tuple[NodeCopy | None, dict[int, int], str]:
    """The newest copy whose parts the reporting nodes hold between them, who holds each part, and (when a newer one
    lacks parts) why that one was passed over."""
    by_ref: dict[tuple[int, int], list[NodeCopy]] = {}
    for c in copies:
        if c.fingerprint == fingerprint and c.run_uid == run_uid and c.generation <= issued:
            by_ref.setdefault((c.generation, c.step), []).append(c)
    passed_over = ""
    for key in sorted(by_ref, reverse=True):
        holders: dict[int, int] = {}
        for c in sorted(by_ref[key], key=lambda c: c.rank):
            for part in c.part_ids:
                holders.setdefault(part, c.rank)
        writers = by_ref[key][0].writers
        missing = [w for w in writers if w not in holders]
        if not missing:
            return by_ref[key][0], holders, passed_over
        if not passed_over:
            passed_over = (f"node memory holds step {key[1]} (generation {key[0]}) without the shards of "
                           f"rank(s) {', '.join(map(str, missing))} (their node and the node holding their copy are "
                           "gone, or a refresh was cut short)")
    return None, {}, passed_over


def receive_parts(dist: Any, memory: ShardedMemory, chosen: NodeCopy, holders: dict[int, int],
                  needs: list[int]) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """Every rank: the chosen copy's ``meta.json`` and ``state.pt`` (from its first holder) and the parts this rank
    ``needs``, each from its holder (point to point, in one order on every rank: no deadlock). A collective."""
    import torch.distributed as tdist

    store, ref, group = memory.tier.store, chosen.ref, memory.group
    first = min(holders.values())
    meta: dict[str, Any] | None = None
    data, error = b"", None
    if dist.rank == first:
        try:
            directory = store.path(ref)
            meta = read_meta(directory)
            data = read_verified_bytes(directory, meta, verify=True)
        except SnapshotError as exc:  # told to every rank, which all fall back together
            error = str(exc)
    meta, size, error = dist.broadcast_object([meta, len(data), error], src=first)  # (JSON: bytes go over the group)
    if error is not None:
        raise SnapshotError(error)
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if dist.rank == first else \
        torch.empty(size, dtype=torch.uint8)
    if group is not None:  # (None: a world of one)
        tdist.broadcast(buffer, src=first, group=group)
    state = load_state_bytes(buffer.numpy().tobytes(), ref.name, "cpu")
    wanted = dist.all_gather_object(sorted(needs))
    got: dict[int, Any] = {}  #: part -> its bytes (any buffer)
    problems: list[str] = []
    held: dict[int, dict[str, Any]] | None = None  #: this node's part records, read once if it sends or keeps any

    def verified(part: int) -> bytes:
        nonlocal held
        if held is None:
            held = _node_records(memory, ref, problems)
        return _verified_part(memory, ref, part, held, problems)

    for part in sorted(holders):
        holder = holders[part]
        for rank, parts in enumerate(wanted):
            if part not in parts or dist.rank not in (holder, rank):
                continue
            if rank == holder:
                data = verified(part)
                if data:
                    got[part] = data
            elif dist.rank == holder:  # an empty part tells the receiver this copy failed its check
                data = verified(part)
                tdist.send(torch.tensor([len(data)], dtype=torch.int64), rank, group=group)
                if data:
                    tdist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), rank, group=group)
            else:
                size = torch.zeros(1, dtype=torch.int64)
                tdist.recv(size, holder, group=group)
                if not int(size.item()):
                    problems.append(f"rank {holder} could not send {part_name(part)}")
                    continue
                into = torch.empty(int(size.item()), dtype=torch.uint8)
                tdist.recv(into, holder, group=group)
                got[part] = into.numpy()
    if problems:  # after the whole schedule: every send found its receive
        raise SnapshotError(f"{ref.name}: {'; '.join(problems)}")
    loaded = []
    for part in sorted(got):
        try:
            loaded.append(part_file.read_bytes(got[part], part_name(part)))
        except Exception as exc:  # noqa: BLE001 - damaged bytes: the caller falls back to disk
            raise SnapshotError(f"{ref.name}: {part_name(part)} from node memory cannot be loaded ({exc})") from exc
    return meta, state, loaded


def _node_records(memory: ShardedMemory, ref: SnapshotRef, problems: list[str]) -> dict[int, dict[str, Any]]:
    """The parts this node's copy of ``ref`` lists, from its (checked, signed) ``meta.json``; {} and a line in
    ``problems`` if it cannot be read."""
    try:
        meta = read_meta(memory.tier.store.path(ref))
        return {int(i): p for i, p in zip(meta["sharded"]["part_ids"], meta["sharded"]["parts"])}
    except (SnapshotError, KeyError, TypeError, ValueError) as exc:
        problems.append(f"the node-memory copy of {ref.name} is unreadable ({exc})")
        return {}


def _verified_part(memory: ShardedMemory, ref: SnapshotRef, part: int, records: dict[int, dict[str, Any]],
                   problems: list[str]) -> bytes:
    """A part of this node's copy, checked against the SHA-256 its ``meta.json`` lists (``records``); b"" and a line in
    ``problems`` if it is missing or damaged."""
    record = records.get(part)
    try:
        data = (memory.tier.store.path(ref) / part_name(part)).read_bytes()
    except OSError as exc:
        problems.append(f"{part_name(part)} unreadable in node memory ({exc.strerror})")
        return b""
    if record is None or hashlib.sha256(data).hexdigest() != record["sha256"]:
        problems.append(f"the node-memory copy of {part_name(part)} is damaged (checksum)")
        return b""
    return data


def select_sharded(dist: Any, store: Any, memory: ShardedMemory | None, *, fingerprint: dict[str, str], run_uid: str,
                   verify: bool, on_rejected: Callable[[SnapshotRef, str], None] | None = None) -> Loaded | None:
    """The newest of node memory (whole across the surviving nodes) and disk, for a sharded run. A collective."""
    from .selection import select_newest

    reported = dist.all_gather_object([dataclasses.asdict(c) for c in node_copies(memory)])
    copies = [NodeCopy(**(c | {"part_ids": tuple(c["part_ids"]), "writers": tuple(c["writers"])}))
              for per_rank in reported for c in per_rank]
    decision = None
    if dist.rank == 0 and memory is not None:
        chosen, holders, passed_over = choose(copies, fingerprint, run_uid, store.newest_generation())
        complete = store.complete()
        newest_disk = complete[-1] if complete else None
        if chosen is not None and (newest_disk is None or chosen.ref >= newest_disk):  # a tie: no disk read
            decision = (dataclasses.asdict(chosen), holders)
        if passed_over:
            log.warning("%s; resuming from %s", passed_over,
                        f"node memory at step {chosen.step}" if decision is not None and chosen is not None else
                        "the newest disk snapshot")
    decision = dist.broadcast_object(decision)
    if decision is None or memory is None:
        return select_newest(dist, store, fingerprint=fingerprint, run_uid=run_uid, verify=verify, memory=None,
                             on_rejected=on_rejected)
    raw, raw_holders = decision
    chosen = NodeCopy(**(raw | {"part_ids": tuple(raw["part_ids"]), "writers": tuple(raw["writers"])}))
    holders = {int(part): int(rank) for part, rank in raw_holders.items()}  # (JSON made the keys strings)
    layout = memory.layout
    same = list(chosen.writers) == layout.writers
    needs = [layout.part_id] if same else sorted(holders)
    try:
        meta, state, parts = receive_parts(dist, memory, chosen, holders, needs)
        failed = None
    except (SnapshotError, OSError) as exc:
        failed, meta, state, parts = str(exc), {}, {}, []
    if any(dist.all_gather_object(failed)):
        log.error("the node-memory copy of %s could not be read (%s); resuming from disk", chosen.ref.name, failed)
        return select_newest(dist, store, fingerprint=fingerprint, run_uid=run_uid, verify=verify, memory=None,
                             on_rejected=on_rejected)
    reader = PartReader(memory.tier.store.path(chosen.ref), meta, loaded=parts)
    return Loaded(chosen.ref, meta, state, tier="memory", parts=reader)
