"""A node lost, its agent killed alone, or the node preempted while its worker writes a snapshot: the write is torn (or,
on a preemption, finished within the grace period, and the worker's last step saved after it), and none of it costs
the job a step. The survivor keeps its process and trains on alone from its node memory, no step recomputed; no rank
ever loads a torn write; the new writer sweeps the torn one; every snapshot left complete at the end loads; every
sample of the run is seen exactly once.

The writer of a replicated job is rank 0's worker, so the fault strikes group rank 0's node: the job's store goes with
it, as in ``test_in_process_etcd.py``'s "rank 0 lost" (the survivor's worker finds that node's agent gone on its
liveness port). The model is large (~100 MB of state with momentum) so that a write lasts long enough to be struck in
the middle: the fault follows the sight of the write's staging directory within milliseconds.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.snapshot import LocalStore, load_snapshot
from elastic_runner.testing.etcd_server import EtcdServer

from ..support import events, job_key_file, of_agent, write_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]  # (its own waits: 120 s + 240 s)

#: etcd-v3's dead-node window here is 90 s (three keep-alives 30 s apart): a survivor that waited for the struck
#: node's lease would not end within the test's time. It is counted out on the liveness port instead.
WINDOW_CONF = "keep_alive_interval=30,keep_alive_max_attempt=3,last_call_timeout=1"
STEPS = 48


def _big_config(tmp: Path) -> Path:
    return write_config(tmp / "big.yaml", model={"name": "mlp", "params": {"hidden": 2048, "depth": 3}},
                        train={"epochs": 100, "max_steps": STEPS, "eval_every_steps": 0},
                        snapshot={"every_steps": 4, "keep_last": 3}, logging={"every_steps": 4})


def _strike_during_a_write(job: Any, store: LocalStore, timeout: float = 120) -> tuple[Any, str, int]:
    """Waits for a first complete snapshot, then for rank 0's next write to begin, and returns (rank 0's agent, the
    write's staging directory, and its worker's pid) the moment it does: the caller strikes at once."""
    deadline = time.monotonic() + timeout
    while not store.complete():
        assert time.monotonic() < deadline, job.logs_tail()
        time.sleep(0.01)
    writer = next(w for w in job.wait_for_workers(2, timeout=60) if w.rank == 0)  # looked up before: no delay after
    already = set(store.incomplete())
    while True:
        staging = [n for n in store.incomplete() if n.startswith(".tmp-step") and n not in already]
        if staging:
            return writer.agent, staging[0], writer.pid
        assert time.monotonic() < deadline, job.logs_tail()
        time.sleep(0.002)


@pytest.mark.parametrize("fault", ["node lost", "agent killed", "preempted"])
def test_a_fault_on_the_writers_node_during_a_snapshot_write_costs_nothing_and_no_torn_write_is_loaded(
        fault: str, local_job: Any, etcd: EtcdServer, tmp_path: Path) -> None:
    conf = f"{WINDOW_CONF},auth_key_file={job_key_file(tmp_path)}"
    job = local_job(config=str(_big_config(tmp_path)), nnodes="1:2", rdzv_backend="etcd-v3",
                    rdzv_endpoint=etcd.endpoint, rdzv_conf=conf, overrides=["recovery.in_process=true"])
    job.start_agent()
    job.start_agent()
    run_dir = Path(job.run_dir)
    store = LocalStore(run_dir / "snapshots")
    struck_node, staging, writer_pid = _strike_during_a_write(job, store)
    struck_at = time.time()
    if fault == "node lost":
        job.kill_agent(struck_node, signal.SIGKILL)  # the agent, the zygote, the worker and its writer at once
    elif fault == "agent killed":
        job.kill_agent(struck_node, signal.SIGKILL, with_workers=False)  # the rest must end with it
    else:
        job.kill_agent(struck_node, signal.SIGTERM)  # what Kubernetes sends on preemption
    complete_at_fault = {ref.name for ref in store.complete()}
    assert staging in store.incomplete() or fault != "node lost", "struck in the middle of the write"

    survivor = next(a for a in job.agents if a is not struck_node)
    codes = job.wait(timeout=240)
    assert codes[job.agents.index(survivor)] == 0, job.logs_tail()
    assert not job.leftover_processes(), job.leftover_processes()

    # The survivor kept its process and trained on alone.
    after = [e for e in events(run_dir, "start") if e["time"] > struck_at]
    assert after and all(e["world_size"] == 1 for e in after), after
    survivor_pids = {e["pid"] for e in events(run_dir, "start") if of_agent(e, survivor)}
    assert len(survivor_pids) == 1, survivor_pids
    (resumed,) = [e for e in events(run_dir, "resume") if e["time"] > struck_at]
    assert resumed["tier"] == "memory" and resumed["steps_recomputed"] == 0, resumed  # not a step lost

    # No rank loaded the torn write: what was loaded after the fault was complete then, or written after it by a
    # writer that lived to finish (the preempted worker's final save, the survivor's own).
    torn = "-".join(staging.removeprefix(".tmp-").split("-")[:4])  # step-S-gen-G of .tmp-step-S-gen-G-host-pid-ns
    loaded = [e for e in events(run_dir, "snapshot_loaded") if e["time"] > struck_at]
    finished = {ref.name for ref in store.complete()}
    if fault == "node lost":  # its writer died with it: the write was never published (the survivor's node-memory
        # copy of the same step is its own, whole and verified)
        assert torn not in finished and all(e["snapshot"] != torn or e["tier"] == "memory" for e in loaded), loaded
    if fault == "preempted":  # its worker finished the write in flight, then saved its last step
        saved = [e["snapshot"] for e in events(run_dir, "snapshot_saved") if e["pid"] == writer_pid]
        assert torn in saved and saved[-1] != torn, saved
    for e in loaded:
        assert e["tier"] == "memory" or e["snapshot"] in complete_at_fault | finished, e
    assert not [n for n in store.incomplete() if n.startswith(".tmp-")], "the torn write was swept"
    for ref in store.complete():  # every snapshot left whole verifies and loads
        meta, _ = load_snapshot(store.path(ref))
        assert meta["step"] == ref.step, (meta, ref)

    report = check_audit(run_dir)
    assert report.ok and report.finished and report.final_step == STEPS, report.render()
