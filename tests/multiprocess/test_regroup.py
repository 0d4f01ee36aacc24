"""In-process recovery's core (:mod:`elastic_runner.recovery.rebuild`): survivors of a killed peer keep their process,
roll the abandoned step back, rebuild the process group and the gradient sync for the new members and go on; a
newcomer heals from a survivor. The arithmetic is exactly that of a run whose members changed at the same steps on
purpose, with either way of rebuilding the group.

Real processes on gloo: each member runs the real step (:class:`~elastic_runner.training.step.TrainStep`, ordered
gradient sync) in a spawned process; the test process hosts the job's store, as an agent would.
"""

from __future__ import annotations

import datetime
import io
import os
import signal
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from elastic_runner.data.layout import split_even
from elastic_runner.data.sampler import StepPlan
from elastic_runner.recovery.rebuild import Membership, Regroup, RegroupError, regroup_method

from ..support import rank_context
from ..unit.test_gradients import _cnn, _cross_entropy, _image_rows, _images, _step

pytestmark = [pytest.mark.timeout(180)]

#: (first step, last step, members in rank order): c leaves after step 4 (or is killed in step 5); d joins for
#: step 7 and b becomes rank 0, whose state d heals from.
SCHEDULE = [(1, 4, ("a", "b", "c")), (5, 6, ("a", "b")), (7, 8, ("b", "a", "d"))]
TIMEOUT = datetime.timedelta(seconds=30)


def _share_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, src: int) -> None:
    """The newcomer's heal: ``src``'s model and optimizer state, as bytes (loaded without an unpickler)."""
    import torch.distributed as tdist

    if tdist.get_rank() == src:
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()])
    else:
        size = torch.zeros(1, dtype=torch.long)
    tdist.broadcast(size, src=src)
    if tdist.get_rank() != src:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    tdist.broadcast(data, src=src)
    if tdist.get_rank() != src:
        state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def _member(name: str, port: int, method: str, victim: str | None, out: str) -> None:
    """One member's life: every segment of :data:`SCHEDULE` it belongs to. ``victim``: the member that SIGKILLs
    itself at the start of step 5 (None: the membership changes on purpose). Writes what it saw to ``out``."""
    import torch._dynamo  # noqa: F401 - before any process group, as worker.group.up does
    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    group = Regroup(store, name, "gloo", TIMEOUT, method=method)
    torch.manual_seed(0 if name in "abc" else 1)  # a newcomer's own initial weights: the heal must replace them
    model = _cnn().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = _images()
    seen: dict[str, Any] = {"pid": os.getpid(), "failed_steps": [], "seconds": []}
    joined = False
    for generation, (first, last, members) in enumerate(SCHEDULE, start=1):
        if name not in members:
            if joined:
                break  # left the job
            continue  # not a member yet
        if victim is not None and generation == 1:
            last = SCHEDULE[-1][1]  # nobody plans the change: the first generation runs until its peer dies
        seen["seconds"].append(group.join(Membership(generation, members)))
        rank, world = members.index(name), len(members)
        if generation > 1 and set(members) - set(SCHEDULE[generation - 2][2]):  # a newcomer: all take part
            _share_state(model, optimizer, src=0)
        joined = True
        step = _step(model, optimizer, "ordered", world, rank, 2, _cross_entropy, False)
        try:
            for number in range(first, last + 1):
                if name == victim and number == 5:
                    os.kill(os.getpid(), signal.SIGKILL)
                mine = list(range(8))[rank::world]
                plan = StepPlan(epoch=0, start=0, global_count=8, indices=mine)
                batches = iter([_image_rows(data, number, list(p)) for p in split_even(mine, 2) if p])
                step.compute(number, plan, batches)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        except RuntimeError as exc:
            # The step in flight is abandoned: nothing of it reached the parameters (the update comes after the
            # sums), and its half-summed gradients go with the gradient sync. The next generation redoes it.
            seen["failed_steps"].append((number, str(exc).splitlines()[0][:200]))
            optimizer.zero_grad(set_to_none=True)
            step.sync.close()
            del step
            group.abandon()  # the other survivor may be blocked on this one in the same collective
            continue
        step.sync.close()
    seen["model"] = {k: v.clone() for k, v in model.state_dict().items()}
    group.leave()
    torch.save(seen, out)


def _run(tmp: Path, method: str, victim: str | None) -> dict[str, dict[str, Any]]:
    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT)
    ctx = rank_context()
    outs = {name: str(tmp / f"{method}-{victim}-{name}.pt") for name in "abcd"}
    procs = {name: ctx.Process(target=_member, args=(name, store.port, method, victim, outs[name]))
             for name in "abcd"}
    try:
        for proc in procs.values():
            proc.start()
        for name, proc in procs.items():
            proc.join(timeout=150)
            assert proc.exitcode is not None, f"member {name} hung"
            expected = -signal.SIGKILL if name == victim else 0
            assert proc.exitcode == expected, f"member {name} exited with {proc.exitcode}"
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()
    return {name: torch.load(path) for name, path in outs.items() if name != victim}


def _methods() -> list[str]:
    return ["recreate"] + (["reconfigure"] if regroup_method("gloo")[0] == "reconfigure" else [])


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, dict[str, Any]]]:
    """The run whose members change at the same steps on purpose, once per method."""
    runs: dict[str, dict[str, dict[str, Any]]] = {}

    def run(method: str) -> dict[str, dict[str, Any]]:
        if method not in runs:
            runs[method] = _run(tmp_path_factory.mktemp(f"planned-{method}"), method, victim=None)
        return runs[method]
    return run


@pytest.mark.parametrize("method", _methods())
def test_survivors_of_a_killed_peer_keep_their_process_and_end_as_a_planned_change_would(
        tmp_path: Path, method: str, planned: Callable[[str], dict[str, dict[str, Any]]]) -> None:
    reference = planned(method)
    faulted = _run(tmp_path, method, victim="c")
    for name in "ab":
        steps = [number for number, _ in faulted[name]["failed_steps"]]
        assert steps == [5], f"{name} saw the peer's death in step 5 and went on in the same process: {faulted[name]}"
        assert reference[name]["failed_steps"] == [], reference[name]
    model = reference["b"]["model"]
    for name in "abd":  # d healed from b: the same model on every member at the end
        differing = [k for k in model if not torch.equal(model[k], faulted[name]["model"][k])]
        assert not differing, f"{method}: {name}'s model differs from the planned run's in {differing}"
    assert [len(faulted[name]["seconds"]) for name in "abd"] == [3, 3, 1], "a, b: every generation; d: the last"


def test_both_ways_of_rebuilding_the_group_do_the_same_arithmetic(
        planned: Callable[[str], dict[str, dict[str, Any]]]) -> None:
    if regroup_method("gloo")[0] != "reconfigure":
        pytest.skip(f"this torch build cannot reconfigure: {regroup_method('gloo')[1]}")
    by_method = {m: planned(m)["b"]["model"] for m in ("recreate", "reconfigure")}
    assert all(torch.equal(by_method["recreate"][k], by_method["reconfigure"][k]) for k in by_method["recreate"])


@pytest.mark.parametrize("method", _methods())
def test_a_member_that_never_comes_fails_the_regroup_within_the_timeout_not_a_hang(method: str) -> None:
    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT)
    group = Regroup(store, "a", "gloo", datetime.timedelta(seconds=2), method=method)
    try:
        with pytest.raises(RegroupError, match="generation 7"):
            group.join(Membership(7, ("a", "ghost")))
        with pytest.raises(RegroupError, match="not a member"):
            group.join(Membership(8, ("b",)))
    finally:
        group.leave()


def _ring_member(name: str, port: int, method: str, out: str) -> None:
    """A member of four that all-reduces until d dies; the survivors then rebuild the group of three."""
    import torch._dynamo  # noqa: F401 - before any process group, as worker.group.up does
    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    group = Regroup(store, name, "gloo", datetime.timedelta(minutes=5), method=method)  # a collective waits 5 min
    group.join(Membership(1, tuple("abcd")))
    failed = ""
    try:
        for number in range(200):
            if name == "d" and number == 50:
                os.kill(os.getpid(), signal.SIGKILL)
            tdist.all_reduce(torch.ones(200_000))
    except RuntimeError as exc:
        failed = str(exc).splitlines()[0][:200]
    # Out of the handler, as a worker does: the exception no longer holds the failed collective's work.
    group.abandon()
    group.join(Membership(2, tuple("abc")))
    rebuilt = torch.ones(1)
    tdist.all_reduce(rebuilt)
    group.leave()
    torch.save({"failed": failed, "sum": rebuilt.item()}, out)


@pytest.mark.parametrize("method", _methods())
def test_a_member_blocked_on_a_survivor_rather_than_on_the_dead_peer_is_released_when_the_survivors_give_up(
        tmp_path: Path, method: str) -> None:
    # In a ring all-reduce of four, one survivor waits on another survivor, not on the dead member: it fails only
    # when that survivor gives the group up. Before: a reconfigurable group's abort left its connections open, and
    # that member waited the collective's whole timeout (5 min here, 30 s in the four-rank in-process test).
    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT)
    ctx = rank_context()
    outs = {name: str(tmp_path / f"{name}.pt") for name in "abc"}
    procs = [ctx.Process(target=_ring_member, args=(name, store.port, method, outs.get(name, ""))) for name in "abcd"]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=120)  # far less than the collectives' 5 minutes
        assert [proc.exitcode for proc in procs] == [0, 0, 0, -signal.SIGKILL]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    seen = {name: torch.load(path) for name, path in outs.items()}
    assert all(s["failed"] for s in seen.values()), seen
    assert all(s["sum"] == 3.0 for s in seen.values()), "the three survivors' group works"
