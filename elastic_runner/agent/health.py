"""A node's health check before it takes part in a rendezvous round: is its device there, does it compute right, and
could the other machines reach its gloo workers?

A node with a broken device that joins a round costs every node that round: its workers fail at their first step (or,
worse, train on with wrong numbers), and the job starts over without it. Checked before its first round, the node
leaves with a line of its own and exit status 5 (``EXIT_UNHEALTHY``) and the others never wait for it.

The check multiplies two fixed 256x256 matrices of small integers on every device the node's workers will use and
compares the product with the exact one: small integers are exact in every float format a matmul may use (float32,
TF32, bf16 inputs accumulated in float32), so a single differing entry is a wrong result, not rounding. A device that
does not answer within ``TIMEOUT_S`` fails too. On a machine with a GPU driver the check runs in a child process:
this agent must never touch CUDA (its zygote forks the workers, and a CUDA context does not survive a fork). Without
one, a CPU check (64x64) runs in the agent itself, after its zygote was forked.

The network check (:func:`network_problem`) only resolves names and binds sockets on this machine: it tells where gloo
would listen, not whether the other nodes' workers answer (they are not known before the round).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
from typing import Callable

import torch

from ..lifecycle import gpu_driver

log = logging.getLogger(__name__)

SIZE = 256
#: On the CPU the check runs in the agent itself, after its zygote was forked (the BLAS may start its thread pool
#: there; the agent forks nothing afterwards, its other children exec a new program): small, a millisecond.
CPU_SIZE = 64
TIMEOUT_S = 120.0


Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _operands(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two matrices of integers in [-2, 2] and their exact product (int64, on the CPU)."""
    generator = torch.Generator().manual_seed(20261128)
    a = torch.randint(-2, 3, (size, size), generator=generator)
    b = torch.randint(-2, 3, (size, size), generator=generator)
    return a, b, a @ b


def check_device(device: torch.device, matmul: Matmul = torch.matmul) -> str | None:
    """What is wrong with ``device`` (None: nothing): its product of the fixed matrices against the exact one."""
    size = CPU_SIZE if device.type == "cpu" else SIZE
    a, b, exact = _operands(size)
    try:
        product = matmul(a.to(device, torch.float32), b.to(device, torch.float32)).to("cpu")
    except Exception as exc:  # noqa: BLE001 - whatever a broken device raises is the finding
        return f"{device} failed to compute a {size}x{size} matmul ({type(exc).__name__}: {str(exc)[:200]})"
    if not torch.isfinite(product).all():
        return f"{device} computed non-finite values in a {size}x{size} matmul of small integers"
    wrong = int((product.round().to(torch.int64) != exact).sum())
    if wrong or not torch.equal(product, product.round()):
        return (f"{device} computed a wrong {size}x{size} matmul of small integers ({wrong} of {size * size} entries "
                "differ from the exact product)")
    return None


def devices_to_check(kind: str, count: int) -> tuple[list[torch.device], str | None]:
    """The devices this node's ``count`` workers use for ``dist.device: kind`` (auto, cuda, cpu), or a problem. Run
    where CUDA may be touched (the child process, or a machine without an NVIDIA driver)."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return [torch.device("cpu")], None
    if not torch.cuda.is_available():
        return [], "dist.device is cuda, and this node has no CUDA device (or its driver does not answer)"
    visible = torch.cuda.device_count()
    if visible < count:  # local rank i takes cuda:i
        return [], f"{count} workers on this node need {count} CUDA devices, and it has {visible}"
    return [torch.device("cuda", i) for i in range(count)], None


def check_here(kind: str, count: int, matmul: Matmul = torch.matmul) -> str | None:
    devices, problem = devices_to_check(kind, count)
    if problem:
        return problem
    for device in devices:
        problem = check_device(device, matmul)
        if problem:
            return problem
    return None


def start_check(kind: str, count: int, timeout_s: float = TIMEOUT_S) -> Callable[[], str | None]:
    """Start this node's check without touching CUDA in this process; returns how to wait for its finding (None:
    healthy). Where no NVIDIA driver is installed it runs here and now (milliseconds); else in a child process that
    runs while the caller goes on (a GPU node's takes seconds: its CUDA start-up). No thread: the agent forks its
    zygote only while it runs none."""
    driver = gpu_driver()
    if kind == "cpu" or (not driver and kind == "auto"):
        problem = check_here("cpu", 1)
        return lambda: problem
    if not driver:
        return lambda: "dist.device is cuda, and this node has no GPU driver"
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "elastic_runner.agent.health", "--kind", kind, "--count", str(count)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    except OSError as exc:  # a node that cannot start a process cannot start its workers either
        problem = f"could not start the device check ({exc.strerror or exc})"
        return lambda: problem

    def finding() -> str | None:
        try:
            out, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()  # (a process stuck in the driver may not die at once: do not wait for it long)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.communicate(timeout=5)
            return f"its devices did not finish a {SIZE}x{SIZE} matmul within {timeout_s:g} s (a hung device?)"
        try:
            return json.loads(out.strip().splitlines()[-1])["problem"]
        except (IndexError, ValueError, KeyError, TypeError):
            tail = (err or out).strip().splitlines()[-1:] or ["no output"]
            return f"the device check exited {child.returncode} without a result ({tail[0][:200]})"

    return finding


# -- the network ----------------------------------------------------------------------------------------------

#: What torch's gloo does when no interface is named: it listens on the first address this machine's hostname resolves
#: to that it can bind, and on the loopback address where there is none. A Debian or Ubuntu ``/etc/hosts`` maps the
#: hostname to 127.0.1.1: the node's workers then listen where no other machine can reach them, and the job's first
#: collective hangs until its timeout on every node, round after round.
Resolve = Callable[[str], list[str]]


def _resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to, in the resolver's order (as gloo tries them); none if it does not."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _bindable(address: str) -> bool:
    """Whether this machine has ``address`` (a socket can be bound to it): one of its own."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def _endpoint_host(endpoint: str) -> str:
    """The host of a rendezvous endpoint (``HOST:PORT``, ``[v6]:PORT``, ``HOST``; the first of a list)."""
    first = endpoint.split(",")[0].strip()
    if "://" in first:
        first = first.split("://", 1)[1]
    if first.startswith("["):
        return first[1:].split("]", 1)[0]
    return first.rsplit(":", 1)[0] if first.count(":") == 1 else first


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return address == "localhost"


def workers_use_gloo(backend: str, device: str, sharded_memory: bool) -> bool:
    """Whether the node's workers open gloo connections to other machines: their backend (auto: gloo unless they
    get a GPU, told here by the driver), or, under nccl, the gloo group a sharded model's node-memory copies travel
    over (:mod:`elastic_runner.snapshot.sharded_memory`)."""
    return backend == "gloo" or sharded_memory or (
        backend == "auto" and (device == "cpu" or (device == "auto" and not gpu_driver())))


def network_problem(*, gloo: bool, max_nodes: int, rdzv_backend: str, endpoint: str,
                    env: dict[str, str] | None = None,
                    hostname: str | None = None, resolve: Resolve | None = None,
                    bindable: Callable[[str], bool] | None = None) -> tuple[str | None, str | None]:
    """Whether this node's gloo workers could be reached from the other machines of the job: ``(problem, doubt)``.
    A problem (the node leaves): the job spans machines — its c10d rendezvous endpoint is another machine, where
    another agent hosts the round — and gloo would listen on a loopback address here. A doubt (a warning, the node goes
    on): the endpoint is this machine, or a service (etcd) that tells nothing of where the nodes are, so the job may
    run on this machine alone, where loopback is fine."""
    env = os.environ if env is None else env
    resolve, bindable = resolve or _resolve, bindable or _bindable
    host = _endpoint_host(endpoint)
    if max_nodes <= 1 or not gloo or env.get("GLOO_SOCKET_IFNAME") or not host or _loopback(host):
        return None, None  # one node, no gloo (nccl skips loopback itself), an interface named, or one machine for sure
    name = hostname if hostname is not None else socket.gethostname()
    mine = [a for a in resolve(name) if bindable(a)]
    listens = mine[0] if mine else "127.0.0.1"
    if not _loopback(listens):
        return None, None
    where = (f"this node's hostname {name!r} resolves to {listens}, a loopback address" if mine else
             f"this node's hostname {name!r} resolves to no address of this machine, so gloo falls back to loopback")
    fix = ("set GLOO_SOCKET_IFNAME to the network interface the nodes share (for example eth0), or map the hostname "
           "to that interface's address in /etc/hosts")
    others = resolve(host) if rdzv_backend == "c10d" else []
    if others and not any(bindable(a) or _loopback(a) for a in others):
        return (f"{where}: gloo would listen there, and the workers of the other machines (the rendezvous endpoint "
                f"{host!r} is one) could not reach this node's; {fix}"), None
    return None, (f"{where}: if this job spans machines, gloo would listen where the others cannot reach it; {fix} "
                  "(on one machine, nothing to do)")


def check_node(kind: str, count: int, timeout_s: float = TIMEOUT_S) -> str | None:
    """This node's problem (None: healthy): :func:`start_check`, waited for."""
    return start_check(kind, count, timeout_s)()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="check this node's devices (run by its agent)")
    parser.add_argument("--kind", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--count", type=int, default=1)
    args = parser.parse_args(argv)
    print(json.dumps({"problem": check_here(args.kind, args.count)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
