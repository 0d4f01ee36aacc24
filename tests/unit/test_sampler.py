"""ElasticSampler: exactly once per epoch across any sequence of restarts and world sizes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.data.sampler import ElasticSampler, epoch_permutation


def run_segments(num_samples: int, global_batch: int, partial: str, segments: list[tuple[int, int]],
                 seed: int = 3) -> dict[int, list[int]]:
    """Simulate a job that restarts with world size W after running k steps, for each (W, k).

    Between segments only the sampler's state_dict survives (as in a snapshot).
    Returns the samples consumed per epoch, in consumption order.
    """
    consumed: dict[int, list[int]] = {}
    saved = None
    for world, steps in segments:
        ranks = [ElasticSampler(num_samples, global_batch, seed=seed, partial_batch=partial, rank=r, world_size=world)
                 for r in range(world)]
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
)
def test_every_sample_exactly_once_per_epoch_whatever_the_restarts(num_samples: int, global_batch: int, partial: str,
                                                                    segments: list[tuple[int, int]]) -> None:
    if partial == "drop" and global_batch > num_samples:
        with pytest.raises(ValueError):
            ElasticSampler(num_samples, global_batch, partial_batch=partial)
        return
    segments = [(min(w, global_batch), k) for w, k in segments]
    consumed = run_segments(num_samples, global_batch, partial, segments)
    usable = num_samples if partial == "partial" else (num_samples // global_batch) * global_batch
    last = max(consumed, default=-1)
    for epoch, seen in consumed.items():
        counts = Counter(seen)
        assert all(c == 1 for c in counts.values()), f"epoch {epoch} repeats samples"
        perm = epoch_permutation(num_samples, 3, epoch).tolist()
        # whatever the world sizes were, the job consumed a prefix of the epoch's permutation
        assert sorted(seen) == sorted(perm[: len(seen)])
        if epoch < last:
            assert len(seen) == usable, f"epoch {epoch} incomplete"


def test_union_of_ranks_is_the_next_window_of_the_permutation() -> None:
    perm = epoch_permutation(100, 0, 0).tolist()
    samplers = [ElasticSampler(100, 12, rank=r, world_size=3) for r in range(3)]
    plans = [next(s.plans()) for s in samplers]
    assert sorted(i for p in plans for i in p.indices) == sorted(perm[:12])
    assert plans[1].indices == perm[:12][1::3]


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
