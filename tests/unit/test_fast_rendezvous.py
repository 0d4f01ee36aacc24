"""When a rendezvous round may skip torch's last call (elastic_runner.agent.fast_rendezvous)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Iterator

import pytest

from elastic_runner.agent import fast_rendezvous as fr

from ..support import fast_rendezvous_installed

WINDOW = timedelta(seconds=3)  # keep_alive_interval 1 s x keep_alive_max_attempt 3
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


@pytest.fixture(autouse=True)
def fresh_module_state() -> Iterator[None]:
    yield
    fr.set_previous_participants([])


def test_without_a_previous_round_torch_rules_apply() -> None:
    fr.set_previous_participants([])
    assert not fr.previous_round_accounted_for({"a": 0}, {}, WINDOW, NOW)


def test_all_previous_nodes_back_completes_at_once() -> None:
    fr.set_previous_participants(["a", "b"], {"a": NOW, "b": NOW})
    assert fr.previous_round_accounted_for({"a": 0, "b": 0}, {}, WINDOW, NOW)


def test_a_node_that_is_neither_back_nor_silent_for_the_window_is_waited_for() -> None:
    # A live agent between leaving the old round and joining the new one: absent, but it beat 1 s ago.
    fr.set_previous_participants(["a", "b"], {"a": NOW, "b": NOW - timedelta(seconds=1)})
    assert not fr.previous_round_accounted_for({"a": 0}, {}, WINDOW, NOW)


def test_a_node_silent_for_longer_than_the_window_counts_as_dead() -> None:
    fr.set_previous_participants(["a", "b"], {"a": NOW, "b": NOW - timedelta(seconds=1)})
    later = NOW + timedelta(seconds=2.5)  # b's last beat is 3.5 s old
    assert fr.previous_round_accounted_for({"a": 0}, {}, WINDOW, later)


def test_a_newer_heartbeat_seen_while_waiting_keeps_the_node_alive() -> None:
    fr.set_previous_participants(["a", "b"], {"a": NOW, "b": NOW - timedelta(seconds=5)})
    # b beat again (it was only slow): the state now shows a fresh heartbeat
    assert not fr.previous_round_accounted_for({"a": 0}, {"b": NOW}, WINDOW, NOW + timedelta(seconds=1))
    # and that newest beat is remembered after b left the state again
    assert not fr.previous_round_accounted_for({"a": 0}, {}, WINDOW, NOW + timedelta(seconds=2))


def test_a_node_whose_heartbeat_was_never_seen_is_not_presumed_dead() -> None:
    fr.set_previous_participants(["a", "b"], {"a": NOW})
    assert not fr.previous_round_accounted_for({"a": 0}, {}, WINDOW, NOW + timedelta(hours=1))


def _finished_round(participants: dict[str, int], round_: int = 4) -> object:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    state.round, state.complete = round_, True
    state.participants = dict(participants)
    state.last_heartbeats = {node: NOW for node in participants}
    return state


def test_a_node_whose_agent_stopped_beating_is_counted_dead_without_waiting_its_heartbeats_out() -> None:
    state = _finished_round({"a": 0, "b": 1, "c": 2})
    assert fr.count_out(state.participants, "a", [0, 2]) == ["c"], "never this node itself"
    fr.set_previous_participants(state.participants, state.last_heartbeats, state.round)
    assert fr.previous_round_accounted_for({"a": 0, "b": 0}, {"c": NOW}, WINDOW, NOW), \
        "c counted out although its last heartbeat is fresh"
    assert not fr.previous_round_accounted_for({"a": 0}, {}, WINDOW, NOW), "b was not counted out: waited for"
    fr.set_previous_participants(state.participants, state.last_heartbeats, state.round)
    assert not fr.previous_round_accounted_for({"a": 0, "b": 0}, {"c": NOW}, WINDOW, NOW), \
        "a count-out holds for the round after the one it was made in only"


def test_the_finished_round_drops_a_counted_out_node_once_every_other_member_has_left_it() -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _remove_participant_epilogue

    state = _finished_round({"a": 0, "b": 1, "c": 2})
    fr.count_out(state.participants, "a", [1])
    fr.set_previous_participants(state.participants, state.last_heartbeats, state.round)
    settings = type("Settings", (), {"min_nodes": 1})()
    del state.participants["a"]  # a left the round to join the next one; c has not yet
    assert not fr.drop_counted_out("a", state, settings, _remove_participant_epilogue)
    del state.participants["c"]
    assert not fr.drop_counted_out("b", state, settings, _remove_participant_epilogue), "b does not drop itself"
    assert fr.drop_counted_out("a", state, settings, _remove_participant_epilogue)
    assert not state.participants and "b" not in state.last_heartbeats
    assert (state.round, state.complete) == (5, False), "the round moves on, as when torch's sanitizer drops b"
    assert not fr.drop_counted_out("a", state, settings, _remove_participant_epilogue), "only the round it ended"


def test_a_count_out_never_drops_a_node_of_another_round() -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _remove_participant_epilogue

    state = _finished_round({"a": 0, "b": 1})
    fr.count_out(state.participants, "a", [1])
    fr.set_previous_participants(state.participants, state.last_heartbeats, state.round)
    newer = _finished_round({"b": 0}, round_=5)
    assert not fr.drop_counted_out("a", newer, type("S", (), {"min_nodes": 1})(), _remove_participant_epilogue)
    assert newer.participants == {"b": 0}


@pytest.fixture
def join_op() -> Iterator[object]:
    """The patched join op (fr.install() patches torch's module for the process: undone after the test)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    with fast_rendezvous_installed():
        yield dr._RendezvousJoinOp()


def _survivor_alone_in_the_next_round(spare_beat: datetime, last_call_in: float = 30) -> tuple[object, object, object]:
    """Round 5 forms after the lost node b was counted out of round 4; the survivor a is its only participant, and the
    spare s, which waited on the redundancy list of round 4, has just removed itself from it (torch's
    REMOVE_FROM_REDUNDANCY_LIST deletes its heartbeat too): for one poll the state shows it nowhere."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    ended = _finished_round({"a": 0, "b": 1})
    ended.redundancy_list = {"s"}
    ended.last_heartbeats["s"] = spare_beat
    fr.count_out(ended.participants, "a", [1])
    fr.set_previous_participants(ended.participants, ended.last_heartbeats, ended.round)
    fr.note_spares(ended.redundancy_list, ended.last_heartbeats)
    forming = dr._RendezvousState()
    forming.round, forming.participants = 5, {"a": 0}
    forming.last_heartbeats = {"a": datetime.now(timezone.utc)}
    forming.deadline = datetime.now(timezone.utc) + timedelta(seconds=last_call_in)  # torch's last call
    settings = dr.RendezvousSettings("job", min_nodes=1, max_nodes=2, timeout=dr.RendezvousTimeout(),
                                     keep_alive_interval=timedelta(seconds=1), keep_alive_max_attempt=3)
    return dr._RendezvousContext("a", forming, settings), forming, dr._Action


def test_a_spare_between_leaving_the_redundancy_list_and_joining_is_waited_for(join_op: object) -> None:
    ctx, forming, action = _survivor_alone_in_the_next_round(spare_beat=datetime.now(timezone.utc))
    assert not forming.redundancy_list and not forming.wait_list
    decision = join_op(ctx, time.monotonic() + 60)  # type: ignore[operator]
    assert decision != action.MARK_RENDEZVOUS_COMPLETE, \
        "the round completed at world size 1 while the spare was on its way to the free seat"
    forming.participants["s"] = 0  # the spare's next poll seats it: the round is no longer short of one
    assert not fr.spare_coming(forming.participants, 2, WINDOW, datetime.now(timezone.utc))


def test_a_spare_that_went_silent_is_not_waited_for_past_torchs_dead_node_window(join_op: object) -> None:
    ctx, _, action = _survivor_alone_in_the_next_round(
        spare_beat=datetime.now(timezone.utc) - timedelta(seconds=4))  # the window is 1 s x 3
    assert join_op(ctx, time.monotonic() + 60) == action.MARK_RENDEZVOUS_COMPLETE  # type: ignore[operator]


def test_torchs_last_call_is_held_while_a_spare_is_on_its_way_for_at_most_the_dead_node_window(join_op: object) -> None:
    # On a loaded machine the spare's two polls (leave the redundancy list, then join) outlast launch's 1 s last call.
    ctx, forming, action = _survivor_alone_in_the_next_round(spare_beat=datetime.now(timezone.utc), last_call_in=-0.1)
    decision = join_op(ctx, time.monotonic() + 60)  # type: ignore[operator]
    assert decision in (action.SYNC, action.KEEP_ALIVE), \
        "torch's last call completed the round at world size 1 while the spare was on its way"
    forming.deadline -= WINDOW  # the spare never came: the last call was 3.1 s ago
    assert join_op(ctx, time.monotonic() + 60) == action.MARK_RENDEZVOUS_COMPLETE  # type: ignore[operator]
