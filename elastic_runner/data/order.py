"""The order of an epoch as a function of the position: no array of the dataset's size in any process.

:class:`~elastic_runner.data.sampler.ElasticSampler` consumes one order of the dataset per epoch, a pure
function of ``(seed, epoch)``, and the snapshot records how far into it the job got. The order used to be
``torch.randperm(N)`` materialised in every process: 10^7 samples cost seconds and hundreds of MB per
rank, and a corpus of 10^9 windows would cost tens of GB. Here the order is computed per position.

:class:`FeistelOrder` (the default, ``"feistel"``) maps a position ``p`` of ``range(N)`` to a dataset index
with a keyed block cipher over the smallest domain of an even number of bits, ``2^(2k) >= N``:

- a balanced Feistel network: the ``2k``-bit value is split into two ``k``-bit halves and each round
  replaces ``(L, R)`` by ``(R, L xor F(R, key_i))``. Whatever ``F`` is, every round, hence the network,
  is a bijection of the domain, and running the rounds backwards inverts it;
- cycle walking: a value ``>= N`` is encrypted again until it falls below ``N``. This restricts the
  domain's permutation to ``range(N)`` and is still a bijection (each position follows its own cycle of
  the domain's permutation to the next value in range). The domain ``D`` is at most ``4 N`` (less for
  ``N > 1``) and the walks of an epoch, running along disjoint stretches of its cycles, add up to at most
  ``D`` encryptions: at most 4 a position on average. :meth:`~FeistelOrder.position_of` walks backwards;
- round keys from ``(seed, epoch)`` by splitmix64, and ``F(R, key)`` the top ``k`` bits of splitmix64's
  mix of counter ``R`` in the stream seeded by ``key``: a well-tested 64-bit mixer, cheap in numpy.

What it guarantees: every epoch's order is a true permutation, so each sample occurs exactly once per
epoch, for every ``N >= 1`` (up to 2^63); the same ``(N, seed, epoch)`` always gives the same order, on
every machine; :meth:`~FeistelOrder.slice` costs O(count) memory and expected time, nothing in ``N``. What it
does not: the order is pseudo-random, statistically well spread (see the tests), not cryptographic; and with
at most 2^64 key schedules, for N >= 21 most of the N! orders can never occur.

Positions are encrypted as numpy uint64 arrays (unsigned wraparound is well defined there); the few values of a
window that are still walking after most have landed finish in Python ints, the same cipher, where one value
costs microseconds instead of a numpy pass.

:class:`RandpermOrder` (``"randperm"``) is the order before this module existed, ``torch.randperm`` with a
generator seeded from ``(seed, epoch)``, bit for bit. It materialises the epoch (O(N) time and memory) and
stays only so that a snapshot written without an order kind resumes in the order it started with.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import torch

#: The order of a run that records none (its snapshot or audit trail predates order kinds).
LEGACY_ORDER = "randperm"
DEFAULT_ORDER = "feistel"

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / golden ratio, odd
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
#: The largest dataset: positions and indices must fit numpy's uint64 and the domain 2^(2k) <= 2^64.
MAX_SAMPLES = 1 << 63

#: Feistel rounds. Luby-Rackoff's 4 rounds assume independent random round functions on wide halves; ours
#: are one keyed mixer, and for N <= 4 the halves are 1 bit wide, where a round is one of only 4 functions and
#: R rounds reach at most 4^R networks: over 24,000 seeds 6 rounds (4,096 networks) spread the 24 orders of 4
#: samples visibly unevenly (882 to 1,084 times each), 8 rounds (65,536) evenly (948 to 1,046, as random draws
#: would). Each round costs ~1/8 of a step's plan, which stays under a millisecond for 512 positions.
ROUNDS = 8

#: Positions of an epoch computed at once when it is read forward (see :meth:`FeistelOrder.slice`): 16 KB.
READ_AHEAD = 2048

#: A step's window is walked in numpy until fewer values than this are still outside ``range(N)``, then in
#: Python ints: a numpy pass costs tens of microseconds whatever its size, a Python encryption a few, and
#: the last values of a window may need many more walks than the rest (cycle walking is geometric).
_PYTHON_BELOW = 8


class EpochOrder(Protocol):
    """One epoch's order of ``range(num_samples)``: what :class:`ElasticSampler` needs of it."""

    kind: str
    num_samples: int
    epoch: int

    def slice(self, start: int, count: int) -> list[int]: ...
    def index(self, position: int) -> int: ...
    def position_of(self, index: int) -> int: ...


def _splitmix64(x: int) -> int:
    z = (x + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def round_keys(seed: int, epoch: int, rounds: int = ROUNDS) -> list[int]:
    """The Feistel round keys of ``(seed, epoch)``: a splitmix64 stream whose start mixes both, so that
    neighbouring seeds and epochs give unrelated keys (negative seeds are taken modulo 2^64)."""
    state = _splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64))
    keys = []
    for _ in range(rounds):
        state = (state + _GAMMA) & _MASK64
        keys.append(_splitmix64(state))
    return keys


def _check_range(what: str, value: int, limit: int) -> int:
    value = int(value)
    if not 0 <= value < limit:
        raise IndexError(f"{what} {value} is outside 0..{limit - 1}")
    return value


def _check_slice(start: int, count: int, num_samples: int) -> tuple[int, int]:
    start, count = int(start), int(count)
    if count < 0 or start < 0 or start + count > num_samples:
        raise IndexError(f"positions [{start}, {start + count}) are not within the epoch of {num_samples} samples")
    return start, count


class FeistelOrder:
    """A seeded permutation of ``range(num_samples)``, computed per position (see the module docstring)."""

    kind = "feistel"

    def __init__(self, num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> None:
        num_samples = int(num_samples)
        if not 1 <= num_samples <= MAX_SAMPLES:
            raise ValueError(f"an epoch order needs 1 to 2^63 samples, got {num_samples}")
        self.num_samples = num_samples
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.shuffle = bool(shuffle)
        # Half width k of the smallest domain 2^(2k) >= N; at least 1 bit so that N = 1 needs no special case.
        self.half_bits = max(1, ((num_samples - 1).bit_length() + 1) // 2)
        # numpy scalars of the same dtype keep every operation in uint64, where wraparound is well defined.
        self._n = np.uint64(num_samples)
        self._half = np.uint64(self.half_bits)
        self._low = np.uint64((1 << self.half_bits) - 1)
        self._top = np.uint64(64 - self.half_bits)  # F keeps the top bits: the best mixed ones
        self._int_keys = round_keys(self.seed, self.epoch)
        self._keys = [np.uint64(k) for k in self._int_keys]
        self._gamma, self._mix1, self._mix2 = np.uint64(_GAMMA), np.uint64(_MIX1), np.uint64(_MIX2)
        self._s30, self._s27 = np.uint64(30), np.uint64(27)
        self._ahead_start, self._ahead = 0, []  # positions [start, start + len) computed ahead (see slice)

    def __repr__(self) -> str:
        return (f"FeistelOrder(num_samples={self.num_samples}, seed={self.seed}, epoch={self.epoch}, "
                f"shuffle={self.shuffle})")

    # -- the public interface ----------------------------------------------------------------------------

    def slice(self, start: int, count: int) -> list[int]:
        """The dataset indices at positions ``[start, start + count)`` of the epoch. An epoch is read forward a step
        at a time: the positions after a slice are computed with it, :data:`READ_AHEAD` at a time (a numpy pass costs
        the same for 32 values as for thousands), and the next slices come from them."""
        start, count = _check_slice(start, count, self.num_samples)
        if not self.shuffle:
            return list(range(start, start + count))
        ahead = start - self._ahead_start
        if 0 <= ahead and ahead + count <= len(self._ahead):
            return self._ahead[ahead:ahead + count]
        if count < READ_AHEAD:
            self._ahead_start = start
            self._ahead = self._compute(start, min(READ_AHEAD, self.num_samples - start))
            return self._ahead[:count]
        return self._compute(start, count)

    def _compute(self, start: int, count: int) -> list[int]:
        if count <= _PYTHON_BELOW:
            return [self._walk_int(p, self._encrypt_int) for p in range(start, start + count)]
        out = self._encrypt(np.arange(count, dtype=np.uint64) + np.uint64(start))
        pending = np.flatnonzero(out >= self._n)
        while pending.size > _PYTHON_BELOW:
            out[pending] = self._encrypt(out[pending])
            pending = pending[out[pending] >= self._n]
        result: list[int] = out.tolist()
        for i in pending.tolist():
            result[i] = self._walk_int(result[i], self._encrypt_int)
        return result

    def index(self, position: int) -> int:
        """The dataset index at ``position``."""
        position = _check_range("position", position, self.num_samples)
        return self._walk_int(position, self._encrypt_int) if self.shuffle else position

    def position_of(self, index: int) -> int:
        """Where the dataset index ``index`` comes in the epoch: the inverse of :meth:`index`."""
        index = _check_range("index", index, self.num_samples)
        return self._walk_int(index, self._decrypt_int) if self.shuffle else index

    # -- the cipher, vectorised (numpy uint64) and for one value (Python int): the tests hold them equal ----

    def _round(self, half: np.ndarray, key: np.uint64) -> np.ndarray:
        # splitmix64 at counter `half` of the stream seeded by `key`, without its last step: that step
        # (z ^= z >> 31) changes only the low 33 bits, and F keeps the top `half_bits`, at most 31 of them
        # unless N > 2^62 (then 32, one of which it would flip: either way a keyed hash).
        z = half * self._gamma
        z += key
        z ^= z >> self._s30
        z *= self._mix1
        z ^= z >> self._s27
        z *= self._mix2
        z >>= self._top
        return z

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._low
        for key in self._keys:
            mixed = self._round(right, key)
            mixed ^= left
            left, right = right, mixed
        return (left << self._half) | right

    def _round_int(self, half: int, key: int) -> int:
        z = (half * _GAMMA + key) & _MASK64
        z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
        z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
        return z >> (64 - self.half_bits)

    def _encrypt_int(self, x: int) -> int:
        left, right = x >> self.half_bits, x & ((1 << self.half_bits) - 1)
        for key in self._int_keys:
            left, right = right, left ^ self._round_int(right, key)
        return (left << self.half_bits) | right

    def _decrypt_int(self, x: int) -> int:
        left, right = x >> self.half_bits, x & ((1 << self.half_bits) - 1)
        for key in reversed(self._int_keys):
            left, right = right ^ self._round_int(left, key), left
        return (left << self.half_bits) | right

    def _walk_int(self, value: int, cipher: Callable[[int], int]) -> int:
        """Cycle walking: apply ``cipher`` until the value is in ``range(N)`` again (at least once)."""
        value = cipher(value)
        while value >= self.num_samples:
            value = cipher(value)
        return value


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The legacy order: one epoch's ``torch.randperm``, materialised (kept for :class:`RandpermOrder`)."""
    if not shuffle:
        return torch.arange(num_samples)
    # A fixed mixing of (seed, epoch) keeps epochs independent of each other.
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7_919 + 0x5EED) % (2**63))
    return torch.randperm(num_samples, generator=g)


class RandpermOrder:
    """The order of runs before :class:`FeistelOrder`: ``epoch_permutation``, bit for bit, materialised once
    (as an int64 tensor, 8 bytes a sample; its inverse only if :meth:`position_of` is asked)."""

    kind = "randperm"

    def __init__(self, num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> None:
        num_samples = int(num_samples)
        if num_samples < 1:
            raise ValueError(f"an epoch order needs at least 1 sample, got {num_samples}")
        self.num_samples = num_samples
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.shuffle = bool(shuffle)
        self._perm = epoch_permutation(num_samples, self.seed, self.epoch, self.shuffle)
        self._inverse: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (f"RandpermOrder(num_samples={self.num_samples}, seed={self.seed}, epoch={self.epoch}, "
                f"shuffle={self.shuffle})")

    def slice(self, start: int, count: int) -> list[int]:
        start, count = _check_slice(start, count, self.num_samples)
        return self._perm[start:start + count].tolist()

    def index(self, position: int) -> int:
        return int(self._perm[_check_range("position", position, self.num_samples)])

    def position_of(self, index: int) -> int:
        index = _check_range("index", index, self.num_samples)
        if self._inverse is None:
            self._inverse = torch.empty_like(self._perm)
            self._inverse[self._perm] = torch.arange(self.num_samples)
        return int(self._inverse[index])


ORDERS: dict[str, type[FeistelOrder] | type[RandpermOrder]] = {"feistel": FeistelOrder, "randperm": RandpermOrder}


def check_order_kind(kind: object, where: str = "the order") -> str:
    """``kind`` if it names a known order, else a ValueError that lists the known ones."""
    if not isinstance(kind, str) or kind not in ORDERS:
        raise ValueError(f"{where} {kind!r} is not a known epoch order; the known orders are "
                         f"{', '.join(repr(k) for k in ORDERS)}")
    return kind


def epoch_order(kind: str, num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> EpochOrder:
    """The order ``kind`` (a key of :data:`ORDERS`) of one epoch."""
    return ORDERS[check_order_kind(kind)](num_samples, seed, epoch, shuffle)
