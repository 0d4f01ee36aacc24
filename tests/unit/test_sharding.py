"""Sharded models (``parallel.strategy: fsdp | hsdp``): the step's gradient is the exact mean over the global batch at
any world size (a SUM of FSDP2's reduce-scatter, never gloo's AVG), and a sharded snapshot — every rank its own
part — loads into any world size and strategy with every tensor exact; a torn or tampered one is never taken.

Each multi-rank case runs in W new processes on a gloo process group (forked from a server that imported torch).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from time import sleep, time, time_ns
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastic_runner.config import ConfigError, EvalConfig, ModelConfig, ParallelConfig, config_from_dict
from elastic_runner.data.layout import BatchLayout, split_even
from elastic_runner.data.sampler import StepPlan
from elastic_runner.snapshot import LocalStore, SnapshotError, find_newest, load_snapshot
from elastic_runner.snapshot.interval import refresh_steps
from elastic_runner.snapshot.publish import write_sharded
from elastic_runner.snapshot.store import SnapshotRef, StaleWriterError
from elastic_runner.training.gradients import StepGradients
from elastic_runner.training.parts import TrainingParts
from elastic_runner.training.sharding import FSDPSync, localize, shard_model, wrap_units
from elastic_runner.training.state import TrainState
from elastic_runner.training.step import TrainStep
from elastic_runner.workload.tasks import build_task

from ..support import start_ranks
from .test_gradients import GLOBAL, _Dist, _padded_batch, _token_loss, _token_model, _token_rows, _tokens

CPU = torch.device("cpu")


def _spawn(target: Any, world: int, tmp: Path, job: dict[str, Any]) -> None:
    store = tempfile.mktemp(dir=tmp)
    start_ranks(target, (world, store, job), world)


def _up(rank: int, world: int, store_path: str) -> None:
    import torch._dynamo  # noqa: F401 - before the process group, as worker.group.up does
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.FileStore(store_path, world), rank=rank, world_size=world)


def _down() -> None:
    """Leave the process group with nothing of FSDP's left holding its subgroups (gloo's threads end with it)."""
    import gc

    import torch.distributed as tdist

    gc.collect()
    tdist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


# -- the gradient ----------------------------------------------------------------------------------------------


def _gradient_worker(rank: int, world: int, store_path: str, job: dict[str, Any]) -> None:
    _up(rank, world, store_path)
    torch.manual_seed(1 + rank)  # different on every rank: shard_model takes rank 0's
    model = _token_model().double()
    shard_model(model, ParallelConfig(strategy=job["strategy"]), CPU, world, job.get("local_world", world))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = job["micro"]
    layout = BatchLayout(world, GLOBAL, max(1, -(-GLOBAL // world) // micro), micro,
                         tuple(len(range(r, GLOBAL, world)) for r in range(world)))
    parts = TrainingParts(model=model, optimizer=optimizer, scheduler=None, scaler=None, sampler=None,
                          state=TrainState())
    data = _tokens()
    stand_in_batch = _token_rows(data, 0, [0, 1])
    sync = FSDPSync(model, lambda module: _token_loss(module, stand_in_batch)[0].sum())
    gradients = StepGradients(_Dist(world), model, job["clip"], job.get("on_nonfinite", "stop"), None, averages_over=1)

    def loss(module: nn.Module, batch: Any) -> Any:
        losses, counts = _token_loss(module, batch)
        return (losses * float("nan") if rank == job.get("nan_on") else losses), counts

    task = build_task(ModelConfig(loss="cross_entropy"), EvalConfig(), loss=loss)
    step = TrainStep(parts, sync, task, layout, gradients, seed=0, rank=rank, device=CPU, precision="fp32")
    mine = list(range(GLOBAL))[rank::world]
    plan = StepPlan(epoch=0, start=0, global_count=GLOBAL, indices=mine)
    batches = iter([_token_rows(data, 1, list(p)) for p in split_even(mine, micro) if p])
    result = step.compute(1, plan, batches)
    applied = _Dist(world).all_gather_object(result.apply)
    grads = [_full(p.grad) for p in model.parameters()] if result.apply else []
    if rank == 0:
        torch.save(grads if job.get("nan_on") is None else applied, job["out"])
    del step, sync, parts, model, optimizer
    _down()


@pytest.mark.slow
@pytest.mark.parametrize("clip", [None, 0.05])
def test_the_sharded_gradient_is_the_exact_mean_at_any_world_size(tmp_path: Path, clip: float | None) -> None:
    """A token-weighted loss, world sizes 1-4, some micro-steps empty (3 ranks x 4): the gradient of one process."""
    torch.manual_seed(1)
    model = _token_model().double()
    ids, labels = _padded_batch()
    losses, counts = _token_loss(model, (ids, labels))
    ((losses * counts).sum() / counts.sum()).backward()
    if clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    expected = [p.grad for p in model.parameters()]
    cases = [("fsdp", 1, 1, 1), ("fsdp", 2, 2, 2), ("fsdp", 3, 4, 3), ("fsdp", 4, 1, 4), ("hsdp", 4, 2, 2)]
    if clip is not None:  # the clipping norm is over every shard: where there are shards of unequal size, and replicas
        cases = [("fsdp", 3, 4, 3), ("hsdp", 4, 2, 2)]
    for strategy, world, micro, local_world in cases:
        out = tmp_path / f"grads-{strategy}-{world}.pt"
        _spawn(_gradient_worker, world, tmp_path,
               dict(strategy=strategy, micro=micro, clip=clip, out=str(out), local_world=local_world))
        got = torch.load(out)
        for e, g in zip(expected, got):
            assert torch.allclose(e, g, rtol=0, atol=1e-12), f"{strategy} at world {world}, {micro} micro-batches"


def test_a_nan_loss_on_one_rank_skips_the_update_on_every_rank(tmp_path: Path) -> None:
    """Each rank sees only its slice of the gradient: whether it is finite is decided for all (train.on_nonfinite)."""
    out = tmp_path / "applied.pt"
    _spawn(_gradient_worker, 3, tmp_path, dict(strategy="fsdp", micro=1, clip=None, out=str(out), nan_on=2,
                                               on_nonfinite="skip"))
    assert torch.load(out) == [False, False, False]


# -- sharded snapshots -------------------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.BatchNorm1d(3))


def _whole_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    opt = optimizer.state_dict()
    return {"model": {k: _full(v).clone() for k, v in model.state_dict().items()},
            "optimizer": {i: {n: _full(v).clone() for n, v in s.items()} for i, s in opt["state"].items()}}


def _store(job: dict[str, Any], rank: int) -> Any:
    """The job's snapshot store as this rank sees it: a directory, or a bucket with a node directory of its own."""
    from elastic_runner.snapshot import open_store

    return open_store(job["dir"], local=Path(job["local"]) / f"rank-{rank}" if "local" in job else None)


def _save_worker(rank: int, world: int, store_path: str, job: dict[str, Any]) -> None:
    """Train one step sharded, write a sharded snapshot (every rank its part), rank 0 the whole state for reference."""
    from elastic_runner.snapshot.shards import split

    _up(rank, world, store_path)
    torch.manual_seed(0)
    model = _mlp()
    shard_model(model, ParallelConfig(strategy=job["strategy"]), CPU, world, job["local_world"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(6, 5, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "train": {"step": 1}}
    replicated, tensors, offsets = split(state)
    store = _store(job, rank)
    writers = list(range(world)) if job["strategy"] == "fsdp" else list(range(job["local_world"]))
    write_sharded(store, 1, 3, SnapshotRef(generation=1, step=1),
                  {"replicated": replicated if rank == 0 else None, "part": {"tensors": tensors, "offsets": offsets}},
                  {"step": 1, "generation": 1, "world_size": world}, rank=rank, writers=writers)
    whole = _whole_state(model, optimizer)
    if rank == 0:
        torch.save(whole, job["out"])
    del model, optimizer
    _down()


def _load_worker(rank: int, world: int, store_path: str, job: dict[str, Any]) -> None:
    """Load the newest snapshot into this layout (sharded or whole) and save what every tensor became, whole."""
    _up(rank, world, store_path)
    torch.manual_seed(5)
    model = _mlp()
    if job["strategy"] != "ddp":
        shard_model(model, ParallelConfig(strategy=job["strategy"]), CPU, world, job["local_world"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    loaded = find_newest(_store(job, rank)) if rank == 0 else None
    import torch.distributed as tdist

    box = [loaded.ref.name if loaded is not None else None]
    tdist.broadcast_object_list(box)
    from elastic_runner.snapshot import load_exact

    loaded = load_exact(_store(job, rank), SnapshotRef.parse(box[0]), map_location="cpu")  # type: ignore[arg-type]
    state = localize(loaded.state, model, optimizer, loaded.parts)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"] | {"param_groups": optimizer.state_dict()["param_groups"]})
    whole = _whole_state(model, optimizer)
    if rank == 0:
        torch.save(whole, job["out"])
    del model, optimizer
    _down()


def _saved_sharded(tmp: Path, strategy: str = "fsdp", world: int = 2, local_world: int = 2) -> tuple[Path, dict]:
    directory = tmp / f"snapshots-{strategy}-{world}"
    LocalStore(directory).claim_generation({})
    out = tmp / f"saved-{strategy}-{world}.pt"
    _spawn(_save_worker, world, tmp, dict(strategy=strategy, local_world=local_world, dir=str(directory), out=str(out)))
    return directory, torch.load(out)


def _assert_same(a: dict, b: dict, what: str) -> None:
    for section in ("model", "optimizer"):
        flat_a = a[section] if section == "model" else {f"{i}/{n}": v for i, s in a[section].items() for n, v in s.items()}
        flat_b = b[section] if section == "model" else {f"{i}/{n}": v for i, s in b[section].items() for n, v in s.items()}
        assert flat_a.keys() == flat_b.keys(), what
        differ = [k for k in flat_a if not torch.equal(flat_a[k], flat_b[k])]
        assert not differ, f"{what}: {section} {differ} differ"


@pytest.mark.slow
def test_a_sharded_snapshot_reshards_to_any_world_size_and_strategy_exactly(tmp_path: Path) -> None:
    directory, saved = _saved_sharded(tmp_path)
    parts = sorted(p.name for p in next(directory.glob("step-*")).glob("part-*.bin"))
    assert parts == ["part-00000.bin", "part-00001.bin"]
    meta, state = load_snapshot(next(directory.glob("step-*")))  # export, load_model: whole tensors
    assert all(torch.equal(state["model"][k], v) for k, v in saved["model"].items())
    assert len(meta["sharded"]["parts"]) == 2
    for strategy, world, local_world in (("ddp", 1, 1), ("fsdp", 1, 1), ("fsdp", 3, 3), ("hsdp", 4, 2), ("ddp", 2, 2)):
        out = tmp_path / f"loaded-{strategy}-{world}.pt"
        _spawn(_load_worker, world, tmp_path, dict(strategy=strategy, local_world=local_world, dir=str(directory),
                                                   out=str(out)))
        _assert_same(torch.load(out), saved, f"fsdp at 2 -> {strategy} at {world}")


@pytest.mark.slow
def test_an_hsdp_snapshot_is_written_by_the_first_replica_and_loads_into_fsdp(tmp_path: Path) -> None:
    from elastic_runner.snapshot.cli import inspect

    directory, saved = _saved_sharded(tmp_path, "hsdp", world=4, local_world=2)
    snapshot = next(directory.glob("step-*"))
    assert sorted(p.name for p in snapshot.glob("part-*.bin")) == ["part-00000.bin", "part-00001.bin"]
    (entry,) = inspect(str(directory))["snapshots"]
    on_disk = sum(p.stat().st_size for p in [snapshot / "state.pt", *snapshot.glob("part-*.bin")])
    assert entry["parts"] == 2 and entry["size_bytes"] == on_disk, "inspect counts the parts, not state.pt alone"
    out = tmp_path / "loaded.pt"
    _spawn(_load_worker, 3, tmp_path, dict(strategy="fsdp", local_world=3, dir=str(directory), out=str(out)))
    _assert_same(torch.load(out), saved, "hsdp 2x2 -> fsdp at 3")


def test_a_replicated_snapshot_loads_into_a_sharded_model(tmp_path: Path) -> None:
    """A DDP run's snapshot (whole tensors) resumes under fsdp: each rank takes its slice."""
    from elastic_runner.snapshot.publish import write_and_publish

    torch.manual_seed(0)
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(6, 5)).square().sum().backward()
    optimizer.step()
    directory = tmp_path / "snapshots"
    store = LocalStore(directory)
    store.claim_generation({})
    write_and_publish(store, 1, 3, SnapshotRef(generation=1, step=1),
                      {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "train": {}},
                      {"step": 1, "generation": 1})
    out = tmp_path / "loaded.pt"
    _spawn(_load_worker, 3, tmp_path, dict(strategy="fsdp", local_world=3, dir=str(directory), out=str(out)))
    _assert_same(torch.load(out), _whole_state(model, optimizer), "ddp -> fsdp at 3")


@pytest.mark.parametrize("damage", ["missing part", "truncated part", "changed part", "part list edited"])
def test_a_torn_or_tampered_sharded_snapshot_is_moved_aside(tmp_path: Path, damage: str) -> None:
    directory, _ = _saved_sharded(tmp_path)
    snapshot = next(directory.glob("step-*"))
    part = snapshot / "part-00001.bin"
    if damage == "missing part":
        part.unlink()
    elif damage == "truncated part":
        os.truncate(part, part.stat().st_size // 2)
    elif damage == "changed part":
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(bytes(data))
    else:
        meta = (snapshot / "meta.json").read_text()
        (snapshot / "meta.json").write_text(meta.replace('"part-00001.bin"', '"part-00000.bin"', 1))
    rejected: list[str] = []
    with pytest.raises(SnapshotError, match="damaged"):
        find_newest(LocalStore(directory), on_rejected=lambda ref, why: rejected.append(why))
    assert len(rejected) == 1 and ("part-00001" in rejected[0] or "meta.json" in rejected[0]), rejected
    assert (directory / f"corrupt-{snapshot.name}").is_dir() and not snapshot.exists()


def test_a_stale_generation_cannot_publish_a_sharded_snapshot(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "snapshots")
    store.claim_generation({})
    store.claim_generation({})  # a newer round owns the run
    part = {"tensors": {"model/w": torch.ones(2)}, "offsets": {"model/w": [0]}}
    with pytest.raises(StaleWriterError):
        write_sharded(store, 1, 3, SnapshotRef(generation=1, step=5), {"replicated": {"model": {}}, "part": part},
                      {"step": 5, "generation": 1}, rank=0, writers=[0])
    assert store.complete() == []


def test_a_rank_with_no_part_to_write_leaves_nothing_beside_the_published_snapshot(tmp_path: Path) -> None:
    """hsdp's second replica writes no part; arriving after rank 0 published, it must not make the staging
    directory again (before: a `.tmp-...-sharded` leftover that `snapshot inspect` lists as incomplete)."""
    store = LocalStore(tmp_path / "snapshots")
    store.claim_generation({})
    ref = SnapshotRef(generation=1, step=5)
    meta = {"step": 5, "generation": 1, "world_size": 4, "run_uid": "ours", "fingerprint": {"model": "x"}}
    for rank in (1, 0, 2, 3):  # ranks 2 and 3 (the second replica) come last
        part = {"tensors": {"model/w": torch.full((2,), float(rank))}, "offsets": {"model/w": [2 * rank]}}
        written = write_sharded(store, 1, 3, ref, {"replicated": {"model": {}} if rank == 0 else None, "part": part},
                                meta, rank=rank, writers=[0, 1])
        assert rank < 2 or written.meta["part"] is None
    assert store.complete() == [ref] and store.incomplete() == []


# -- what is sharded, and bad input ------------------------------------------------------------------------------


def test_wrap_auto_takes_gpt_blocks_huggingface_blocks_or_the_children() -> None:
    from elastic_runner.workload.gpt import GPT, Block

    gpt = GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)
    assert [type(m) for m in wrap_units(gpt, "auto")] == [Block, Block]

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    class HFStyle(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer(), Layer()])
            self.head = nn.Linear(2, 2)

    assert [type(m).__name__ for m in wrap_units(HFStyle(), "auto")] == ["Layer"] * 3
    plain = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
    assert wrap_units(plain, "auto") == [plain[0], plain[2]]
    hf = HFStyle()
    assert wrap_units(hf, ["Linear"]) == [layer.lin for layer in hf.layers] + [hf.head]
    with pytest.raises(ConfigError, match=r"parallel.wrap: the model has no module of class Blocks.*it has:.*Linear"):
        wrap_units(plain, ["Blocks"])


@pytest.mark.parametrize("parallel, key", [
    ({"strategy": "zero"}, "parallel.strategy"),
    ({"strategy": "fsdp", "wrap": "Block"}, "parallel.wrap"),
    ({"strategy": "fsdp", "wrap": []}, "parallel.wrap"),
    ({"strategy": "ddp", "offload": True}, "parallel.offload"),
    ({"strategy": "ddp", "mixed_precision": "bf16"}, "parallel.mixed_precision"),
])
def test_bad_parallel_settings_name_the_key(parallel: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({"parallel": parallel, "train": {"max_steps": 3}}).validate()


def test_offload_on_a_cpu_and_hsdp_on_uneven_nodes_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"parallel.offload: needs a CUDA device"):
        shard_model(nn.Linear(2, 2), ParallelConfig(strategy="fsdp", offload=True), CPU, 1, 1)
    from elastic_runner.training.sharding import device_mesh

    with pytest.raises(ConfigError, match=r"hsdp needs the same number of workers on every node"):
        device_mesh("hsdp", CPU, 3, 2)


def test_rank0_gives_a_snapshot_up_when_a_part_does_not_come(tmp_path: Path) -> None:
    """A rank that died before writing its part: rank 0 does not wait forever, and publishes nothing."""
    from elastic_runner.snapshot.shards import wait_for_parts, write_part

    write_part(tmp_path, 0, {"tensors": {"model/w": torch.ones(2)}, "offsets": {"model/w": [0]}})
    with pytest.raises(SnapshotError, match=r"rank\(s\) 1 did not write their part .* within 0 s"):
        wait_for_parts(tmp_path, [0, 1], timeout_s=0.3)


# -- node memory for sharded state -------------------------------------------------------------------------------


class _ObjectDist:
    """What select_sharded needs of the worker's Dist, on the default gloo group (JSON-able objects, as Dist)."""

    def __init__(self) -> None:
        import torch.distributed as tdist

        self.rank, self.world_size = tdist.get_rank(), tdist.get_world_size()

    def all_gather_object(self, obj: Any) -> list[Any]:
        import json

        import torch.distributed as tdist

        box: list[Any] = [None] * self.world_size
        tdist.all_gather_object(box, json.dumps(obj))
        return [json.loads(b) for b in box]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        import json

        import torch.distributed as tdist

        box = [json.dumps(obj) if self.rank == src else None]
        tdist.broadcast_object_list(box, src=src)
        return json.loads(box[0])  # type: ignore[arg-type]


def _memory_worker(rank: int, world: int, store_path: str, job: dict[str, Any]) -> None:
    """``save``: train a step sharded and refresh node memory (node = rank // local_world, a directory each);
    ``load``: select from node memory (or disk) into this layout, save what every tensor became, whole."""
    from elastic_runner.snapshot.interval import SharedInterval
    from elastic_runner.snapshot.memory import MemoryTier
    from elastic_runner.snapshot.sharded_memory import Layout, ShardedMemory, exchange_group, select_sharded
    from elastic_runner.snapshot.shards import split

    _up(rank, world, store_path)
    local_world = job["local_world"]
    node = rank // local_world
    torch.manual_seed(0 if job["do"] == "save" else 5)
    model = _mlp()
    shard_model(model, ParallelConfig(strategy="fsdp"), CPU, world, local_world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    tier = MemoryTier(Path(job["nodes"]) / f"node-{job['node_names'][node]}", generation=1, run_uid="run-a")
    layout = Layout(rank=rank, world=world, local_rank=rank % local_world, local_world=local_world, strategy="fsdp",
                    replicas=1)
    memory = ShardedMemory(tier, layout, exchange_group(60), SharedInterval(1, prior_mtbf_s=3600, failures=0,
                                                                            run_started=0.0, start_step=0))
    if job["do"] == "save":
        model(torch.randn(6, 5, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
        optimizer.step()

        def capture() -> tuple[dict[str, Any], dict[str, Any]]:
            replicated, tensors, offsets = split({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                                  "train": {"step": 1}})
            return ({"replicated": replicated if rank % local_world == 0 else None,
                     "part": {"tensors": tensors, "offsets": offsets}},
                    {"fingerprint": {"model": "m"}, "run_uid": "run-a", "world_size": world})

        memory.refresh(1, capture)
        memory.wait()
        result = _whole_state(model, optimizer)
    else:
        store = LocalStore(job["disk"])
        loaded = select_sharded(_ObjectDist(), store, memory, fingerprint={"model": "m"}, run_uid="run-a", verify=True)
        if loaded is None:
            result = {"tier": None}
        else:
            state = localize(loaded.state, model, optimizer, loaded.parts)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"] | {"param_groups": optimizer.state_dict()["param_groups"]})
            result = _whole_state(model, optimizer) | {"tier": loaded.tier}
    if rank == 0:
        torch.save(result, job["out"])
    model = optimizer = memory = None  # type: ignore[assignment]  # (nothing of FSDP's left holding the groups)
    _down()


def _memory_job(tmp: Path, do: str, world: int, local_world: int, node_names: list[int]) -> dict:
    out = tmp / f"{do}-{world}-{time_ns()}.pt"
    disk = tmp / "disk"
    LocalStore(disk).ensure()
    if not LocalStore(disk).newest_generation():
        LocalStore(disk).claim_generation({})
    _spawn(_memory_worker, world, tmp, dict(do=do, local_world=local_world, nodes=str(tmp / "memory"),
                                            node_names=node_names, disk=str(disk), out=str(out)))
    return torch.load(out)


@pytest.mark.slow
def test_a_lost_node_s_shards_come_back_from_the_next_node_s_memory_exactly(tmp_path: Path) -> None:
    """fsdp at 4 ranks on 2 nodes refreshes node memory (each node: its own shards and a copy of the other's); node 1
    is lost with its memory; the 2 ranks left take every tensor, exactly, from node 0's memory alone."""
    saved = _memory_job(tmp_path, "save", 4, 2, [0, 1])
    assert sorted(p.name for p in (tmp_path / "memory" / "node-0").glob("step-*/part-*.bin")) == \
        [f"part-{r:05d}.bin" for r in range(4)]
    shutil.rmtree(tmp_path / "memory" / "node-1")
    loaded = _memory_job(tmp_path, "load", 2, 2, [0])
    assert loaded.pop("tier") == "memory"
    _assert_same(loaded, saved, "fsdp at 4 on 2 nodes -> node 1 lost -> 2 ranks from node 0's memory")


@pytest.mark.slow
def test_a_damaged_part_in_node_memory_sends_every_rank_to_disk_together(tmp_path: Path) -> None:
    """The only copy of a part fails its checksum at its holder: it sends nothing, every rank hears of it after the
    schedule (nobody waits for a part that will not come), and all of them take the disk instead."""
    _memory_job(tmp_path, "save", 4, 2, [0, 1])
    shutil.rmtree(tmp_path / "memory" / "node-1")
    [part] = (tmp_path / "memory" / "node-0").glob("step-*/part-00003.bin")
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    assert _memory_job(tmp_path, "load", 2, 2, [0]) == {"tier": None}


def _optimizer_worker(rank: int, world: int, store_path: str, job: dict[str, Any]) -> None:
    from elastic_runner.config import OptimConfig
    from elastic_runner.workload.optim import build_optimizer

    _up(rank, world, store_path)
    model = _mlp()
    shard_model(model, ParallelConfig(strategy="fsdp"), CPU, world, 1)
    chosen = {label: build_optimizer(OptimConfig(name=name, lr=0.1, params=params), model.parameters()).defaults["foreach"]
              for label, name, params in (("adamw", "adamw", {}), ("sgd", "sgd", {}),
                                          ("adamw-own", "adamw", {"foreach": False}))}
    torch.save(chosen, job["out"])
    model = None  # type: ignore[assignment]
    _down()


def test_a_sharded_model_s_optimizer_updates_all_its_tensors_at_once() -> None:
    """torch picks the per-tensor loop for DTensors (one dispatched update per parameter: on a GPU the step waits
    for the CPU); the built-in optimizers ask for the multi-tensor kernels unless optim.params says otherwise."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "chosen.pt"
        _spawn(_optimizer_worker, 1, Path(tmp), {"out": str(out)})
        assert torch.load(out) == {"adamw": True, "sgd": True, "adamw-own": False}


def _compile_worker(rank: int, world: int, store_path: str, job: dict[str, Any]) -> None:
    from torch._dynamo.utils import counters

    from elastic_runner.training.sharding import compile_units

    _up(rank, world, store_path)
    torch.manual_seed(0)
    model = _mlp()
    shard_model(model, ParallelConfig(strategy="fsdp"), CPU, world, 1)
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    eager = model(x).detach()
    compile_units(model)
    compiled = model(x)
    compiled.square().sum().backward()
    torch.save({"graphs": counters["stats"]["unique_graphs"], "same": torch.allclose(eager, compiled.detach(), atol=1e-5),
                "keys": list(model.state_dict()), "grads": all(p.grad is not None for p in model.parameters())},
               job["out"])
    model = None  # type: ignore[assignment]
    _down()


@pytest.mark.slow
def test_a_sharded_model_compiles_unit_by_unit_and_keeps_its_plain_keys() -> None:
    """torch.compile around a sharded model compiles nothing (FSDP2's hooks, kept out of compilation, sit inside each
    unit's call); each unit's forward compiled in place does, and the state keeps the plain model's keys."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compiled.pt"
        _spawn(_compile_worker, 1, Path(tmp), {"out": str(out)})
        result = torch.load(out)
    assert result["graphs"] >= 2, "every unit's forward is compiled"
    assert result["same"] and result["grads"], "the same model (up to the order of fused additions)"
    assert not any("_orig_mod" in k for k in result["keys"]) and result["keys"] == list(_mlp().state_dict())


def _interval_worker(rank: int, world: int, store_path: str, job: dict[str, Any]) -> None:
    """Train-shaped loop of 70 steps, rank 1 three times as slow as rank 0, node memory under ``auto``: which
    steps each rank refreshed at, and what it applied."""
    from elastic_runner.snapshot.interval import SharedInterval
    from elastic_runner.snapshot.memory import MemoryTier
    from elastic_runner.snapshot.sharded_memory import Layout, ShardedMemory, exchange_group
    from elastic_runner.snapshot.shards import split

    _up(rank, world, store_path)
    model = _mlp()
    shard_model(model, ParallelConfig(strategy="fsdp"), CPU, world, 1)
    schedule = SharedInterval("auto", prior_mtbf_s=2.0, failures=0, run_started=time(), start_step=0)
    memory = ShardedMemory(MemoryTier(Path(job["nodes"]) / f"node-{rank}", generation=1, run_uid="run-a"),
                           Layout(rank=rank, world=world, local_rank=0, local_world=1, strategy="fsdp", replicas=1),
                           exchange_group(60), schedule)

    def capture() -> tuple[dict[str, Any], dict[str, Any]]:
        replicated, tensors, offsets = split({"model": model.state_dict(), "train": {"step": 1}})
        return ({"replicated": replicated, "part": {"tensors": tensors, "offsets": offsets}},
                {"fingerprint": {"model": "m"}, "run_uid": "run-a", "world_size": world})

    refreshed = []
    for step in range(1, 71):
        sleep(0.004 * (1 + 2 * rank))
        schedule.step_done()
        if memory.due(step):
            memory.refresh(step, capture)
            refreshed.append((step, schedule.current, schedule.applied))
    memory.wait()
    torch.save(refreshed, Path(job["out"]) / f"rank{rank}.pt")
    model = memory = None  # type: ignore[assignment]
    _down()


@pytest.mark.slow
def test_under_auto_every_rank_refreshes_node_memory_at_the_same_steps(tmp_path: Path) -> None:
    """The ranks measure different costs and step times; each refresh reduces them (the slowest rank's) so that every
    rank computes the next interval from the same numbers: the same steps on every rank, the first at step 10, the
    next ones Young/Daly's for the slowest rank."""
    (tmp_path / "out").mkdir()
    _spawn(_interval_worker, 2, tmp_path, dict(nodes=str(tmp_path / "memory"), out=str(tmp_path / "out")))
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt") for r in range(2)]
    assert ranks[0] == ranks[1], "the same refresh steps and intervals on every rank"
    steps = [s for s, _, _ in ranks[0]]
    assert steps[:2] == [10, 20], "the first at step 10, the second before any measurement arrived"
    for (step, current, applied), (following, _, _) in zip(ranks[0][1:], ranks[0][2:] + [(None, None, None)]):
        assert applied is not None and current == refresh_steps(*applied)
        assert applied[1] >= 0.012, "the slowest rank's step time (rank 1: 12 ms a step) decides"
        if following is not None:
            assert following - step == current


@pytest.mark.slow
def test_two_nodes_lost_between_refreshes_fall_back_to_disk(tmp_path: Path) -> None:
    """3 nodes of 2: nodes 1 and 2 lost together — node 1's shards were on node 1 and node 2 only: not in memory."""
    _memory_job(tmp_path, "save", 6, 2, [0, 1, 2])
    shutil.rmtree(tmp_path / "memory" / "node-1")
    shutil.rmtree(tmp_path / "memory" / "node-2")
    loaded = _memory_job(tmp_path, "load", 2, 2, [0])
    assert loaded == {"tier": None}  # nothing on disk either: a fresh start, not a wrong state


def test_bf16_mixed_precision_keeps_the_sharded_state_in_float32() -> None:
    """parallel.mixed_precision: bf16 computes in bfloat16; parameters, gradients and optimizer state stay float32."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
        shard_model(model, ParallelConfig(strategy="fsdp", mixed_precision="bf16"), CPU, 1, 1)
        seen: list[torch.dtype] = []
        model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        model(torch.randn(6, 5)).float().square().sum().backward()
        assert seen == [torch.bfloat16]
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    finally:
        tdist.destroy_process_group()


def test_bf16_mixed_precision_with_batchnorm_is_refused_before_anything_is_written() -> None:
    from types import SimpleNamespace

    from elastic_runner.training.sharding import check_shardable

    cfg = config_from_dict({"parallel": {"strategy": "fsdp", "mixed_precision": "bf16"}, "train": {"max_steps": 3}})
    with pytest.raises(ConfigError, match=r"parallel.mixed_precision: .*BatchNorm"):
        check_shardable(cfg, SimpleNamespace(model=_mlp(), compiled=None), 2, 2)


def _split_worker(rank: int, world: int, store_path: str, job: dict[str, Any]) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from elastic_runner.snapshot.shards import MARKER, split

    _up(rank, world, store_path)
    torch.manual_seed(0)
    model = _mlp()
    shard_model(model, ParallelConfig(strategy="fsdp"), CPU, world, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(keep_vars=True), "optimizer": optimizer.state_dict()}
    dtensors = {}

    def find(value: Any, path: tuple[str, ...]) -> None:
        if hasattr(value, "device_mesh"):
            dtensors["/".join(path)] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                find(v, (*path, str(k)))

    find(state, ())
    first, second = split(state), split(state)  # the second from what the first remembered
    truth = {key: [int(o) for o in compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1]]
             for key, t in dtensors.items()}
    # A DTensor whose layout changes while it stays the same object (a re-placed parameter): its place is asked again.
    weight = model[0].weight
    key = next(k for k, t in dtensors.items() if t is weight)
    weight._spec = weight.redistribute(placements=[Replicate()])._spec
    third = split(state)
    torch.save({"first": first[2], "second": second[2], "truth": truth, "key": key, "third": third[2][key],
                "same_tensors": all(first[1][k] is second[1][k] for k in first[1]),
                "markers": first[0] == second[0] and third[0]["model"]["0.weight"][MARKER] == "model/0.weight"},
               job["out"] + f".{rank}")
    model = optimizer = state = dtensors = weight = None  # type: ignore[assignment]
    _down()


def test_a_capture_remembers_where_each_shard_sits_and_asks_again_when_its_layout_changes() -> None:
    """The offsets of a rank's slices are torch's own, the same from a capture that remembered them, and a DTensor
    whose layout changed is asked again (split's per-object memory must never hand out a stale place)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "split"
        _spawn(_split_worker, 2, Path(tmp), {"out": str(out)})
        for rank in range(2):
            got = torch.load(f"{out}.{rank}")
            assert got["first"] == got["truth"] == got["second"], f"rank {rank}"
            assert got["same_tensors"] and got["markers"]
            assert got["third"] == [0, 0], f"rank {rank}: a replicated weight sits at the origin ({got['third']})"
            assert got["truth"][got["key"]] == ([0, 0] if rank == 0 else [4, 0]), "rows split between the ranks"


def test_parts_that_overlap_are_refused_even_when_their_counts_add_up(tmp_path: Path) -> None:
    """Two parts both holding rows 0..1 of a 4-row tensor add up to the 4 rows needed, and rows 2..3 would have kept
    uninitialised memory: parts must cover a box exactly once."""
    from elastic_runner.snapshot.shards import MARKER, SHARD_FORMAT, PartReader

    meta = {"sharded": {"format": SHARD_FORMAT, "parts": [
        {"file": f"part-{i:05d}.bin", "size_bytes": 4096, "sha256": "0" * 64} for i in range(2)]}}
    marker = {MARKER: "model/w", "dtype": "float32"}
    rows = torch.arange(8.0).view(2, 4)
    exact = [{"tensors": {"model/w": rows}, "offsets": {"model/w": [0, 0]}},
             {"tensors": {"model/w": rows + 8}, "offsets": {"model/w": [2, 0]}}]
    whole = PartReader(tmp_path / "step-1", meta, loaded=exact).box(marker, [0, 0], [4, 4])
    assert torch.equal(whole, torch.arange(16.0).view(4, 4))
    twice = [exact[0], {"tensors": {"model/w": rows}, "offsets": {"model/w": [0, 0]}}]
    with pytest.raises(SnapshotError, match="two parts hold the same values of model/w"):
        PartReader(tmp_path / "step-1", meta, loaded=twice).box(marker, [0, 0], [4, 4])
