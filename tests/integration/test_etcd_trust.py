"""What a job trusts in etcd, with real torchrun agents: a value planted by someone who can write etcd
runs nothing, and the etcd password reaches neither the workers' environment, the logs nor the run
directory (README, "Trust")."""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic_runner.rendezvous.backend import create_backend, encode_state
from elastic_runner.rendezvous.kv import Put
from elastic_runner.rendezvous.seal import Sealer
from elastic_runner.testing.etcd_server import EtcdServer, ServerTLS
from elastic_runner.testing.localjob import LocalJob

from ..support import ROOT, run_bounded, wait_for_step
from ..unit.test_etcd_fake import params
from .etcd_support import Certs, gateway_client

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


class _RunsCode:
    """A pickle that runs a command when it is loaded: what a writer of etcd could plant for torch's handler,
    which unpickles the rendezvous state it reads."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def plant(server: EtcdServer, key: str, value: bytes) -> None:
    admin = gateway_client(server)
    try:
        admin.txn((), [Put(key.encode(), value)])
    finally:
        admin.close()


def secret_file(path: Path, text: str) -> str:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def torchrun(endpoint: str, run_id: str, conf: str, config: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
            "--rdzv_backend=etcd-v3", f"--rdzv_endpoint={endpoint}", f"--rdzv_id={run_id}",
            f"--rdzv_conf=last_call_timeout=1,connect_timeout=10,{conf}".rstrip(","),
            "-m", "elastic_runner.train", "--config", str(config), "--set", f"run.dir={run_dir}"]


def test_a_planted_rendezvous_state_runs_nothing_and_without_a_key_stops_the_agent_with_a_sentence(
        etcd_server: EtcdServer, small_config: Path, tmp_path: Path) -> None:
    """torch's protocol (protocol=state) unpickles the state it reads; the lease protocol reads only JSON."""
    run_id = "planted-0"
    key = f"/trust/{run_id}/state"
    marker = tmp_path / "pwned"
    # Well framed (the CRC matches): only the content gives it away.
    plant(etcd_server, key, encode_state(pickle.dumps(_RunsCode(marker)), key=key))
    conf = "key_prefix=/trust,protocol=state"
    result = run_bounded(torchrun(etcd_server.endpoint, run_id, conf, small_config, tmp_path / "run"), timeout=90)

    assert result.returncode != 0, result.stdout[-3000:]
    assert not marker.exists(), "the planted pickle ran"
    assert f"etcd key '{key}'" in result.stdout and "etcdctl del" in result.stdout, result.stdout[-3000:]
    assert "is refused unread" in result.stdout, result.stdout[-3000:]
    assert not list((tmp_path / "run").glob("events/gen-*")), "no worker started (the agent's own log may exist)"


@pytest.mark.parametrize("content", ["code", "another-jobs-key"])
def test_with_a_job_key_a_state_not_signed_with_it_is_ignored_and_replaced(
        etcd_server: EtcdServer, small_config: Path, tmp_path: Path, content: str) -> None:
    """A planted state (a pickle that runs code, unsigned; or harmless content signed with another job's key) is
    ignored with one warning and replaced by the job's own: nothing runs, nothing stops, nothing closes."""
    run_id = f"planted-state-{content}"
    key = f"/trust/{run_id}/state"
    marker = tmp_path / "pwned"
    planted = encode_state(pickle.dumps(_RunsCode(marker)), key=key) if content == "code" else \
        encode_state(pickle.dumps(None), Sealer(b"o" * 64), key=key)
    plant(etcd_server, key, planted)
    conf = "key_prefix=/trust,protocol=state,auth_key_file=" + secret_file(tmp_path / "job.key", "k" * 64)
    result = run_bounded(torchrun(etcd_server.endpoint, run_id, conf, small_config, tmp_path / "run"), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert not marker.exists(), "the planted pickle ran"
    warned = [line for line in result.stdout.splitlines() if f"Ignoring the rendezvous state in '{key}'" in line]
    assert 1 <= len(warned) <= 2, result.stdout[-3000:]  # at most one a minute per agent process (and its workers')
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize("signed_by", [None, b"o" * 64], ids=["unsigned", "another-jobs-key"])
def test_a_planted_round_record_seats_nobody_and_stops_nothing(etcd_server: EtcdServer, small_config: Path,
                                                              tmp_path: Path, signed_by: bytes | None) -> None:
    """The lease protocol: a round record that seats a node of the planter's choosing, not signed with this job's
    key, is void: the agent says so once, deletes it, and the job trains with its own record; nothing closes it."""
    run_id = f"planted-round-{'other' if signed_by else 'unsigned'}"
    key = f"/trust/{run_id}/rdzv/ctl/round"
    record = json.dumps({"round": 3, "members": [["10.9.9.9_1_0", 1]], "lease": 0}).encode()
    plant(etcd_server, key, Sealer(signed_by).seal(key.encode(), record) if signed_by else record)
    conf = "key_prefix=/trust,auth_key_file=" + secret_file(tmp_path / "job.key", "k" * 64)
    result = run_bounded(torchrun(etcd_server.endpoint, run_id, conf, small_config, tmp_path / "run"), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    expected = "its signature does not verify" if signed_by else "it is not signed"
    ignored = [line for line in result.stdout.splitlines() if f"Ignoring the rendezvous record '{key}': {expected}" in line]
    assert len(ignored) == 1, result.stdout[-3000:]
    assert "10.9.9.9" not in "".join(line for line in result.stdout.splitlines() if "seated" in line)
    assert "Traceback" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "elastic-runner"])
def test_the_etcd_password_reaches_no_worker_environment_log_or_file(
        etcd_factory: Callable[..., EtcdServer], certs: Certs, small_config: Path,
        local_job: Callable[..., LocalJob], tmp_path: Path, launcher: str) -> None:
    """elastic-runner launch hands its settings to the workers through the environment; torchrun logs them."""
    password = "pw-" + os.urandom(12).hex()  # unique: found anywhere, it came from this run
    auth_server = etcd_factory(tls=ServerTLS(certs.server_cert, certs.server_key, certs.ca))
    auth_server.enable_auth("root", password)
    job_key = secret_file(tmp_path / "job.key", os.urandom(32).hex())
    conf = (f"{LocalJob.rdzv_conf},user=root,cacert={certs.ca},"
            f"password_file={secret_file(tmp_path / 'pw', password)},auth_key_file={job_key}")
    job = local_job(config=str(small_config), nnodes="1:2", rdzv_backend="etcd-v3",
                    rdzv_endpoint=auth_server.endpoint, rdzv_conf=conf, log_dir=str(tmp_path / "logs"), launcher=launcher,
                    overrides=["train.max_steps=40", "data.sampler=tests.broken_components:PacedSampler"])
    run_dir = Path(job.run_dir)
    job.start_agent()
    wait_for_step(run_dir, 3, timeout=90, job=job)
    environments = []
    for worker in job.workers():
        environments.append(Path(f"/proc/{worker.pid}/environ").read_bytes())
    assert environments, "no worker to look at"
    assert job.wait(timeout=120) == [0], job.logs_tail()

    secret = password.encode()
    for env in environments:
        assert secret not in env, "the password is in a worker's environment"
        assert b"PET_RDZV_CONF" not in env or b"password=" not in env
    written = [p for d in (run_dir, tmp_path / "logs") for p in d.rglob("*") if p.is_file()]
    assert written
    for path in written:
        assert secret not in path.read_bytes(), f"the password is in {path}"
        assert open(job_key).read().strip().encode() not in path.read_bytes(), f"the job key is in {path}"


def test_make_secrets_gives_an_etcd_and_clients_that_accept_each_other_and_nobody_else(
        etcd_factory: Callable[..., EtcdServer], tmp_path: Path) -> None:
    """k8s/make-secrets.sh's files, used as the manifests use them: etcd serves with the server certificate
    and demands client certificates; the training pods' certificate and job key work."""
    out = tmp_path / "secrets"
    result = subprocess.run([str(ROOT / "k8s" / "make-secrets.sh"), "--files-only", "test-ns"],
                            env=os.environ | {"OUT": str(out)}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for private in ("ca.key", "peer-ca.key", "server.key", "peer.key", "client.key", "rdzv.key"):
        assert stat.S_IMODE((out / private).stat().st_mode) == 0o600, private
    for job in ("job-a", "job-b"):  # one key per Job, beside the same certificates
        made = subprocess.run([str(ROOT / "k8s" / "make-secrets.sh"), "--files-only", "--job", job, "test-ns"],
                              env=os.environ | {"OUT": str(out)}, capture_output=True, text=True, timeout=120)
        assert made.returncode == 0 and f"rdzv-{job}.key" in made.stdout, made.stderr[-2000:]
    keys = {(out / name).read_text() for name in ("rdzv.key", "rdzv-job-a.key", "rdzv-job-b.key")}
    assert len(keys) == 3, "each Job's key is its own"
    refused = subprocess.run([str(ROOT / "k8s" / "make-secrets.sh"), "--files-only", "--job", "Job_1"],
                             env=os.environ | {"OUT": str(out)}, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--job 'Job_1' is not a Kubernetes name" in refused.stderr
    server = etcd_factory(tls=ServerTLS(str(out / "server.crt"), str(out / "server.key"), str(out / "ca.crt"),
                                        client_cert_auth=True, client_cert=str(out / "client.crt"),
                                        client_key=str(out / "client.key")))
    tls = {"cacert": str(out / "ca.crt"), "cert": str(out / "client.crt"), "key": str(out / "client.key")}
    backend, store = create_backend(params(server.endpoint, "secrets", auth_key_file=str(out / "rdzv.key"), **tls))
    assert backend.set_state(b"x")[2] is True
    store.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(RendezvousConnectionError, match="certificate"):
        create_backend(params(server.endpoint, "secrets", cacert=str(out / "ca.crt"), connect_timeout="3"))
    # A peer's certificate (another CA) is no client's.
    for name in ("peer",):
        with pytest.raises(RendezvousConnectionError):
            create_backend(params(server.endpoint, "secrets", cacert=str(out / "ca.crt"), cert=str(out / f"{name}.crt"),
                                  key=str(out / f"{name}.key"), connect_timeout="3"))
