"""Epoch orders: a seeded permutation computed per position (feistel), and the legacy materialised one (randperm)."""

from __future__ import annotations

import itertools
import tracemalloc
from collections import Counter

import pytest

from elastic_runner.data.order import (
    DEFAULT_ORDER, ORDERS, FeistelOrder, RandpermOrder, epoch_order, epoch_permutation,
)

#: Sizes where the domain 2^(2k) is as tight (2^(2k)) or as loose (4^k + 1: almost 4 N) as it gets.
AWKWARD_SIZES = sorted({n for k in range(1, 17) for n in (2**k - 1, 2**k, 2**k + 1)}
                       | {n for k in range(1, 9) for n in (4**k - 1, 4**k, 4**k + 1)})


def test_a_feistel_order_is_a_permutation_for_every_size_from_1_to_300() -> None:
    for n in range(1, 301):
        for seed, epoch in ((0, 0), (12345, 3)):
            assert sorted(FeistelOrder(n, seed, epoch).slice(0, n)) == list(range(n)), (n, seed, epoch)


@pytest.mark.parametrize("n", AWKWARD_SIZES)
def test_a_feistel_order_is_a_permutation_at_powers_of_two_and_four_and_their_neighbours(n: int) -> None:
    assert sorted(FeistelOrder(n, 7, 1).slice(0, n)) == list(range(n))


def test_position_of_inverts_index_for_every_position_of_small_orders() -> None:
    for n in itertools.chain(range(1, 101), (255, 256, 257, 1023, 1025)):
        order = FeistelOrder(n, 99, 2)
        assert [order.position_of(order.index(p)) for p in range(n)] == list(range(n)), n
        assert [order.index(order.position_of(i)) for i in range(n)] == list(range(n)), n


def test_a_slice_holds_the_index_of_each_of_its_positions() -> None:
    # slice() walks whole windows in numpy, index() one position in Python ints: the same cipher, held equal.
    for n in (1, 2, 3, 9, 10, 17, 300, 4**5 + 1, 10**6, 10**12):
        order = FeistelOrder(n, 5, 11)
        for start in {0, n // 3, max(0, n - 40)}:
            count = min(40, n - start)
            assert order.slice(start, count) == [order.index(p) for p in range(start, start + count)], (n, start)


def test_a_slice_is_the_same_whatever_window_it_is_cut_from() -> None:
    order = FeistelOrder(5000, 1, 0)
    whole = order.slice(0, 5000)
    assert [i for start in range(0, 5000, 512) for i in order.slice(start, min(512, 5000 - start))] == whole
    assert order.slice(1234, 3) == whole[1234:1237] and order.slice(77, 0) == []


def test_the_same_seed_and_epoch_give_the_same_order_and_any_other_pair_another() -> None:
    orders = {(seed, epoch): tuple(FeistelOrder(50, seed, epoch).slice(0, 50))
              for seed in (-1, 0, 1, 2, 1000, 2**40) for epoch in range(8)}
    assert len(set(orders.values())) == len(orders)
    assert tuple(FeistelOrder(50, 2, 5).slice(0, 50)) == orders[(2, 5)]


def test_the_feistel_order_is_pinned_because_snapshots_record_positions_in_it() -> None:
    # A snapshot says how far into an epoch's order the job got; a changed cipher would resume it elsewhere.
    assert FeistelOrder(10, 0, 0).slice(0, 10) == [3, 7, 9, 5, 4, 1, 2, 8, 6, 0]
    assert FeistelOrder(10**6, 0, 0).slice(0, 4) == [930282, 48139, 12626, 795728]


def test_where_one_sample_lands_is_spread_evenly_over_the_positions() -> None:
    # 2,000 seeds, N = 10: 200 per position expected, standard deviation 13.4; a bound of 100 or 300 lies
    # 7 deviations out (and the seeds are fixed: the test gives the same counts every time).
    landed = Counter(FeistelOrder(10, seed, 0).position_of(0) for seed in range(2000))
    assert sorted(landed) == list(range(10))
    assert all(100 <= hits <= 300 for hits in landed.values()), landed


def test_every_order_of_a_tiny_dataset_occurs_about_equally_often() -> None:
    # N = 3 and 4 live in the 4-value domain with 1-bit halves, the weakest case for a Feistel network.
    of_three = Counter(tuple(FeistelOrder(3, seed, 7).slice(0, 3)) for seed in range(3000))
    assert len(of_three) == 6 and all(400 <= hits <= 600 for hits in of_three.values()), of_three
    of_four = Counter(tuple(FeistelOrder(4, 5, epoch).slice(0, 4)) for epoch in range(4800))
    assert len(of_four) == 24 and all(130 <= hits <= 270 for hits in of_four.values()), of_four


def test_neighbouring_positions_are_not_neighbouring_samples() -> None:
    for n in (10_000, 4**7 + 1):
        order = FeistelOrder(n, 0, 0).slice(0, n)
        adjacent = sum(1 for a, b in zip(order, order[1:]) if abs(a - b) == 1)
        assert adjacent < 20, (n, adjacent)  # about 2 in a random permutation


def test_an_order_of_10_to_the_12_samples_costs_kilobytes_not_terabytes() -> None:
    n = 10**12
    tracemalloc.start()
    try:
        order = FeistelOrder(n, 3, 4)
        windows = [order.slice(start, 512) for start in (0, n // 2, n - 512)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    for start, window in zip((0, n // 2, n - 512), windows):
        assert len(set(window)) == 512 and all(0 <= i < n for i in window)
        assert [order.position_of(i) for i in window[:20]] == list(range(start, start + 20))


def test_without_shuffle_the_order_is_the_identity() -> None:
    for kind in ORDERS:
        order = epoch_order(kind, 1000, 3, 2, shuffle=False)
        assert order.slice(0, 1000) == list(range(1000))
        assert order.index(17) == 17 and order.position_of(998) == 998
    assert FeistelOrder(10**15, 0, 0, shuffle=False).slice(10**15 - 2, 2) == [10**15 - 2, 10**15 - 1]


def test_the_randperm_order_is_the_legacy_permutation_bit_for_bit() -> None:
    for n, seed, epoch, shuffle in ((1, 0, 0, True), (7, 3, 1, True), (1000, 0, 0, True), (1000, 42, 9, True),
                                    (513, -5, 2, True), (100, 1, 0, False)):
        legacy = epoch_permutation(n, seed, epoch, shuffle).tolist()
        order = RandpermOrder(n, seed, epoch, shuffle)
        assert order.slice(0, n) == legacy
        assert order.slice(n // 2, n - n // 2) == legacy[n // 2:]
        assert [order.index(p) for p in range(n)] == legacy
        assert [order.position_of(i) for i in legacy] == list(range(n))


def test_out_of_range_positions_indices_and_sizes_are_refused() -> None:
    for kind in ORDERS:
        order = epoch_order(kind, 10, 0, 0)
        with pytest.raises(IndexError, match="outside 0..9"):
            order.index(10)
        with pytest.raises(IndexError, match="outside 0..9"):
            order.position_of(-1)
        with pytest.raises(IndexError, match="not within the epoch of 10 samples"):
            order.slice(5, 6)
    with pytest.raises(ValueError, match="1 to 2\\^63 samples, got 0"):
        FeistelOrder(0, 0, 0)
    with pytest.raises(ValueError, match="1 to 2\\^63 samples"):
        FeistelOrder(2**63 + 1, 0, 0)


def test_orders_are_chosen_by_kind_and_an_unknown_kind_names_the_known_ones() -> None:
    assert DEFAULT_ORDER == "feistel"
    assert set(ORDERS) == {"feistel", "randperm"}
    assert isinstance(epoch_order("feistel", 10, 0, 0), FeistelOrder)
    assert isinstance(epoch_order("randperm", 10, 0, 0), RandpermOrder)
    with pytest.raises(ValueError, match="'sorted' is not a known epoch order; the known orders are 'feistel', 'randp"):
        epoch_order("sorted", 10, 0, 0)
