"""What the audit derives where a run's records are not all there (:mod:`elastic_runner.observe.audit`): a rank's
records lost with its node (its share follows from the other ranks' records of the step), every rank's records of
some steps lost with every node at once (a later attempt's resume proves the steps were trained: its snapshot's
sampler position says where they ended, and the order is a pure function), and a run's beginning that is another
run's (``snapshot.resume_from``)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from ..data.order import EpochOrder, epoch_order
from ..printable import printable


def resumed_at(header: dict[str, Any], key: str = "resumed_at") -> dict[str, int] | None:
    """A header's ``{"step", "epoch", "consumed"}`` (where its attempt resumed), if well formed."""
    at = header.get(key)
    if isinstance(at, dict) and all(type(at.get(k)) is int and at[k] >= 0 for k in ("step", "epoch", "consumed")):
        return {k: at[k] for k in ("step", "epoch", "consumed")}
    return None


def started_from(headers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest generation's ``started_from`` (a start from another run's snapshot), if well formed."""
    for h in sorted(headers, key=lambda h: h["generation"], reverse=True):
        if (at := resumed_at(h, "started_from")) is not None:
            f, taken = h["started_from"], h["started_from"].get("taken")
            return at | {"snapshot": printable(f.get("snapshot"), 80),
                         "taken": taken if isinstance(taken, list) and all(type(t) is int for t in taken) else None}
    return None


def proven_by_resumes(headers: list[dict[str, Any]], recorded: Iterable[int], num_samples: int, batch: int,
                      partial: str, first: int) -> dict[int, tuple[int, int, int, int]]:
    """Steps without any record that a later attempt's resume proves were trained: ``step -> (epoch, start, count,
    the step resumed at)``. From each resume (its snapshot's step S, epoch E and position C) back over the steps
    that have no records: with a constant global batch every step's window is ``[k*batch, (k+1)*batch)`` of its
    epoch (the last one of an epoch cut at its end with ``partial_batch: partial``), so the windows follow."""
    have = set(recorded)
    end_of_epoch = num_samples if partial == "partial" else num_samples // batch * batch
    proven: dict[int, tuple[int, int, int, int]] = {}
    for h in headers:
        at = resumed_at(h)
        if at is None:
            continue
        epoch, position = at["epoch"], min(at["consumed"], end_of_epoch)
        for step in range(at["step"], first - 1, -1):
            if step in have or step in proven:
                break
            if position == 0:
                if epoch == 0:
                    break
                epoch, position = epoch - 1, end_of_epoch
            start = position - (position % batch or batch)
            proven[step] = (epoch, start, position - start, at["step"])
            position = start
    return proven


def note_lost(spans: list[dict[str, Any]], generation: int, ranks: list[int], step: int,
              proved_by_step: int | None = None) -> None:
    """Add ``step`` to the span of lost records it continues, or start one (``ranks`` empty: every rank's, proved
    by the resume at ``proved_by_step``)."""
    last = spans[-1] if spans else None
    if last is not None and last["generation"] == generation and last["ranks"] == ranks \
            and last["last_step"] == step - 1 and last.get("proved_by_step") == proved_by_step:
        last["last_step"] = step
    else:
        spans.append({"generation": generation, "ranks": ranks, "first_step": step, "last_step": step}
                     | ({"proved_by_step": proved_by_step} if proved_by_step is not None else {}))


def with_derived(lines: Iterable[dict[str, Any]], derived: dict[int, tuple[int, list[int], int, int, int]], owner: dict[int, int],
                  num_samples: int, seed: int, shuffle: bool, kind: str) -> Iterator[dict[str, Any]]:
    """The trail's records, and for each step in ``derived`` the shares of the ranks whose records were lost with
    their node: ``window[rank::world]`` of the step's window in the epoch's order (the elastic sampler's rule)."""
    yield from lines
    order: EpochOrder | None = None  # one epoch's order at a time: the steps come in order
    for step in sorted(derived):
        world, ranks, epoch, start, count = derived[step]
        if order is None or order.epoch != epoch:
            order = epoch_order(kind, num_samples, seed, epoch, shuffle)
        window = order.slice(start, count)
        for rank in ranks:
            yield {"type": "step", "generation": owner[step], "step": step, "epoch": epoch, "rank": rank,
                   "indices": window[rank::world]}


def generation_rank(relative: str) -> tuple[int, int] | None:
    """``(generation, rank)`` of an audit file's path (``audit/gen-GGGGGG-rank-RRRRR[-part-NNNN].jsonl``)."""
    name = relative.rsplit("/", 1)[-1]
    try:
        generation, rank = name.removeprefix("gen-").split("-rank-", 1)
        return int(generation), int(rank[:5])
    except ValueError:
        return None
