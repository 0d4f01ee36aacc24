"""Prometheus metrics of a live run: scraped over HTTP, and by a real Prometheus server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_runner.testing import debian
from elastic_runner.testing.localjob import descendants, free_port

from ..support import write_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def free_port_pair() -> int:
    """A port P with P+1 also free (workers serve metrics.port + LOCAL_RANK)."""
    for _ in range(50):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def scrape(port: int) -> dict[str, tuple[str, dict[tuple, float]]]:
    """name -> (type, {labels: value}) for every family at 127.0.0.1:port/metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, tuple[str, dict[tuple, float]]] = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = (family.type, {tuple(sorted([*s.labels.items(), ("__sample__", s.name)])): s.value
                                          for s in family.samples})
    return out


def value(metrics: dict, family: str, sample: str | None = None) -> float:
    _, samples = metrics[family]
    return next(v for k, v in samples.items() if dict(k)["__sample__"] == (sample or family))


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[tuple[int, int, Path]]:
    """A 2-worker run under elastic-runner launch with worker and agent metrics on."""
    config = write_config(tmp_path / "m.yaml", train={"epochs": 200, "max_steps": None, "eval_every_steps": 0},
                          metrics={"port": free_port_pair()}, logging={"every_steps": 10})
    import yaml

    port = yaml.safe_load(config.read_text())["metrics"]["port"]
    agent_port = free_port()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "elastic_runner", "launch", "--standalone", "--nproc_per_node=2",
                             "-m", "elastic_runner.train", "--config", str(config), "--set", f"run.dir={run_dir}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env=os.environ | {"ELASTIC_RUNNER_AGENT_METRICS_PORT": str(agent_port), "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if value(scrape(port + 1), "elastic_runner_steps", "elastic_runner_steps_total") > 0:
                    break
            except (OSError, KeyError, StopIteration):
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the run never served metrics"
            time.sleep(0.3)
        yield port, agent_port, run_dir
    finally:
        for pid in descendants(proc.pid) + [proc.pid]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        proc.wait()


def test_every_worker_serves_its_metrics_and_they_move(live_run: tuple[int, int, Path]) -> None:
    port, agent_port, _ = live_run
    first = {rank: scrape(port + rank) for rank in (0, 1)}
    time.sleep(1.5)
    second = {rank: scrape(port + rank) for rank in (0, 1)}
    expected_types = {
        "elastic_runner_steps": "counter", "elastic_runner_samples": "counter",
        "elastic_runner_step_duration_seconds": "histogram", "elastic_runner_data_wait_seconds": "histogram",
        "elastic_runner_loss": "gauge", "elastic_runner_learning_rate": "gauge", "elastic_runner_world_size": "gauge",
        "elastic_runner_micro_batch_size": "gauge", "elastic_runner_accumulation_steps": "gauge",
        "elastic_runner_restarts": "counter", "elastic_runner_membership_changes": "counter",
        "elastic_runner_resume_generation": "gauge", "elastic_runner_snapshot_blocking_seconds": "histogram",
        "elastic_runner_snapshot_write_seconds": "histogram", "elastic_runner_snapshot_size_bytes": "gauge",
        "elastic_runner_last_snapshot_timestamp_seconds": "gauge", "elastic_runner_recovery_duration_seconds": "gauge",
        "elastic_runner_steps_recomputed": "gauge", "elastic_runner_build_info": "gauge",
        "elastic_runner_goodput_ratio": "gauge",
    }
    for rank in (0, 1):
        m = second[rank]
        for name, kind in expected_types.items():
            assert name in m, f"rank {rank} lacks {name}"
            assert m[name][0] == kind, f"{name} is a {m[name][0]}, expected {kind}"
        assert value(m, "elastic_runner_world_size") == 2
        labels = {dict(k).get("rank") for k in m["elastic_runner_steps"][1]}
        assert labels == {str(rank)}, "bounded labels: the rank only"
        assert value(m, "elastic_runner_steps", "elastic_runner_steps_total") > value(
            first[rank], "elastic_runner_steps", "elastic_runner_steps_total"), "steps move"
        assert value(m, "elastic_runner_step_duration_seconds", "elastic_runner_step_duration_seconds_count") > 0
        assert not [n for n in m if n.endswith("_created")], "no _created series: one series per instrument"
        assert 0 < value(m, "elastic_runner_goodput_ratio") <= 1
    assert value(second[0], "elastic_runner_snapshot_size_bytes") > 0, "rank 0 writes snapshots"
    agent = scrape(agent_port)
    assert agent["elastic_runner_agent_rendezvous"][0] == "counter"
    assert value(agent, "elastic_runner_agent_rendezvous", "elastic_runner_agent_rendezvous_total") >= 1
    states = {dict(k)["state"]: v for k, v in agent["elastic_runner_agent_worker_group_state"][1].items()}
    assert states["HEALTHY"] == 1 and sum(states.values()) == 1
    assert value(agent, "elastic_runner_agent_remaining_restarts") >= 0
    # The agent's goodput from the clock its workers keep (moved on to the scrape): the job trains steadily.
    assert 0.3 < value(agent, "elastic_runner_agent_goodput_ratio") <= 1


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found:
        return found
    if not debian.can_install():
        pytest.skip("Prometheus is not installed and installing it needs root (apt-get install prometheus)")
    result = debian.apt_install("prometheus")
    assert result.returncode == 0, f"installing prometheus failed: {result.stderr[-2000:]}"
    found = shutil.which("prometheus")
    assert found, "apt-get installed prometheus but the binary is not on PATH"
    return found


def test_a_real_prometheus_server_scrapes_both_ranks(live_run: tuple[int, int, Path], tmp_path: Path) -> None:
    port, agent_port, _ = live_run
    binary = prometheus_binary()
    web_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: elastic-runner\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{port}', '127.0.0.1:{port + 1}', '127.0.0.1:{agent_port}']}}]\n"
    )
    server = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{web_port}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        query = urllib.parse.urlencode({"query": "elastic_runner_steps_total"})
        deadline = time.monotonic() + 60
        ranks: set[str] = set()
        while time.monotonic() < deadline and ranks != {"0", "1"}:
            try:
                import json

                body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{web_port}/api/v1/query?{query}", timeout=5).read())
                ranks = {r["metric"]["rank"] for r in body["data"]["result"] if float(r["value"][1]) > 0}
            except OSError:
                pass
            time.sleep(0.5)
        assert ranks == {"0", "1"}, f"Prometheus has elastic_runner_steps_total for ranks {ranks}"
    finally:
        server.kill()
        server.wait()


def test_a_busy_metrics_port_only_warns(small_config: Path, tmp_path: Path) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "elastic_runner.train", "--config", str(small_config),
                                 "--set", f"run.dir={tmp_path}", "--set", f"metrics.port={busy}",
                                 "--set", "train.max_steps=5"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"metrics: cannot serve on 127.0.0.1:{busy}" in result.stderr and "training continues" in result.stderr
