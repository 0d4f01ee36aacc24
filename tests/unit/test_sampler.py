"""ElasticSampler: exactly once per epoch across any sequence of restarts and world sizes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.data.order import FeistelOrder, epoch_order
from elastic_runner.data.sampler import ElasticSampler, epoch_permutation


def run_segments(num_samples: int, global_batch: int, partial: str, segments: list[tuple[int, int]],
                 seed: int = 3, order: str = "feistel") -> dict[int, list[int]]:
    """Simulate a job that restarts with world size W after running k steps, for each (W, k).

    Between segments only the sampler's state_dict survives (as in a snapshot): the first segment's samplers
    use ``order``, later ones are built with the default and take the order from the state.
    Returns the samples consumed per epoch, in consumption order.
    """
    consumed: dict[int, list[int]] = {}
    saved = None
    for world, steps in segments:
        kind = {"order": order} if saved is None else {}
        ranks = [ElasticSampler(num_samples, global_batch, seed=seed, partial_batch=partial, rank=r, world_size=world,
                                **kind) for r in range(world)]
        for s in ranks:
            if saved is not None:
                s.load_state_dict(saved)
        for _ in range(steps):
            if ranks[0].epoch_done():
                for s in ranks:
                    s.next_epoch()
            plans = [next(s.plans()) for s in ranks]
            assert len({(p.epoch, p.start, p.global_count) for p in plans}) == 1, "ranks disagree on the step"
            for p in plans:
                consumed.setdefault(p.epoch, []).extend(p.indices)
            for s, p in zip(ranks, plans):
                s.advance(p)
        saved = ranks[0].state_dict()
    return consumed


@settings(max_examples=150, deadline=None)
@given(
    num_samples=st.integers(1, 300),
    global_batch=st.integers(1, 40),
    partial=st.sampled_from(["drop", "partial"]),
    segments=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 30)), min_size=1, max_size=6),
    order=st.sampled_from(["feistel", "randperm"]),
)
def test_every_sample_exactly_once_per_epoch_whatever_the_restarts(num_samples: int, global_batch: int, partial: str,
                                                                    segments: list[tuple[int, int]],
                                                                    order: str) -> None:
    if partial == "drop" and global_batch > num_samples:
        with pytest.raises(ValueError):
            ElasticSampler(num_samples, global_batch, partial_batch=partial)
        return
    segments = [(min(w, global_batch), k) for w, k in segments]
    consumed = run_segments(num_samples, global_batch, partial, segments, order=order)
    usable = num_samples if partial == "partial" else (num_samples // global_batch) * global_batch
    last = max(consumed, default=-1)
    for epoch, seen in consumed.items():
        counts = Counter(seen)
        assert all(c == 1 for c in counts.values()), f"epoch {epoch} repeats samples"
        # whatever the world sizes were, the job consumed a prefix of the epoch's order
        assert sorted(seen) == sorted(epoch_order(order, num_samples, 3, epoch).slice(0, len(seen)))
        if epoch < last:
            assert len(seen) == usable, f"epoch {epoch} incomplete"


def test_union_of_ranks_is_the_next_window_of_the_order() -> None:
    window = FeistelOrder(100, 0, 0).slice(0, 12)
    samplers = [ElasticSampler(100, 12, rank=r, world_size=3) for r in range(3)]
    plans = [next(s.plans()) for s in samplers]
    assert sorted(i for p in plans for i in p.indices) == sorted(window)
    assert plans[1].indices == window[1::3]


def test_the_randperm_order_consumes_the_legacy_permutation() -> None:
    perm = epoch_permutation(100, 0, 1).tolist()
    sampler = ElasticSampler(100, 12, rank=2, world_size=3, order="randperm")
    sampler.next_epoch()
    assert [p.indices for p in sampler.plans()] == [perm[start:start + 12][2::3] for start in range(0, 96, 12)]


def test_the_default_order_is_feistel_and_the_state_records_it() -> None:
    s = ElasticSampler(40, 8)
    assert s.order_kind == "feistel" and s.state_dict()["order"] == "feistel"
    assert ElasticSampler(40, 8, order="randperm").state_dict()["order"] == "randperm"


def test_a_resumed_sampler_keeps_the_order_of_its_state_whatever_it_was_built_with() -> None:
    for kind, built_with in (("feistel", "randperm"), ("randperm", "feistel")):
        s = ElasticSampler(1000, 10, seed=4, order=kind)
        s.next_epoch()
        s.advance(next(s.plans()))
        t = ElasticSampler(1000, 10, seed=4, order=built_with)
        t.load_state_dict(s.state_dict())
        assert t.order_kind == kind and next(t.plans()) == next(s.plans())


def test_a_state_without_an_order_was_written_before_orders_and_resumes_in_the_randperm_order() -> None:
    old_state = {"epoch": 2, "consumed": 48, "seed": 5, "num_samples": 100, "shuffle": True}  # as snapshots held it
    s = ElasticSampler(100, 16, seed=5)
    s.load_state_dict(old_state)
    perm = epoch_permutation(100, 5, 2).tolist()
    assert s.order_kind == "randperm" and s.state_dict()["order"] == "randperm"
    assert [p.indices for p in s.plans()] == [perm[48:64], perm[64:80], perm[80:96]]


def test_an_unknown_order_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'sorted' is not a known epoch order; the known orders are 'feistel', 'randp"):
        ElasticSampler(40, 8, order="sorted")
    s = ElasticSampler(40, 8)
    state = dict(s.state_dict(), order="sorted", consumed=16)
    with pytest.raises(ValueError, match="snapshot's sampler order 'sorted' is not a known epoch order; the known"):
        s.load_state_dict(state)
    assert (s.order_kind, s.consumed) == ("feistel", 0), "a refused state changes nothing"


def test_a_sampler_of_a_trillion_samples_plans_a_step_in_the_middle_of_an_epoch() -> None:
    n = 10**12
    s = ElasticSampler(n, 512, rank=1, world_size=4)
    s.load_state_dict(dict(s.state_dict(), epoch=3, consumed=n // 2))
    plan = next(s.plans())
    assert (plan.epoch, plan.start, plan.global_count) == (3, n // 2, 512)
    assert plan.indices == FeistelOrder(n, 0, 3).slice(n // 2, 512)[1::4]


def test_uneven_world_size_shares_differ_by_at_most_one() -> None:
    plans = [next(ElasticSampler(50, 10, rank=r, world_size=3).plans()) for r in range(3)]
    assert [len(p.indices) for p in plans] == [4, 3, 3]


def test_partial_rule_runs_one_smaller_last_step_and_drop_skips_it() -> None:
    part = ElasticSampler(25, 10, partial_batch="partial")
    assert [p.global_count for p in part.plans()] == [10, 10, 5]
    drop = ElasticSampler(25, 10, partial_batch="drop")
    assert [p.global_count for p in drop.plans()] == [10, 10]
    assert drop.steps_per_epoch() == 2 and part.steps_per_epoch() == 3


def test_epochs_use_different_orders_and_the_same_seed_repeats_them() -> None:
    assert epoch_permutation(50, 1, 0).tolist() != epoch_permutation(50, 1, 1).tolist()
    assert epoch_permutation(50, 1, 4).tolist() == epoch_permutation(50, 1, 4).tolist()
    assert epoch_permutation(10, 1, 0, shuffle=False).tolist() == list(range(10))


def test_state_roundtrip_and_dataset_size_change_is_refused() -> None:
    s = ElasticSampler(40, 8)
    s.advance(next(s.plans()))
    state = s.state_dict()
    t = ElasticSampler(40, 8)
    t.load_state_dict(state)
    assert (t.epoch, t.consumed) == (0, 8)
    with pytest.raises(ValueError, match="40 samples"):
        ElasticSampler(41, 8).load_state_dict(state)


def test_out_of_order_advance_is_a_bug_not_silence() -> None:
    s = ElasticSampler(40, 8)
    plans = list(s.plans())
    with pytest.raises(RuntimeError):
        s.advance(plans[1])


def test_more_ranks_than_samples_per_step_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the global batch"):
        ElasticSampler(40, 4, rank=0, world_size=5)
