"""A replica's fingerprint sees any single flipped bit of its parameters or optimizer state; the ranks that differ
from the majority are the suspects; with no majority nobody is named; a check's interval follows its cost; the
settings that cannot work are refused with the key to change."""

from __future__ import annotations

import random

import pytest
import torch

from elastic_runner.config import Config, ConfigError, config_from_dict
from elastic_runner.training.fingerprint import (SLOTS, FingerprintCheck, compare, fingerprint, join,
                                                 replica_tensors, split)

CPU = torch.device("cpu")


def trained_pair(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8, dtype=dtype)).sum().backward()
        optimizer.step()
    return model, optimizer


def flip(tensor: torch.Tensor, index: int, bit: int) -> None:
    ints = tensor.detach().view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
    ints[index] ^= (1 << bit) if bit < 8 * tensor.element_size() - 1 else -(1 << bit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_any_single_flipped_bit_of_a_parameter_or_of_the_optimizer_state_changes_the_fingerprint(dtype) -> None:  # noqa: ANN001
    model, optimizer = trained_pair(dtype)
    clean = int(fingerprint(replica_tensors(model, optimizer), CPU))
    tensors = [t for t in replica_tensors(model, optimizer) if t.is_floating_point() and t.numel() > 1]
    draw = random.Random(7)
    for _ in range(200):
        tensor = draw.choice(tensors)
        index, bit = draw.randrange(tensor.numel()), draw.randrange(8 * tensor.element_size())
        flip(tensor, index, bit)
        assert int(fingerprint(replica_tensors(model, optimizer), CPU)) != clean, (tuple(tensor.shape), index, bit)
        flip(tensor, index, bit)
        assert int(fingerprint(replica_tensors(model, optimizer), CPU)) == clean


def test_the_same_bytes_give_the_same_fingerprint_wherever_they_lie_in_memory() -> None:
    base = torch.randn(1001)
    for offset in range(1, 4):  # 4, 8 and 12 bytes into its storage: not 8-byte aligned for two of them
        view = base[offset:offset + 997]
        assert int(fingerprint([view], CPU)) == int(fingerprint([view.clone()], CPU)), offset
    half = torch.randn(64, dtype=torch.bfloat16)[3:40]  # 6 bytes in, a tail of 2 bytes
    assert int(fingerprint([half], CPU)) == int(fingerprint([half.clone()], CPU))


def test_equal_replicas_agree_and_values_moved_between_tensors_do_not() -> None:
    a, b = trained_pair(), trained_pair()
    assert int(fingerprint(replica_tensors(*a), CPU)) == int(fingerprint(replica_tensors(*b), CPU))
    first, second = a[0][0].bias, a[0][2].bias
    with torch.no_grad():
        first[0], second[0] = second[0].clone(), first[0].clone()
    assert int(fingerprint(replica_tensors(*a), CPU)) != int(fingerprint(replica_tensors(*b), CPU))


def test_the_optimizer_state_is_part_of_the_fingerprint() -> None:
    model, optimizer = trained_pair()
    before = int(fingerprint(replica_tensors(model, optimizer), CPU))
    state = optimizer.state[next(iter(model.parameters()))]
    flip(state["exp_avg_sq"], 0, 3)
    assert int(fingerprint(replica_tensors(model, optimizer), CPU)) != before
    assert int(fingerprint(replica_tensors(model, None), CPU)) != before  # and without it, another sum


def test_a_64_bit_fingerprint_crosses_a_float64_sum_exactly() -> None:
    for value in (0, 1, -1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0, -0x0FED_CBA9_8765_4321):
        low, high = split(torch.tensor(value, dtype=torch.int64)).tolist()
        assert join(low + 0.0, high + 0.0) == value % 2**64  # adding the other ranks' zeros changes nothing


def test_the_minority_is_named_with_its_node_and_without_a_majority_nobody_is() -> None:
    assert compare(10, [5, 5, 5, 5], [0, 0, 1, 1]).agreed
    verdict = compare(10, [5, 5, 9, 5], [0, 0, 1, 1])
    assert (verdict.agreed, verdict.suspects, verdict.nodes, verdict.undecided) == (False, [2], [1], False)
    two = compare(10, [5, 9], [0, 1])
    assert (two.agreed, two.suspects, two.undecided) == (False, [], True)
    split_vote = compare(10, [5, 5, 9, 9], [0, 0, 1, 1])
    assert split_vote.undecided, "half against half names nobody"
    assert compare(10, [5, 5, 9, 8, 5], [0, 1, 2, 3, 4]).suspects == [2, 3]


def test_under_hsdp_each_shard_is_compared_with_its_copies_on_the_other_nodes() -> None:
    """Three nodes of two ranks: rank r holds shard r % 2, so ranks 0, 2, 4 hold one shard and 1, 3, 5 the other.
    The two shards' sums differ by nature; a copy that differs from its shard's other copies is the suspect."""
    nodes = [0, 0, 1, 1, 2, 2]
    assert compare(10, [5, 7, 5, 7, 5, 7], nodes, shards=2).agreed, "different shards are not compared"
    verdict = compare(10, [5, 7, 5, 8, 5, 7], nodes, shards=2)
    assert (verdict.agreed, verdict.suspects, verdict.nodes) == (False, [3], [1])
    assert compare(10, [6, 8, 5, 7, 5, 7], nodes, shards=2).suspects == [0, 1], "a node with both shards bad"
    two_nodes = compare(10, [5, 7, 5, 8], [0, 0, 1, 1], shards=2)
    assert two_nodes.undecided, "two copies of a shard that differ: nobody can say which is right"
    assert compare(10, [5, 7, 9, 7, 5, 7], nodes, shards=2).suspects == [2]
    undecided_one = compare(10, [5, 7, 9, 8, 6, 7], nodes, shards=2)
    assert undecided_one.undecided, "one shard with no majority rolls every rank back, whatever the other says"


def test_hsdp_compares_fingerprints_by_default_and_fsdp_does_not() -> None:
    assert load_config(parallel={"strategy": "hsdp"}).fingerprints
    assert load_config(parallel={"strategy": "hsdp"}, recovery={"fingerprint_every_steps": 40}).fingerprints
    assert not load_config(parallel={"strategy": "fsdp"}).fingerprints


def blocks(values: list[int], costs: list[float], paces: list[float]) -> list[float]:
    out: list[float] = []
    for rank, (value, cost, pace) in enumerate(zip(values, costs, paces)):
        out += split(torch.tensor(value, dtype=torch.int64)).tolist() + [float(rank), cost, pace]
    assert len(out) == SLOTS * len(values)
    return out


def test_a_check_is_due_every_so_many_steps_and_at_the_last_and_vouches_for_the_step_it_agreed_at() -> None:
    check = FingerprintCheck(30, logging_every=10, start_step=100, device=CPU)
    assert check.verified_step == 100, "the state every rank loaded alike"
    assert [s for s in range(101, 200) if check.due(s, last=False)][:1] == [130]
    assert check.due(105, last=True)
    assert check.judge(130, blocks([7, 7], [0.0, 0.0], [0.0, 0.0])).agreed and check.verified_step == 130
    assert not check.due(150, last=False) and check.due(160, last=False)
    assert not check.judge(160, blocks([7, 8, 7], [0.0] * 3, [0.0] * 3)).agreed
    assert check.verified_step == 130, "a disagreeing check vouches for nothing"


def test_auto_checks_as_often_as_costs_one_percent_of_step_time_in_whole_logging_windows() -> None:
    check = FingerprintCheck("auto", logging_every=10, start_step=0, device=CPU)
    assert check.due(10, last=False), "the first logging step measures the cost"
    # The slowest rank's cost, the median rank's step: 2 ms against 10 ms steps -> every 20 steps at 1 %.
    check.judge(10, blocks([3, 3, 3], [0.001, 0.002, 0.0015], [0.010, 0.050, 0.010]))
    assert check.every == 20
    check.judge(30, blocks([3, 3, 3], [0.0001] * 3, [0.1] * 3))
    assert check.every == 10, "never more often than the logging steps"


def load_config(**sections: dict) -> Config:
    config = config_from_dict(sections | {"train": {"max_steps": 3}})
    config.validate()
    return config


@pytest.mark.parametrize("value", [0, -5, 2.5, "often", True])
def test_a_bad_fingerprint_interval_is_refused_naming_the_key(value) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="recovery.fingerprint_every_steps"):
        load_config(recovery={"fingerprint_every_steps": value})


@pytest.mark.parametrize(("sections", "why"), [
    ({"dist": {"gradient_sync": "ddp"}}, "not bitwise identical across restarts"),
    ({"parallel": {"strategy": "fsdp"}}, "no replica to compare with"),
])
def test_fingerprints_asked_for_where_replicas_differ_by_design_are_refused(sections, why) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=f"recovery.fingerprint_every_steps: got 50: .*{why}"):
        load_config(recovery={"fingerprint_every_steps": 50}, **sections)
    quiet = load_config(recovery={"fingerprint_every_steps": "auto"}, **sections)
    assert not quiet.fingerprints, "auto is off where there is nothing to compare"


def test_fingerprints_are_on_by_default_for_ordered_ddp() -> None:
    assert load_config().fingerprints
    assert not load_config(recovery={"fingerprint_every_steps": None}).fingerprints


@pytest.mark.parametrize(("key", "value"), [("max_rollbacks", -1), ("max_rollbacks", 1.5),
                                            ("rollback_window_seconds", 0)])
def test_bad_rollback_limits_are_refused_naming_the_key(key, value) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=f"recovery.{key}"):
        load_config(recovery={key: value})


def test_the_chaos_hook_is_armed_only_by_its_variable_and_flips_one_mantissa_bit(monkeypatch) -> None:  # noqa: ANN001
    import os
    import signal

    from elastic_runner.training import injected_faults

    monkeypatch.setattr(injected_faults, "REQUEST", None)
    monkeypatch.delenv(injected_faults.ENV, raising=False)
    assert injected_faults.install() is None, "no hook in a job the chaos tool did not start"
    monkeypatch.setenv(injected_faults.ENV, "1")
    armed = (signal.SIGUSR1, signal.SIGUSR2, injected_faults.SLOW_ON, injected_faults.SLOW_OFF)
    previous = {s: signal.getsignal(s) for s in armed}
    try:
        request = injected_faults.install()
        assert request is not None and not request.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert request.requested
        model, optimizer = trained_pair()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        clean = int(fingerprint(replica_tensors(model, optimizer), CPU))
        what = request.corrupt(model)
        assert not request.requested and what["parameter"] == "0.weight", what
        changed = [(n, int((p != before[n]).sum())) for n, p in model.named_parameters() if (p != before[n]).any()]
        assert changed == [("0.weight", 1)] and torch.isfinite(model[0].weight).all()
        assert int(fingerprint(replica_tensors(model, optimizer), CPU)) != clean
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
