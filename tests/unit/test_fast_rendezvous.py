"""When a rendezvous round may skip torch's last call (elastic_runner.agent.fast_rendezvous)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Iterator

import pytest

from elastic_runner.agent import fast_rendezvous as fr

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
