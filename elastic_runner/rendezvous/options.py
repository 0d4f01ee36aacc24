"""Options of the etcd-v3 rendezvous: ``--rdzv_endpoint`` and ``--rdzv_conf``.

One table (``OPTIONS``) is the source of truth for names, defaults and meanings; the parser reads
it with ``RendezvousParameters``' typed getters and ``python -m elastic_runner.rendezvous.options``
prints it as the Markdown table of docs/reference/etcd-options.md. torchrun splits ``--rdzv_conf`` at commas, so no
value here can contain one; a list of etcd members goes into ``--rdzv_endpoint`` instead
(``--rdzv_endpoint=10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379``).

This module imports nothing from torch at module level (the entry point must stay light).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..printable import printable
from .seal import loose_permissions, read_key

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_KEY_PREFIX = "/elastic_runner/rdzv"
PROTOCOLS = ("leases", "state")


@dataclass(frozen=True)
class Option:
    name: str
    default: str  #: as documented ("" for none)
    meaning: str


OPTIONS: tuple[Option, ...] = (
    Option("key_prefix", DEFAULT_KEY_PREFIX,
           "etcd key prefix. The run's keys live under `PREFIX/RUN_ID/` (`rdzv/...`, `store/...`, `ops/...`), so runs "
           "and other users of the cluster do not collide."),
    Option("ttl", "7200",
           "TTL in seconds of the lease that the run's lasting keys (round record, store, `protocol=state`'s state) "
           "are attached to. Each agent refreshes its own while it lives, so the keys of an abandoned run disappear "
           "between 2/3 TTL and TTL after its last agent stopped. (An agent's liveness is another lease, of "
           "`keep_alive_interval * keep_alive_max_attempt` seconds.)"),
    Option("request_timeout", "10", "Timeout in seconds of one HTTP request to etcd (connect and read)."),
    Option("retry_timeout", "60",
           "While a job runs: how long, in seconds, one operation keeps retrying (with exponential backoff and "
           "fail-over to the next endpoint) through connection failures, leader elections or an etcd restart "
           "before it fails with RendezvousConnectionError."),
    Option("connect_timeout", "30",
           "At start: how long, in seconds, the agent keeps trying to reach etcd before it exits with an error "
           "that names the endpoints."),
    Option("read_timeout", "60",
           "Default timeout in seconds of the store's blocking `get`/`wait`/`multi_get` (torch's name and "
           "default for the c10d and etcd-v2 stores)."),
    Option("cacert", "", "CA bundle that signed etcd's server certificate. Turns on https."),
    Option("cert", "", "Client certificate for mutual TLS (with `key`). Turns on https."),
    Option("key", "", "Private key of the client certificate."),
    Option("user", "", "etcd user name (etcd's auth is on). Needs read/write permission on the key prefix."),
    Option("password_file", "", "File whose first line is the password of `user` (a mounted Kubernetes secret; "
           "mode 600). A `password=` in `--rdzv_conf` is refused: it would be in the process list, torchrun's log "
           "and every worker's environment. Credentials go only over https (`cacert`)."),
    Option("auth_key_file", "",
           "File with the job's secret (its first line, at least 32 bytes: `openssl rand -hex 32`), the same on every "
           "node. Every rendezvous and store value is then signed (HMAC-SHA256) and refused unless its signature "
           "verifies: whoever can write etcd without the key cannot steer the job. Without it, the lease protocol "
           "reads only bounded JSON, and `protocol=state` unpickles states with a rendezvous state's classes only."),
    Option("protocol", "leases",
           "`leases`: each node writes only its own key, on a lease that is its heartbeat, and one transaction seals "
           "a round (scales to 1,024 nodes, see docs/benchmarks.md). `state`: torch's protocol (one shared state that every node "
           "rewrites), the only one of builds before the lease protocol; set it on every node while a job mixes "
           "such builds."),
    Option("insecure_loopback_auth", "false",
           "`true` allows `user`/`password_file` over plain http, and only to loopback endpoints (127.0.0.1, ::1, "
           "localhost): a local test etcd. Anywhere else credentials over http are refused."),
)

#: The documented defaults of the numeric options, read from the table (so the two cannot drift).
DEFAULTS: dict[str, int] = {o.name: int(o.default) for o in OPTIONS if o.default.isdigit()}

# torch's own keys (DynamicRendezvousHandler, torchrun); anything else is likely a typo.
TORCH_KEYS = frozenset({
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
    "keep_alive_max_attempt", "timeout", "rank", "local_addr", "is_host", "store_type",
})


@dataclass(frozen=True)
class Endpoint:
    scheme: str  #: "http" or "https"
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


@dataclass(frozen=True)
class EtcdOptions:
    endpoints: tuple[Endpoint, ...]
    key_prefix: str = DEFAULT_KEY_PREFIX
    ttl: int = DEFAULTS["ttl"]
    request_timeout: int = DEFAULTS["request_timeout"]
    retry_timeout: int = DEFAULTS["retry_timeout"]
    connect_timeout: int = DEFAULTS["connect_timeout"]
    read_timeout: int = DEFAULTS["read_timeout"]
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    auth_key: bytes | None = field(default=None, repr=False)
    protocol: str = "leases"


_ENDPOINT = re.compile(r"(?:(?P<scheme>[A-Za-z]+)://)?"  # optional http:// or https://
                       r"(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:/\[\]]+))"  # [IPv6] or a name / IPv4
                       r"(?::(?P<port>\d{1,5}))?/?")


def parse_endpoints(text: str | None, tls: bool = False) -> tuple[Endpoint, ...]:
    """``host[:port]`` or ``http(s)://host[:port]``, comma-separated; IPv6 in brackets."""
    if not text or not text.strip():
        raise ValueError("The etcd-v3 rendezvous needs --rdzv_endpoint=HOST:PORT (etcd's client URL, port 2379 by "
                         "default; several comma-separated endpoints for an etcd cluster).")
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        m = _ENDPOINT.fullmatch(item)
        if m is None:
            raise ValueError(f"--rdzv_endpoint entry '{item}' is not HOST, HOST:PORT or http(s)://HOST:PORT; "
                             "separate several etcd endpoints with commas.")
        scheme = (m["scheme"] or ("https" if tls else "http")).lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"--rdzv_endpoint entry '{item}' uses scheme '{scheme}'; use http:// or https://.")
        port = int(m["port"]) if m["port"] else DEFAULT_PORT
        if not 0 < port < 65536:
            raise ValueError(f"--rdzv_endpoint entry '{item}' has port {port}; use a port between 1 and 65535.")
        out.append(Endpoint(scheme, m["v6"] or m["host"], port))
    if not out:
        raise ValueError("--rdzv_endpoint lists no etcd endpoint; set it to HOST:PORT.")
    return tuple(out)


def _positive_int(params: "RendezvousParameters", name: str, default: int) -> int:
    value = params.get_as_int(name, default)
    if value is None or value <= 0:
        raise ValueError(f"The rendezvous option '{name}' must be a positive number of seconds (got {value}); "
                         f"set --rdzv_conf={name}=N or leave it out for the default {default}.")
    return value


def _file(params: "RendezvousParameters", name: str) -> str | None:
    value = params.get(name)
    if value is None or str(value).strip() == "":
        return None
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ValueError(f"The rendezvous option '{name}' names '{path}', which is not a readable file; check the "
                         "path (it is read on every node).")
    return str(path)


def parse_options(params: "RendezvousParameters") -> EtcdOptions:
    """Read ``--rdzv_endpoint`` and ``--rdzv_conf`` (typed getters, documented defaults)."""
    if params.get("password") is not None:
        raise ValueError("The etcd password must not be given as --rdzv_conf password=...: it would be visible in the "
                         "process list, in torchrun's log and in every worker's environment. Write it to a file only "
                         "you can read (chmod 600) and set password_file=PATH instead.")
    known = {o.name for o in OPTIONS} | TORCH_KEYS
    unknown = sorted(set(params.config) - known)
    if unknown:
        log.warning("Ignoring unknown --rdzv_conf key(s) %s for the etcd-v3 rendezvous; known keys: %s.",
                    ", ".join(unknown), ", ".join(sorted(known)))
    cacert, cert, key = _file(params, "cacert"), _file(params, "cert"), _file(params, "key")
    if bool(cert) != bool(key):
        raise ValueError("The rendezvous options 'cert' and 'key' go together (client certificate and its private "
                         "key for mutual TLS); set both or neither.")
    prefix = str(params.get("key_prefix", DEFAULT_KEY_PREFIX)).rstrip("/")
    if not prefix.startswith("/") or "\0" in prefix:
        raise ValueError(f"The rendezvous option 'key_prefix' must start with '/' (got '{prefix}'), e.g. "
                         f"key_prefix={DEFAULT_KEY_PREFIX}.")
    scope = run_scope()
    if scope:
        prefix = f"{prefix}/scope/{scope}"  # this run's keys apart from every other run that uses the same --rdzv_id
    user = params.get("user")
    password = None
    password_file = _file(params, "password_file")
    if password_file:
        lines = Path(password_file).read_text().splitlines()
        password = lines[0] if lines else ""
    if password is not None and not user:
        raise ValueError("A password file was given for the etcd-v3 rendezvous but no 'user'; set "
                         "--rdzv_conf=user=NAME.")
    if user and password is None:
        raise ValueError(f"The etcd user '{user}' needs a password: set password_file=PATH in --rdzv_conf.")
    endpoints = parse_endpoints(params.endpoint, tls=bool(cacert or cert))
    loopback = all(e.host in LOOPBACK_HOSTS for e in endpoints)
    if user and any(e.scheme == "http" for e in endpoints):
        if not (params.get_as_bool("insecure_loopback_auth", False) and loopback):
            raise ValueError(f"The etcd user '{user}' would send its password over plain http to "
                             f"{', '.join(str(e) for e in endpoints)}; use https:// endpoints (set cacert=PATH to the "
                             "CA of etcd's certificate). Only for a local test etcd on loopback: "
                             "insecure_loopback_auth=true.")
    protocol = str(params.get("protocol", "leases")).strip().lower()
    if protocol not in PROTOCOLS:
        raise ValueError(f"The rendezvous option 'protocol' is '{protocol}'; use one of {', '.join(PROTOCOLS)} "
                         "(leases is the default; state only while some nodes run an older elastic_runner).")
    auth_key_file = _file(params, "auth_key_file")
    for secret in (password_file, key, auth_key_file):
        if secret and (problem := loose_permissions(secret)):
            log.warning("%s", problem)
    if not auth_key_file and not loopback:
        log.warning("The etcd-v3 rendezvous at %s runs without the job's key: anyone who can write its key prefix "
                    "can seat agents, close the run or plant values. Give every node the same secret with "
                    "--rdzv_conf auth_key_file=PATH (docs/trust.md).", ", ".join(str(e) for e in endpoints))
    return EtcdOptions(
        endpoints=endpoints,
        key_prefix=prefix,
        **{name: _positive_int(params, name, default) for name, default in DEFAULTS.items()},
        cacert=cacert, cert=cert, key=key,
        user=str(user) if user else None, password=None if password is None else str(password),
        auth_key=read_key(auth_key_file) if auth_key_file else None,
        protocol=protocol,
    )


#: Set (the same on every node of one run, different for every run), it puts the run's keys under a prefix of their
#: own: a value of an earlier run under the same ``--rdzv_id`` can then never be put back into this one. The
#: Kubernetes manifests set it to the Job's UID (downward API); elsewhere a new ``--rdzv_id`` per run does the same.
SCOPE_VAR = "ELASTIC_RUNNER_RDZV_SCOPE"


def run_scope() -> str:
    """This run's scope (:data:`SCOPE_VAR`; "" where unset), which the run's lasting records are bound to on every
    backend and etcd-v3's keys are put under. ``ValueError`` naming the variable where it is not a scope."""
    scope = os.environ.get(SCOPE_VAR, "")
    if scope and not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", scope):
        raise ValueError(f"{SCOPE_VAR} is '{printable(scope, 40)}'; it must be 1 to 128 letters, digits, '.', '_' or "
                         "'-' (on Kubernetes it is the Job's UID, from the pod's labels): fix or unset it")
    return scope

#: Hosts that are this machine: a rendezvous there needs no key to keep other machines out.
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def markdown_table(options: Sequence[Option] = OPTIONS) -> str:
    rows = ["| `--rdzv_conf` key | default | meaning |", "|---|---|---|"]
    for o in options:
        default = f"`{o.default}`" if o.default else "—"
        rows.append(f"| `{o.name}` | {default} | {o.meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
