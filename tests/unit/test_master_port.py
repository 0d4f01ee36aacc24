"""MASTER_PORT is held from the agent's offer until rank 0's worker binds it: no other local user can take it in
between, and the job's own store and process group come up on it (both torch releases run this file)."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from pathlib import Path

import pytest

from elastic_runner.rendezvous.ports import PortHold

from ..support import start_ranks


def _worker(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as tdist

    from elastic_runner.worker.group import job_store
    from elastic_runner.env import WorkerEnv

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    store = job_store(WorkerEnv.from_environ(), datetime.timedelta(seconds=60))
    assert store is not None
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    total = torch.ones(1) * (rank + 1)
    tdist.all_reduce(total)
    if rank == 0:
        Path(out).write_text(str(total.item()))
    tdist.destroy_process_group()


def test_the_offered_port_is_ours_until_our_worker_binds_it(tmp_path: Path) -> None:
    hold = PortHold()
    port = hold.offer()
    try:
        plain = socket.socket()
        with pytest.raises(OSError):  # a socket without SO_REUSEPORT (torch's own TCPStore, anyone's) cannot have it
            plain.bind(("0.0.0.0", port))
        plain.close()
        if os.geteuid() == 0:  # another user, even with SO_REUSEPORT and SO_REUSEADDR, cannot either
            child = os.fork()
            if child == 0:  # pragma: no cover - the child process
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    other = socket.socket()
                    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    other.bind(("0.0.0.0", port))
                    other.listen()
                    os._exit(0)
                except OSError:
                    os._exit(1)
            _, status = os.waitpid(child, 0)
            assert os.waitstatus_to_exitcode(status) == 1, "another user took the held port"
        out = tempfile.mktemp(dir=tmp_path)
        start_ranks(_worker, (port, out), 2)
        assert Path(out).read_text() == "3.0", "the job's store and process group came up on the held port"
    finally:
        hold.release()


def test_a_released_port_is_anyones_again() -> None:
    hold = PortHold()
    port = hold.offer()
    hold.release()
    free = socket.socket()
    free.bind(("0.0.0.0", port))
    free.close()
    first = hold.offer()
    second = hold.offer()  # a new offer lets the previous port go
    if second != first:
        free = socket.socket()
        free.bind(("0.0.0.0", first))
        free.close()
    hold.release()
