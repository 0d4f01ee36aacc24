"""``KVClient`` on etcd's v3 HTTP/JSON gateway (``/v3/kv/txn``, ``/v3/watch``...) through ``etcd3gw``.

``etcd3gw`` is maintained and has no grpc/protobuf pins (the ``etcd3`` package fails to import with
protobuf >= 4 and locks out a failed endpoint for minutes). It gives us sessions, TLS, API path
discovery and status-code mapping; the payloads, error classification, retries and watches are
ours, because its helpers encode keys as latin-1 text and its watcher has no timeout:

- *Retries.* Connection failures, timeouts and etcd's "unavailable" answers (no leader, leader
  changed, restart) are retried with exponential backoff and jitter, moving to the next endpoint
  after each failure, until the operation's budget (``retry_timeout``) is spent; then
  ``EtcdUnavailable``. Wrong credentials, a TLS mismatch, missing permissions or a full database
  are not transient and fail at once with a sentence that says what to check.
- *Watches* are one streaming HTTP request per wait, on one key or a prefix, from the revision of
  the read before (so no write in between is missed); the socket's read timeout is the wait's
  remaining time, so no thread is needed and an idle wait costs etcd nothing.
- *Auth.* With ``user``/``password``, a token from ``/v3/auth/authenticate`` goes into the
  ``Authorization`` header of each endpoint's session; an expired or foreign token (simple tokens
  are per member) is renewed once and the request repeated.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import requests
from torch.distributed.elastic.multiprocessing.api import SignalException

from .kv import (
    Backoff,
    Compare,
    Delete,
    EtcdAuthError,
    EtcdLeaseNotFound,
    EtcdRequestError,
    EtcdTLSError,
    EtcdUnavailable,
    Get,
    KeyValue,
    KVClient,
    Op,
    Put,
    T,
    TxnResult,
    WatchEnd,
    WatchEvent,
)
from .options import Endpoint, EtcdOptions

log = logging.getLogger(__name__)


class _Transient(Exception):
    """Internal: a failure worth retrying."""


class _Reauthenticate(Exception):
    """Internal: the auth token expired or belongs to another member."""



# -- etcd over the HTTP gateway ------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _kv(obj: dict[str, Any]) -> KeyValue:
    return KeyValue(key=_unb64(obj.get("key")), value=_unb64(obj.get("value")),
                    create_revision=int(obj.get("create_revision", 0)), mod_revision=int(obj.get("mod_revision", 0)),
                    lease=int(obj.get("lease", 0)))


def _op_json(op: Op) -> dict[str, Any]:
    if isinstance(op, Put):
        body: dict[str, Any] = {"key": _b64(op.key), "value": _b64(op.value)}
        if op.lease:
            body["lease"] = str(op.lease)
        return {"request_put": body}
    if isinstance(op, Get):
        return {"request_range": {"key": _b64(op.key)}}
    return {"request_delete_range": {"key": _b64(op.key)}}


def _compare_json(c: Compare) -> dict[str, Any]:
    target = {"mod_revision": "MOD", "create_revision": "CREATE", "value": "VALUE"}[c.target]
    expected = _b64(c.expected) if isinstance(c.expected, bytes) else str(c.expected)
    return {"key": _b64(c.key), "result": "EQUAL", "target": target, c.target: expected}


def _op_result(op: Op, response: dict[str, Any]) -> Any:
    if isinstance(op, Get):
        kvs = response.get("response_range", {}).get("kvs") or []
        return _kv(kvs[0]) if kvs else None
    if isinstance(op, Delete):
        return int(response.get("response_delete_range", {}).get("deleted", 0))
    return None


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key with this prefix (etcd's range_end for a prefix)."""
    data = bytearray(prefix)
    while data and data[-1] == 0xFF:
        data.pop()
    if not data:
        return b"\0"
    data[-1] += 1
    return bytes(data)


@dataclass
class _Member:
    endpoint: Endpoint
    client: Any  # etcd3gw.Etcd3Client
    token: str | None = None  #: None: not authenticated yet; "": auth is off on this server
    speaks_tls: bool | None = None  #: None: not probed yet, or the probe could not connect


class EtcdGatewayClient(KVClient):
    """``KVClient`` on etcd's v3 HTTP/JSON gateway via ``etcd3gw`` (see the module docstring)."""

    def __init__(self, options: EtcdOptions) -> None:
        super().__init__()
        import etcd3gw

        if not options.endpoints:
            raise ValueError("EtcdGatewayClient needs at least one endpoint.")
        self.options = options
        self._members = [
            _Member(e, etcd3gw.Etcd3Client(host=e.host, port=e.port, protocol=e.scheme, timeout=options.request_timeout,
                                           session=self._session()))
            for e in options.endpoints
        ]
        self._current = 0
        self._auth_lock = threading.Lock()
        self._warned_auth_off = False
        self.endpoint_text = ", ".join(str(e) for e in options.endpoints)

    # -- plumbing -----------------------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        """A session that uses exactly the configured TLS files.

        requests lets REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE override a session's ``verify`` and routes
        through HTTP(S)_PROXY; for etcd neither is wanted (a configured ``cacert`` must win, and a
        proxy would break watch streams), so the environment is not consulted, except that without
        ``cacert`` those CA bundle variables still name the default trust store.
        """
        session = requests.Session()
        session.trust_env = False
        session.verify = self.options.cacert or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") \
            or True
        if self.options.cert and self.options.key:
            session.cert = (self.options.cert, self.options.key)
        return session

    def _authenticate(self, member: _Member) -> None:
        if not self.options.user or member.token is not None:
            return
        with self._auth_lock:
            if member.token is not None:
                return
            client = member.client
            self._count()
            try:
                answer = client.post(client.get_url("/auth/authenticate"),
                                     json={"name": self.options.user, "password": self.options.password or ""})
            except SignalException:
                raise  # the agent's stop, not an answer to classify
            except Exception as exc:  # noqa: BLE001 - classified below
                if "authentication is not enabled" in _detail(exc):
                    if not self._warned_auth_off:
                        log.warning("etcd at %s has authentication turned off; the rendezvous user '%s' is not "
                                    "used.", member.endpoint, self.options.user)
                        self._warned_auth_off = True
                    member.token = ""
                    return
                raise
            member.token = str(answer.get("token", ""))
            client.session.headers["Authorization"] = member.token

    def _classify(self, exc: BaseException, member: _Member) -> BaseException:
        """Map an exception from etcd3gw/requests to one of ours, ``_Transient`` or ``_Reauthenticate``."""
        from etcd3gw import exceptions as gx

        where = f"etcd at {member.endpoint}"
        detail = _detail(exc)
        code, message = _grpc_error(detail)
        lowered = (message or detail).lower()
        context = exc.__context__ if exc.__context__ is not None else exc
        if isinstance(context, requests.exceptions.SSLError) or "ssl" in lowered and "certificate" in lowered \
                or "wrong version number" in lowered:
            return EtcdTLSError(
                f"The TLS handshake with {where} failed ({_short(detail)}). Check the endpoint's scheme (https:// "
                f"only if etcd serves TLS), that 'cacert' is the CA that signed etcd's server certificate and that "
                f"the certificate is valid for host '{member.endpoint.host}', and that 'cert'/'key' are accepted by "
                f"etcd (--trusted-ca-file).")
        plain_http_to_tls = EtcdTLSError(
            f"{where} serves TLS but the rendezvous connects with plain http. Use an https:// endpoint or set "
            "'cacert' (and 'cert'/'key' if etcd requires client certificates) in --rdzv_conf.")
        needs_login = EtcdAuthError(f"{where} requires authentication. Set user=NAME and password_file=PATH in "
                                    "--rdzv_conf.")
        if "http request to an https server" in lowered:
            return plain_http_to_tls
        if isinstance(exc, (gx.ConnectionFailedError, gx.ConnectionTimeoutError, gx.InternalServerError)):
            reason = _reason(message or detail)
            if reason == "connection closed by etcd" and member.endpoint.scheme == "http" \
                    and self._speaks_tls(member):
                # etcd with client-certificate auth drops plain-http connections without an answer
                return plain_http_to_tls
            return _Transient(f"{where}: {reason}")
        if "invalid auth token" in lowered or "revision in header is old" in lowered:
            return _Reauthenticate() if self.options.user else needs_login
        if "user name is empty" in lowered or "user name not found" in lowered and not self.options.user:
            return needs_login
        if "authentication failed" in lowered or "invalid user id or password" in lowered:
            return EtcdAuthError(f"{where} rejected user '{self.options.user}' and its password. Check 'user' and "
                                 "'password_file' (or 'password') in --rdzv_conf against etcd's users.")
        if "permission denied" in lowered or code == 7:
            return EtcdAuthError(f"{where} denied user '{self.options.user}' access. Grant the user's role readwrite "
                                 "permission on the rendezvous key prefix (etcdctl role grant-permission --prefix).")
        if "lease not found" in lowered:
            return EtcdLeaseNotFound(f"{where} no longer knows the lease: {message}.")
        if "database space exceeded" in lowered:
            return EtcdRequestError(f"{where} is out of space (mvcc: database space exceeded). Compact and "
                                    "defragment it, disarm the NOSPACE alarm, and run etcd with "
                                    "--auto-compaction-retention.")
        if code in (2, 4, 8, 10, 13, 14) or "too many requests" in lowered or "leader" in lowered:
            return _Transient(f"{where}: {_short(message or detail)}")
        if isinstance(exc, gx.Etcd3Exception):
            if code is None and "404" in detail or "page not found" in lowered:
                return EtcdRequestError(f"{where} does not serve etcd's v3 API ({_short(detail)}). Check that "
                                        "--rdzv_endpoint is etcd's client URL (etcd >= 3.4; port 2379 by default).")
            return EtcdRequestError(f"{where} refused a request: {_short(message or detail)}.")
        return EtcdRequestError(f"Unexpected error talking to {where}: {type(exc).__name__}: {_short(str(exc))}.")

    def _speaks_tls(self, member: _Member) -> bool:
        """Probe once per member (a TLS handshake, up to 3 s), not on every failed try of a call."""
        if member.speaks_tls is None:
            member.speaks_tls = _speaks_tls(member.endpoint, self.options.request_timeout)
        return bool(member.speaks_tls)

    def _call(self, fn: Callable[[_Member], T], what: str, budget: float | None = None) -> T:
        budget = self.options.retry_timeout if budget is None else budget
        deadline = time.monotonic() + budget
        backoff = Backoff()
        reauth = 0
        first: str | None = None
        while True:
            member = self._members[self._current]
            try:
                self._authenticate(member)
                self._count()
                result = fn(member)
                if first is not None:
                    log.warning("etcd answers again (%s) after: %s", member.endpoint, first)
                return result
            except SignalException:
                raise  # a stop for the agent (SIGTERM, SIGINT in its main thread), not an etcd error to retry
            except Exception as exc:  # noqa: BLE001 - classified
                error, cause = self._classify(exc, member), exc
            if isinstance(error, _Reauthenticate):
                member.token = None
                member.client.session.headers.pop("Authorization", None)
                reauth += 1
                if reauth <= 2:
                    continue
                raise EtcdAuthError(f"etcd at {member.endpoint} keeps rejecting fresh auth tokens for user "
                                    f"'{self.options.user}'; check etcd's --auth-token settings.") from cause
            if not isinstance(error, _Transient):
                raise error from cause
            remaining = deadline - time.monotonic()
            if first is None:
                first = str(error)
                log.warning("etcd request (%s) failed, retrying for up to %.0f s: %s", what, max(0.0, remaining),
                            error)
            if remaining <= 0:
                raise EtcdUnavailable(
                    f"Could not {what} on etcd ({self.endpoint_text}) within "
                    f"{budget:.0f} s; last error: {error}. Check that etcd "
                    f"is running and reachable from this node, and that --rdzv_endpoint lists its client URLs."
                ) from cause
            self._current = (self._current + 1) % len(self._members)
            time.sleep(min(remaining, backoff.next_delay()))

    def _post(self, path: str, payload: dict[str, Any], what: str, budget: float | None = None) -> dict[str, Any]:
        answer = self._call(lambda m: m.client.post(m.client.get_url(path), json=payload), what, budget)
        self._count(0, len(json.dumps(payload)) + len(json.dumps(answer)))  # the bodies, as JSON on the wire
        return answer

    # -- KVClient ------------------------------------------------------------------------------------------------

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        payload = {"compare": [_compare_json(c) for c in compare], "success": [_op_json(o) for o in success],
                   "failure": [_op_json(o) for o in failure]}
        answer = self._post("/kv/txn", payload, "run a transaction")
        ok = bool(answer.get("succeeded", False))
        ops = success if ok else failure
        responses = answer.get("responses") or []
        results = tuple(_op_result(op, responses[i] if i < len(responses) else {}) for i, op in enumerate(ops))
        return TxnResult(ok, int(answer.get("header", {}).get("revision", 0)), results)

    def get(self, key: bytes, *, budget: float | None = None) -> tuple[KeyValue | None, int]:
        answer = self._post("/kv/range", {"key": _b64(key)}, "read a key", budget)
        kvs = answer.get("kvs") or []
        return (_kv(kvs[0]) if kvs else None), int(answer.get("header", {}).get("revision", 0))

    def get_prefix(self, prefix: bytes, limit: int = 0) -> tuple[list[KeyValue], int]:
        body = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))} | ({"limit": str(limit)} if limit else {})
        answer = self._post("/kv/range", body, "read keys")
        return [_kv(kv) for kv in answer.get("kvs") or []], int(answer.get("header", {}).get("revision", 0))

    def count_prefix(self, prefix: bytes) -> int:
        answer = self._post("/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                                          "count_only": True}, "count keys")
        return int(answer.get("count", 0))

    def delete_prefix(self, prefix: bytes) -> int:
        answer = self._post("/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))},
                            "delete keys")
        return int(answer.get("deleted", 0))

    def grant_lease(self, ttl: int) -> int:
        answer = self._post("/lease/grant", {"TTL": str(int(ttl)), "ID": "0"}, "grant a lease")
        if answer.get("error"):
            raise EtcdRequestError(f"etcd refused to grant a lease: {answer['error']}.")
        return int(answer["ID"])

    def keep_alive_lease(self, lease_id: int) -> int:
        answer = self._post("/lease/keepalive", {"ID": str(lease_id)}, "refresh a lease")
        return int(answer.get("result", {}).get("TTL", -1))

    def revoke_lease(self, lease_id: int) -> None:
        try:
            self._post("/kv/lease/revoke", {"ID": str(lease_id)}, "revoke a lease")
        except EtcdRequestError as exc:
            if "lease not found" not in str(exc).lower():
                raise
        except EtcdLeaseNotFound:
            pass

    def watch_prefix(self, prefix: bytes, start_revision: int, timeout: float,
                     handle: Callable[[list[WatchEvent]], bool]) -> WatchEnd:
        return self._watch({"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                            "start_revision": str(start_revision)}, timeout, handle)

    def wait_for_change(self, key: bytes, start_revision: int, timeout: float) -> bool:
        end = self._watch({"key": _b64(key), "start_revision": str(start_revision), "filters": ["NODELETE"]},
                          timeout, lambda events: True)
        return end != "timeout"

    def _watch(self, request: dict[str, Any], timeout: float, handle: Callable[[list[WatchEvent]], bool]) -> WatchEnd:
        """One streaming watch request; see ``watch_prefix``. The socket's read timeout is the time left, so an
        idle watch needs no thread and costs etcd nothing."""
        if timeout <= 0:
            return "timeout"
        member = self._members[self._current]
        started = time.monotonic()
        try:
            self._authenticate(member)
            body = json.dumps({"create_request": request})
            self._count(1, len(body))
            client = member.client
            with client.session.post(client.get_url("/watch"), data=body, stream=True,
                                     headers={"Content-Type": "application/json"},
                                     timeout=(self.options.request_timeout, timeout)) as resp:
                if resp.status_code != 200:
                    if resp.status_code == 401 and self.options.user:
                        member.token = None
                    raise _Transient(f"watch answered HTTP {resp.status_code}: {_short(resp.text)}")
                for line in resp.iter_lines():
                    if not line:
                        continue
                    self._count(0, len(line))
                    message = json.loads(line)
                    if "error" in message:
                        if "auth" in json.dumps(message["error"]).lower() and self.options.user:
                            member.token = None
                        raise _Transient(f"watch failed: {_short(json.dumps(message['error']))}")
                    result = message.get("result", {})
                    if int(result.get("compact_revision", 0) or 0) > 0:
                        return "compacted"
                    if result.get("canceled"):
                        raise _Transient("etcd cancelled the watch")
                    events = [WatchEvent("delete" if e.get("type") == "DELETE" else "put", _kv(e.get("kv", {})))
                              for e in result.get("events") or []]
                    if events and handle(events):
                        return "done"
                    if time.monotonic() - started >= timeout:
                        return "timeout"
            raise _Transient("the watch stream ended")
        except SignalException:
            raise  # torch's agent stops with it (and then leaves the rendezvous open for the other nodes)
        except Exception as exc:  # noqa: BLE001 - timeouts, resets, restarts: the caller looks again
            elapsed = time.monotonic() - started
            if elapsed >= timeout * 0.98 and _is_timeout(exc):
                return "timeout"
            if isinstance(exc, (EtcdAuthError, EtcdTLSError)):
                raise
            log.debug("watch %s at %s failed (%s); looking again", request.get("key"), member.endpoint, exc)
            self._current = (self._current + 1) % len(self._members)
            time.sleep(max(0.0, min(timeout - elapsed, random.uniform(0.1, 0.5))))
            return "retry"

    def close(self) -> None:
        for member in self._members:
            try:
                member.client.session.close()
            except Exception:  # noqa: BLE001, S110 - best effort on shutdown
                pass


def _detail(exc: BaseException) -> str:
    text = getattr(exc, "detail_text", None)
    return str(text) if text else str(exc)


def _grpc_error(detail: str) -> tuple[int | None, str]:
    try:
        obj = json.loads(detail)
    except (ValueError, TypeError):
        return None, ""
    if not isinstance(obj, dict):
        return None, ""
    code = obj.get("code")
    return (int(code) if isinstance(code, (int, str)) and str(code).isdigit() else None,
            str(obj.get("message") or obj.get("error") or ""))


def _reason(detail: str) -> str:
    """A short reason for a connection failure (requests' messages run to several hundred characters)."""
    lowered = detail.lower()
    for needle, reason in (("connection refused", "connection refused"), ("timed out", "timed out"),
                           ("name or service not known", "host name does not resolve"),
                           ("failed to resolve", "host name does not resolve"),
                           ("no route to host", "no route to host"), ("connection reset", "connection reset"),
                           ("remotedisconnected", "connection closed by etcd"),
                           ("connection aborted", "connection closed by etcd")):
        if needle in lowered:
            return reason
    return _short(detail)


def _speaks_tls(endpoint: Endpoint, timeout: float) -> bool | None:
    """Whether the endpoint completes a TLS handshake (certificates not checked: this only detects the
    scheme); None when it cannot be reached."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=min(timeout, 3.0)) as sock:
            with context.wrap_socket(sock, server_hostname=endpoint.host):
                return True
    except ssl.SSLError as exc:
        return "wrong version number" not in str(exc).lower() and "record layer" not in str(exc).lower()
    except OSError:
        return None


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _is_timeout(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (requests.exceptions.Timeout, TimeoutError)) or "timed out" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False
