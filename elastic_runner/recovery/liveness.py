"""Whether group rank 0's agent is alive once the job's store is gone: how survivors tell its node's loss apart.

The job's store is served by rank 0's worker, and the agents' beats (:mod:`elastic_runner.agent.beat`) live in it.
When rank 0's node is lost the store goes with it, so a survivor reads no beat: it cannot tell "rank 0's node is
lost" (count it out of the next round now) from "only rank 0's worker ended" (its agent, alive, asks for the next
round itself; counting it out would cost it that round). Without the difference the next round waited for the lost
node's rendezvous lease or heartbeats: the dead-node window, ~3 s here, most of such a loss's recovery.

So each agent that keeps its workers across rounds answers on a port of its own (:class:`LivenessServer`, from the
agent's process: it lives exactly as long as the agent), its workers learn the port from :data:`ALIVE_PORT_VAR`,
and rank 0's worker puts it in the job's store as soon as it serves the store (:class:`~.channel.AliveAt`); every
other worker reads it once the round's first group works. A survivor that then finds the job's store gone asks
:func:`agent_lost`: it sends a fresh random challenge, and the agent answers it signed with the job's key and bound
to the agent's name (host, pid, start). The port refuses, does not accept within :data:`CONNECT_S`, or no answer
comes within :data:`ANSWER_S` after: lost, counted out at once. Only each node's first worker (local rank 0) asks,
for its node's agent counts out what any of its workers found: a job of many nodes asks once per node. A valid
answer: alive. An answer that does not verify (another process on the port, or a forger) is
evidence of nothing and reads as alive: that only costs the wait it always cost.

The same port answers while the agent waits in the etcd-v3 rendezvous, where its workers, parked, read no beat:
the agent says where in its node key, and the agents waiting for it there ask it (:func:`offer`,
:mod:`elastic_runner.rendezvous.departures`), so a node lost while the others wait for it is counted out as one lost
while they train.

A challenge cannot be answered by replaying an earlier answer, and nobody without the job's key can make a lost
agent look alive for longer than the dead-node window it always had; whoever can reach the port can hold it busy or
cut connections and make a live agent look lost for one round (it rejoins the next: a denial of service, never a
wrong state, as with the beats). Without a key the answer is the challenge itself, unsigned. A port that accepts and
never answers (a machine gone mid-connection, a process stopped) reads as no answer, as a lost node's does.

The port is bound before the agent forks its zygote, so that the workers inherit :data:`ALIVE_PORT_VAR`, and answered
from a thread started after the fork (:meth:`LivenessServer.start`): the zygote is forked only from an agent that runs
no other thread (:func:`elastic_runner.agent.zygote.fork_zygote`), and it closes every descriptor but its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

from ..printable import printable
from ..rendezvous.departures import AgentLiveness
from ..rendezvous.ports import every_address_socket
from ..rendezvous.seal import AuthError, Sealer
from .channel import AliveAt, Channel

log = logging.getLogger(__name__)

#: Set by the agent for its workers: the port it answers on (on every address of its node).
ALIVE_PORT_VAR = "ELASTIC_RUNNER_AGENT_ALIVE_PORT"
#: Seconds a survivor waits for the port to accept, and then for the agent to answer (a node's network:
#: milliseconds; the margin is for a loaded agent, whose answering thread shares its interpreter).
CONNECT_S = 1.0
ANSWER_S = 1.0


def _max_open() -> int:
    """Connections answered at once: half this process's descriptor limit, 64 to 4,096 (1,024, the usual soft limit:
    512); more are closed unanswered, for a flood must not take the descriptors the agent's own work needs."""
    import resource

    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    return max(64, min(4096, (soft if soft != resource.RLIM_INFINITY else 8192) // 2))


MAX_OPEN = _max_open()
CHALLENGE_BYTES = 16
#: Connections the port holds before it answers them (the kernel caps it at ``net.core.somaxconn``, 4096 by default).
BACKLOG = 4096
_MAX_ANSWER = 256


def _bound(agent: str) -> bytes:
    """What an answer's signature binds besides the challenge: the agent's name, so another agent's answer (or one
    for another job's key) is nobody's word here."""
    return f"elastic_runner/alive {agent}".encode()


class LivenessServer:
    """The agent's port that answers challenges, for the agent's whole life: bound at once, answered once
    :meth:`start` ed, from one daemon thread's event loop. Every survivor of a large job may ask at the same moment
    (one connection per worker), so the connections are served together, not one thread each, and the listening queue
    holds :data:`BACKLOG` of them: one that waited out the asker's :data:`ANSWER_S` would count a live agent out."""

    def __init__(self, agent: str, key: bytes | None) -> None:
        self.agent = agent
        self._sealer = Sealer(key)
        sock = every_address_socket()  # (as the job's store binds: reachable at MASTER_ADDR, whatever it names)
        sock.listen(BACKLOG)
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        self.answered = 0  #: challenges answered (for tests and logs)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._serving = threading.Event()
        self._open = 0  #: connections being answered now

    def start(self) -> None:
        """Answer from now on (connections that came before wait in the listening queue until then)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elastic-runner-agent-alive", daemon=True)
            self._thread.start()
            self._serving.wait(5)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(loop))
        except Exception as exc:  # noqa: BLE001 - its port closed: a lost agent to survivors, never a crash here
            log.warning("this agent's liveness port stopped answering (%s): if this node hosts the job's store, "
                        "survivors count it out of the next round when its worker ends", exc)
        finally:
            self._serving.set()
            self._sock.close()  # (refused from now on, never accepted and left unanswered)
            loop.close()

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._stop = loop, asyncio.Event()
        server = await asyncio.start_server(self._answer, sock=self._sock, backlog=BACKLOG)
        self._serving.set()
        async with server:
            await self._stop.wait()
        answering = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
        for task in answering:  # (an asker still connected: ended with the port, not left to a closed loop)
            task.cancel()
        await asyncio.gather(*answering, return_exceptions=True)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_OPEN:
            writer.close()
            return
        self._open += 1
        try:
            challenge = await asyncio.wait_for(reader.readexactly(CHALLENGE_BYTES), ANSWER_S)
            writer.write(self._sealer.seal(_bound(self.agent), challenge))
            await asyncio.wait_for(writer.drain(), ANSWER_S)
            self.answered += 1
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as exc:  # went away, or held it
            log.debug("agent liveness: a challenge was not answered (%s)", type(exc).__name__)
        finally:
            self._open -= 1
            writer.close()

    def close(self) -> None:
        """Stop answering and close the port (tests; the agent's port goes with its process)."""
        if self._loop is not None and self._stop is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):  # (its loop ended already)
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(5)
        self._sock.close()


def port_from_environment(environ: Any = None) -> int | None:
    """This worker's agent's liveness port (:data:`ALIVE_PORT_VAR`), or None where it has none (torch's own agent, a
    script's workers, a malformed value)."""
    raw = (os.environ if environ is None else environ).get(ALIVE_PORT_VAR, "")
    return int(raw) if raw.isascii() and raw.isdigit() and 0 < int(raw) < 65536 else None


def publish(channel: Channel, port: int, agent: str) -> None:
    """Rank 0's worker: where its agent answers (the job's store's ``channel``)."""
    channel.send(AliveAt(port, agent))


def published(channel: Channel) -> AliveAt | None:
    """Where rank 0's agent answers, as rank 0's worker put it in the job's store; None where it did not."""
    return channel.read(AliveAt, AliveAt(0, "").key())


def numeric_address(host: str, port: int) -> str:
    """``host`` (MASTER_ADDR: often a name) as the address to connect to, looked up now, while the job's store still
    serves: once it is gone a survivor must not wait on a name lookup. ``host`` itself where the lookup fails."""
    return resolved(host, port) or host


def resolved(host: str, port: int) -> str | None:
    """``host``'s first numeric address for a TCP connection to ``port``; None where it does not resolve."""
    try:
        return str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, UnicodeError, IndexError):
        return None


def offer(handler: Any, server: LivenessServer | None, key: bytes | None) -> bool:
    """Tell the rendezvous ``handler`` (one that asks: the etcd-v3 lease protocol's, with a ``liveness`` attribute)
    where this agent answers (``server``), so that it says so in its node key, and how to ask the others while it
    waits for them there (:mod:`elastic_runner.rendezvous.departures`); whether it was told."""
    if server is None or not server.agent or not hasattr(handler, "liveness"):
        return False

    def lost(host: str, port: int, agent: str) -> bool:
        address = resolved(host, port)  # (the key's --local_addr or host name: a lookup, bounded by the resolver)
        if address is None:  # not found is no evidence that nobody answers there
            log.debug("the address '%s' of the agent %s does not resolve here: no evidence", printable(host, 80),
                      printable(agent, 80))
            return False
        return agent_lost(address, AliveAt(port, agent), key)

    handler.liveness = AgentLiveness(server.port, server.agent, lost)
    return True


def agent_lost(address: str, where: AliveAt, key: bytes | None) -> bool:
    """Whether the agent answering at ``address`` (a numeric address: :func:`numeric_address`) as ``where`` says
    (rank 0's, published in the job's store, or one named in its node key) is gone: its port refuses, does not
    accept within :data:`CONNECT_S`, or no answer comes within :data:`ANSWER_S` after. False (alive, or no
    evidence) otherwise."""
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    try:
        with socket.create_connection((address, where.port), timeout=CONNECT_S) as conn:
            deadline = time.monotonic() + ANSWER_S
            conn.sendall(challenge)
            conn.shutdown(socket.SHUT_WR)
            answer = b""
            while len(answer) <= _MAX_ANSWER:
                conn.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = conn.recv(_MAX_ANSWER + 1 - len(answer))
                if not chunk:
                    break
                answer += chunk
    except OSError as exc:  # refused, reset, or no answer in time: its process is gone
        log.debug("the agent %s does not answer at %s:%d (%s)", printable(where.agent, 80), address, where.port, exc)
        return True
    if not answer:
        return True  # accepted, then closed unanswered: nobody serves the port any more
    try:
        if Sealer(key).open(_bound(where.agent), answer) == challenge:
            return False
        why = "it is not the challenge's"
    except AuthError as exc:
        why = str(exc)
    log.warning("the answer at %s:%d where the agent %s says it answers is not its word (%s): taken as no evidence "
                "either way. Whoever answered can reach this node's network: see docs/trust.md", address, where.port,
                printable(where.agent, 80), why)
    return False
