"""The mixture of data.sources: exact proportions, every source exactly once per its own epoch, at any world size."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.data.mixture import MixtureSampler, exact_weights, quota_slots


def test_weights_are_the_fractions_written_not_the_nearest_binary_floats() -> None:
    weights, q = exact_weights([0.3, 0.7])
    assert [Fraction(w, q) for w in weights] == [Fraction(3, 10), Fraction(7, 10)]
    weights, q = exact_weights([1, 1, 2])
    assert [Fraction(w, q) for w in weights] == [Fraction(1, 4), Fraction(1, 4), Fraction(1, 2)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=2, max_size=6), st.integers(1, 64), st.integers(1, 40))
def test_after_any_number_of_slots_every_source_is_within_one_of_its_share(raw: list[int], batch: int,
                                                                            steps: int) -> None:
    weights, q = exact_weights(raw)
    taken = [0] * len(weights)
    for _ in range(steps):
        for s in quota_slots(taken, weights, q, batch):
            taken[s] += 1
            t = sum(taken)
            assert all(abs(Fraction(w * t, q) - c) < 1 for w, c in zip(weights, taken)), (taken, raw)


def mixture(sizes: list[int], weights: list[float], batch: int, rank: int = 0, world: int = 1) -> MixtureSampler:
    return MixtureSampler(sizes, weights, batch, seed=3, rank=rank, world_size=world, labels=[f"s{i}" for i in
                                                                                             range(len(sizes))])


def take_steps(state: dict, sizes: list[int], weights: list[float], batch: int, world: int,
               steps: int) -> tuple[list[list[int]], dict]:
    """``steps`` steps of a ``world``-rank job resumed from ``state``: each step's ids, all ranks together."""
    ranks = [mixture(sizes, weights, batch, r, world) for r in range(world)]
    for sampler in ranks:
        if state:
            sampler.load_state_dict(state)
    out = []
    for _ in range(steps):
        plans = [next(sampler.plans()) for sampler in ranks]
        assert len({p.segments for p in plans}) == 1, "every rank agrees on what the step takes"
        out.append(sorted(i for p in plans for i in p.indices))
        for sampler, plan in zip(ranks, plans):
            sampler.advance(plan)
    return out, ranks[0].state_dict()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.data())
def test_a_job_resumed_at_any_world_sizes_takes_the_same_samples_as_one_that_never_stopped(sizes: list[int],
                                                                                          data: st.DataObject) -> None:
    weights = data.draw(st.lists(st.floats(0.05, 5.0), min_size=len(sizes), max_size=len(sizes)))
    batch = data.draw(st.integers(1, 12))
    segments = data.draw(st.lists(st.tuples(st.integers(1, batch), st.integers(1, 15)), min_size=1, max_size=5))
    total = sum(steps for _, steps in segments)
    reference, _ = take_steps({}, sizes, weights, batch, 1, total)
    resumed, state = [], {}
    for world, steps in segments:
        done, state = take_steps(state, sizes, weights, batch, world, steps)
        resumed += done
    assert resumed == reference, "the union of the ranks' steps is the same windows, whatever the world sizes"
    # Each source's samples: exactly once per its epochs (each complete epoch holds every sample once).
    per_source: list[Counter[int]] = [Counter() for _ in sizes]
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    for window in reference:
        assert len(window) == batch, "a constant global batch"
        for gid in window:
            s = max(i for i, start in enumerate(starts) if start <= gid)
            per_source[s][gid - starts[s]] += 1
    for s, counts in enumerate(per_source):
        taken = sum(counts.values())
        full, partial = divmod(taken, sizes[s])
        assert all(full <= counts[i] <= full + 1 for i in range(sizes[s])), "no sample repeats within an epoch"
        assert sum(1 for i in range(sizes[s]) if counts[i] == full + 1) == partial


def test_a_snapshot_of_other_sources_is_refused_by_name() -> None:
    before = mixture([10, 20], [1, 1], 4)
    state = before.state_dict()
    with pytest.raises(ValueError, match="source 's1' had 20 samples, it has 21 now"):
        mixture([10, 21], [1, 1], 4).load_state_dict(state)
    shards = [{"name": "c/a.bin", "size": 100, "check": "x", "tokens": 50}]
    changed = [{"name": "c/a.bin", "size": 100, "check": "y", "tokens": 50}]
    recorded = MixtureSampler([10], [1], 4, labels=["tok"], identities=[shards]).state_dict()
    with pytest.raises(ValueError, match=r"source 'tok': its shard c/a.bin changed since the run started \(check x → y\)"):
        MixtureSampler([10], [1], 4, labels=["tok"], identities=[changed]).load_state_dict(recorded)


def test_one_source_trains_its_epochs_end_to_end() -> None:
    sampler = mixture([50], [1], 8)
    assert sampler.steps_for_epochs(3) == 150 // 8
    seen: Counter[int] = Counter()
    for _ in range(150 // 8):
        plan = next(sampler.plans())
        seen.update(plan.indices)
        sampler.advance(plan)
    # 18 steps of 8: two whole epochs of 50, and 44 samples of the third (the last 6 left: no partial step)
    assert Counter(seen.values()) == {3: 44, 2: 6}


def test_the_mixture_audit_counts_each_sources_samples_of_steps_skipped_by_rule_by_its_epoch() -> None:
    """Steps skipped by rule (train.skip_steps, a non-finite rollback's) consumed their samples: the audit counts them
    as taken, and says per source and epoch how many were not trained on."""
    from elastic_runner.observe.audit_mixture import check_mixture

    sampler = MixtureSampler([6, 10], ["1/3", "2/3"], 3, seed=0, shuffle=True, labels=["a", "b"])
    header = {"sources": [{"label": "a", "samples": 6, "weight": "1/3"}, {"label": "b", "samples": 10, "weight": "2/3"}],
              "global_batch": 3, "seed": 0, "shuffle": True}
    taken, segments_of, records, skipped = [0, 0], {}, [], {0: Counter(), 1: Counter()}
    for step in range(1, 7):
        ids, segments = sampler.window(taken)
        segments_of[(step, 1)] = tuple((g.source, g.epoch, g.start, g.count) for g in segments)
        records.append({"type": "step", "step": step, "generation": 1, "rank": 0, "world_size": 1, "indices": ids})
        for g in segments:
            taken[g.source] += g.count
            if step in (2, 5):
                skipped[g.source][g.epoch] += g.count
    reports, violations = check_mixture(header, 6, {s: 1 for s in range(1, 7)}, segments_of, records,
                                        skipped_steps=[2, 5])
    assert not violations, violations
    assert [r.taken for r in reports] == taken
    assert [r.skipped for r in reports] == [sum(c.values()) for c in skipped.values()] and sum(r.skipped for r in reports) == 6
    assert [r.skipped_per_epoch for r in reports] == [dict(c) for c in skipped.values()]
    assert "skipped by rule (consumed, not trained on: epoch 0:" in reports[1].line()
