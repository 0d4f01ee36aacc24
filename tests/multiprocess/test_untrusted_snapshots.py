"""A snapshot never chooses code to run: a ``meta.json`` edited to name any callable makes ``load_model``,
``snapshot export``/``inspect``, ``report`` and a resuming job run nothing (a marker file would show it), and
each says in one line that the snapshot is damaged or that the model must be passed.

Two edits: a plain one (the snapshot's own checksum then says it is damaged), and one that also recomputes that
checksum (a checksum is no signature: ``load_model`` still refuses to import what the snapshot names).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

import elastic_runner
from elastic_runner.config import ConfigError
from elastic_runner.snapshot import LocalStore, SnapshotError
from elastic_runner.snapshot.format import meta_digest

from ..support import QUICKSTART, run_bounded

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A short real run (world size 1) with one snapshot."""
    run_dir = tmp_path_factory.mktemp("trusted") / "run"
    result = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(QUICKSTART),
                          "--set", f"run.dir={run_dir}", "--set", "train.max_steps=6", "--set", "train.epochs=1",
                          "--set", "snapshot.keep_last=1"], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    yield run_dir


def tampered(trained: Path, tmp_path: Path, marker: Path, recompute_checksum: bool) -> Path:
    """A copy of the run whose newest meta.json names ``os:system`` with a command that creates ``marker``."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    (newest,) = LocalStore(run_dir / "snapshots").complete()
    meta_path = run_dir / "snapshots" / newest.name / "meta.json"
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    meta["config"]["model"]["name"] = "os:system"
    meta["config"]["model"]["params"] = {"command": f"touch {marker}"}
    if recompute_checksum:
        meta["meta_sha256"] = meta_digest(meta)
    meta_path.write_text(json.dumps(meta))
    return run_dir


def elastic_runner_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_bounded([sys.executable, "-m", "elastic_runner", *args], timeout=120)


@pytest.mark.parametrize("recompute_checksum", [False, True], ids=["edited", "edited-with-its-checksum"])
def test_a_meta_json_naming_a_callable_runs_nothing(trained: Path, tmp_path: Path, recompute_checksum: bool) -> None:
    marker = tmp_path / "pwned"
    run_dir = tampered(trained, tmp_path, marker, recompute_checksum)
    path_before = list(sys.path)

    with pytest.raises((ConfigError, SnapshotError)) as err:
        elastic_runner.load_model(run_dir)
    said = str(err.value)
    if recompute_checksum:
        assert "never chooses code to run" in said and "load_model(run_dir, model)" in said
    else:
        assert "no intact snapshot" in said or "modified or damaged" in said
    with pytest.raises((ConfigError, SnapshotError)):
        elastic_runner.load_model(run_dir, trust_import_path="os:path")  # trusting something else is no trust
    assert sys.path == path_before, "load_model leaves sys.path as it was"

    for args in (("snapshot", "inspect", str(run_dir)), ("snapshot", "export", str(run_dir), "--out",
                                                         str(tmp_path / "model.pt")), ("report", str(run_dir))):
        elastic_runner_cli(*args)
    resumed = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(QUICKSTART),
                           "--set", f"run.dir={run_dir}", "--set", "train.max_steps=8", "--set", "train.epochs=1"],
                          timeout=180)
    assert not marker.exists(), "a snapshot's meta.json ran code"
    if not recompute_checksum:
        assert "modified or damaged" in resumed.stdout, resumed.stdout[-2000:]


def test_an_import_path_model_is_built_only_when_the_caller_names_it(trained: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The legitimate use: a model of the user's own module, named by the caller, found in the working directory
    for the call only."""
    (tmp_path / "usermodels.py").write_text(
        "from elastic_runner.workload.models import SmallCNN\n"
        "def build(num_classes=10, **params):\n"
        "    return SmallCNN((1, 8, 8), num_classes=num_classes, **params)\n")
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    (newest,) = LocalStore(run_dir / "snapshots").complete()
    meta_path = run_dir / "snapshots" / newest.name / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["model"]["name"] = "usermodels:build"
    meta["meta_sha256"] = meta_digest(meta)
    meta_path.write_text(json.dumps(meta))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        elastic_runner.load_model(run_dir)
    # The fix names no path to paste: the one the snapshot names was read from the run directory, not from the user.
    assert "trust_import_path='package.module:Class'" in str(refused.value)
    assert "usermodels:build" not in str(refused.value)
    path_before = list(sys.path)
    model = elastic_runner.load_model(run_dir, trust_import_path="usermodels:build")
    assert sys.path == path_before
    assert not model.training and sum(p.numel() for p in model.parameters()) > 0
    sys.modules.pop("usermodels", None)


def test_a_built_in_models_parameters_that_do_not_fit_its_weights_allocate_nothing(trained: Path,
                                                                                  tmp_path: Path) -> None:
    """An unsigned snapshot's config may ask for a model of any size: it is built on the meta device first and
    refused where its shapes are not those of the weights (before: a 10^6-channel CNN was allocated)."""
    import resource

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    (newest,) = LocalStore(run_dir / "snapshots").complete()
    meta_path = run_dir / "snapshots" / newest.name / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["model"]["params"] = {"channels": 1_000_000, "hidden": 1_000_000}
    meta["meta_sha256"] = meta_digest(meta)
    meta_path.write_text(json.dumps(meta))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError, match="does not have the shapes of its weights"):
        elastic_runner.load_model(run_dir)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000, "no gigabytes were allocated"


def test_with_the_jobs_key_a_snapshot_whose_numbers_were_changed_is_not_taken(tmp_path: Path) -> None:
    """A writer of the snapshot directory without the job's key rewrites state.pt and every checksum: a reader
    with the key (a resuming job, load_model) refuses it; its own snapshots carry the signature."""
    import hashlib
    import io
    import os

    import torch

    key = tmp_path / "job.key"
    key.write_text("k" * 64 + "\n")
    key.chmod(0o600)
    signed_env = os.environ | {"ELASTIC_RUNNER_AUTH_KEY_FILE": str(key)}
    run_dir = tmp_path / "run"
    trained = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(QUICKSTART),
                           "--set", f"run.dir={run_dir}", "--set", "train.max_steps=6", "--set", "train.epochs=1",
                           "--set", "snapshot.keep_last=1"], timeout=180, env=signed_env)
    assert trained.returncode == 0, trained.stdout[-3000:]
    (newest,) = LocalStore(run_dir / "snapshots").complete()
    folder = run_dir / "snapshots" / newest.name
    meta = json.loads((folder / "meta.json").read_text())
    assert len(meta["meta_hmac"]) == 64, "signed with the job's key"

    state = torch.load(folder / "state.pt", weights_only=True)
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}  # numbers of the writer's choosing
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (folder / "state.pt").write_bytes(buffer.getvalue())
    meta |= {"sha256": hashlib.sha256(buffer.getvalue()).hexdigest(), "size_bytes": len(buffer.getvalue())}
    meta["meta_sha256"] = meta_digest(meta)
    (folder / "meta.json").write_text(json.dumps(meta))

    os.environ["ELASTIC_RUNNER_AUTH_KEY_FILE"] = str(key)
    try:
        with pytest.raises(SnapshotError, match="no intact snapshot"):
            elastic_runner.load_model(run_dir)
    finally:
        del os.environ["ELASTIC_RUNNER_AUTH_KEY_FILE"]
    from elastic_runner.snapshot import format as snapshot_format

    assert snapshot_format._signing_key is None, "load_model leaves no key behind for the rest of the process"
    resumed = run_bounded([sys.executable, "-m", "elastic_runner.train", "--config", str(QUICKSTART),
                           "--set", f"run.dir={run_dir}", "--set", "train.max_steps=8", "--set", "train.epochs=1"],
                          timeout=180, env=signed_env)
    assert "is not signed with the job's key" in resumed.stdout, resumed.stdout[-3000:]
