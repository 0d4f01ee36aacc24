"""The production path on a CUDA device (NCCL): a sharded model with bf16 compute or CPU offload, and a compiled
model, each recovering from a worker SIGKILL bitwise. One agent of one worker (a single GPU: NCCL refuses two ranks
on one device), the GPT of configs/gpt-fsdp.yaml, deterministic algorithms (cuBLAS's fixed workspace) so that an
uninterrupted run and a faulted one can be compared bit for bit.

Where there is no CUDA device these skip with the reason; the same paths run on CPU/gloo in test_sharded.py and
test_compile.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from elastic_runner import load_model
from elastic_runner.observe.audit import check_audit

from ..support import assert_bitwise_equal, events, exported_model, kill_worker_at_step, run_uninterrupted

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 60


def cuda_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (NCCL is the production path; this machine has none)")


def gpu_config(path: Path, parallel: dict, **sections: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load((ROOT / "configs" / "gpt-fsdp.yaml").read_text())
    data["parallel"] = data["parallel"] | parallel
    data["data"]["params"]["text"] = str(ROOT / "examples" / "data" / "shakespeare.txt")
    data["data"]["path"] = str(path.parent / "tokens")
    data["run"] |= {"deterministic": True}
    data["dist"] = {"backend": "auto", "device": "auto"}
    data["train"] = {"max_steps": STEPS, "eval_every_steps": 0}
    data["snapshot"] = {"every_steps": 20, "keep_last": 3, "memory_every_steps": 10}
    data["schedule"]["warmup_steps"] = 10
    data["audit"] = {"samples": True}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(data))
    return path


def recovers_bitwise(config: Path, tmp_path: Path, local_job, what: str) -> dict[str, torch.Tensor]:  # noqa: ANN001
    uninterrupted = exported_model(run_uninterrupted(config, tmp_path / "uninterrupted" / "run", agents=1,
                                                     timeout=400), tmp_path)
    job = local_job(config=str(config), nnodes="1:1", nproc_per_node=1)
    job.start_agent()
    kill_worker_at_step(job, 25, rank=0, count=1, timeout=300)
    assert job.wait(timeout=400) == [0], job.logs_tail()
    run_dir = Path(job.run_dir)
    resumed = [e for e in events(run_dir, "resume") if e["generation"] > 1]
    assert resumed and resumed[0]["step"] >= 20, f"{what}: resumed from a copy at or after step 20: {resumed}"
    report = check_audit(run_dir)
    assert report.ok and report.finished and report.final_step == STEPS, f"{what}: {report.render()}"
    ours = exported_model(run_dir, tmp_path)
    assert_bitwise_equal(ours, uninterrupted)
    assert all(v.dtype == torch.float32 for v in ours.values() if v.is_floating_point()), \
        f"{what}: the saved weights are the float32 masters, whatever the compute dtype"
    plain = load_model(run_dir)
    assert all(torch.equal(v, ours[k]) for k, v in plain.state_dict().items())
    return ours


@pytest.mark.parametrize("parallel", [{"mixed_precision": "bf16"}, {"offload": True}], ids=["bf16", "offload"])
def test_a_sharded_model_on_nccl_recovers_from_a_worker_kill_bitwise(parallel: dict, local_job,  # noqa: ANN001
                                                                     tmp_path: Path) -> None:
    cuda_or_skip()
    config = gpu_config(tmp_path / "cfg" / "gpu.yaml", {"strategy": "fsdp"} | parallel)
    recovers_bitwise(config, tmp_path, local_job, f"fsdp {parallel}")


def test_a_compiled_model_on_cuda_recovers_from_a_worker_kill_bitwise(local_job, tmp_path: Path) -> None:  # noqa: ANN001
    cuda_or_skip()
    config = gpu_config(tmp_path / "cfg" / "gpu.yaml", {"strategy": "ddp"}, model={"compile": True})
    ours = recovers_bitwise(config, tmp_path, local_job, "compiled ddp")
    assert not any("_orig_mod" in k for k in ours), "snapshot keys are the plain model's"
