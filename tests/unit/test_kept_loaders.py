"""DataLoader workers kept from one attempt to the next (in-process recovery): the same processes serve every epoch
and every attempt, see the epoch they load for, are started anew when one died, and hold none of the trainer's
network sockets (a peer must see the trainer close its connections; its ports must come free)."""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any, Iterator

import pytest
import torch
from torch.utils.data import Dataset

from elastic_runner.data.sources import KeptLoaders, LoaderSource

CPU = torch.device("cpu")


class WhoLoaded(Dataset[torch.Tensor]):
    """Item i: (i, the epoch the dataset was told, the pid of the process that loaded it)."""

    def __init__(self, n: int = 64) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, self.epoch, os.getpid()])


def pairs(first: int, count: int) -> list[list[int]]:
    return [[i, i + 1] for i in range(first, first + 2 * count, 2)]


def loaded(batches: Iterator[Any]) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in row) for batch in batches for row in batch]  # type: ignore[misc]


@pytest.fixture
def kept() -> Iterator[LoaderSource]:
    source = LoaderSource(WhoLoaded(), CPU, num_workers=2, seed=0, keep_workers=True)
    yield source
    source.close()


def test_kept_workers_serve_every_epoch_and_an_abandoned_iteration_without_starting_again(kept: LoaderSource) -> None:
    first = kept.batches(pairs(0, 8), epoch=0)
    rows = loaded(iter([next(first)]))
    workers = kept.worker_pids()
    assert len(workers) == 2 and os.getpid() not in workers
    assert rows == [(0, 0, workers[0]), (1, 0, workers[0])], "batch 0 from the first worker"
    # The step in flight is abandoned (a peer failed): its prefetched batches must not reach the next attempt.
    del first
    items = loaded(kept.batches(pairs(20, 4), epoch=3))
    assert [i for i, _, _ in items] == list(range(20, 28)), "exactly the indices asked for, in order"
    assert {e for _, e, _ in items} == {3}, "the workers load for the epoch they are told, not the one they began in"
    assert {pid for _, _, pid in items} <= set(workers) and kept.worker_pids() == workers
    assert kept.restarts == 0


def test_a_kept_worker_that_dies_is_reported_at_once_and_the_next_call_starts_the_loader_anew(
        kept: LoaderSource) -> None:
    assert len(loaded(kept.batches(pairs(0, 4), epoch=0))) == 8
    before = kept.worker_pids()
    os.kill(before[1], signal.SIGKILL)
    # torch's SIGCHLD handler raises in the trainer's main thread wherever it is: in a worker process, the step or
    # the group's rebuild fails, and its agent replaces the process (today's path). Swallowed somewhere, the kept
    # loader must not serve from a dead worker:
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal"):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.05)
    items = loaded(kept.batches(pairs(10, 4), epoch=1))
    assert [i for i, _, _ in items] == list(range(10, 18)) and {e for _, e, _ in items} == {1}
    assert kept.restarts == 1 and not set(kept.worker_pids()) & set(before)


def test_loader_workers_hold_none_of_the_trainers_network_sockets(kept: LoaderSource) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    server_side, _ = listener.accept()
    unix_a, unix_b = socket.socketpair()  # Unix-domain sockets (multiprocessing's) are not the workers' to close
    try:
        loaded(kept.batches(pairs(0, 4), epoch=0))  # the workers are forked now, while all of these are open
        assert kept.workers_alive()
        server_side.close()
        assert client.recv(1) == b"", "the peer sees the trainer close its end at once, not when the workers end"
        listener.close()
        again = socket.socket()
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # over the closed connection's TIME_WAIT, not a LISTEN
        again.bind(("127.0.0.1", port))  # no worker keeps the trainer's port bound
        again.close()
        unix_a.sendall(b"x")
        assert unix_b.recv(1) == b"x"
        assert loaded(kept.batches(pairs(0, 1), epoch=0))[0][0] == 0
    finally:
        for sock in (client, listener, server_side, unix_a, unix_b):
            sock.close()


def test_the_same_dataset_keeps_its_loader_and_another_ends_the_old_workers() -> None:
    loaders, dataset = KeptLoaders(), WhoLoaded()

    def make(data: Dataset[Any]) -> LoaderSource:
        return LoaderSource(data, CPU, num_workers=1, seed=0, keep_workers=True)

    try:
        train = loaders.source("train", dataset, lambda: make(dataset))
        loaded(train.batches(pairs(0, 2)))
        old = train.worker_pids()
        assert loaders.source("train", dataset, lambda: make(dataset)) is train, "the next attempt's same workload"
        rebuilt = WhoLoaded()
        fresh = loaders.source("train", rebuilt, lambda: make(rebuilt))
        assert fresh is not train and train.worker_pids() == []
        assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in old), "the old workers ended"
    finally:
        loaders.close()


def test_without_keeping_the_workers_end_with_each_iteration() -> None:
    source = LoaderSource(WhoLoaded(), CPU, num_workers=2, seed=0)
    first = {pid for _, _, pid in loaded(source.batches(pairs(0, 4), epoch=0))}
    second = loaded(source.batches(pairs(0, 4), epoch=2))
    assert {e for _, e, _ in second} == {2} and not first & {pid for _, _, pid in second}
    assert source.worker_pids() == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
