"""The agent's own metrics follow its events (:mod:`elastic_runner.agent.metrics`)."""

from __future__ import annotations

from elastic_runner.agent.metrics import AgentMetrics


def _value(metrics: AgentMetrics, name: str) -> float:
    return float(metrics.registry.get_sample_value(name) or 0.0)


def test_workers_kept_through_a_round_and_replaced_alone_are_counted_each() -> None:
    metrics = AgentMetrics(None)
    metrics.observe("workers_kept", reason="a node is waiting to join", seconds=0.1,
                    kept=[{"local_rank": 0, "pid": 11, "rank": 2}, {"local_rank": 1, "pid": 12, "rank": 3}], started=[])
    metrics.observe("worker_replaced", rank=1, local_rank=1, pid=12, new_pid=13, exitcode=-9, standby=True)
    assert _value(metrics, "elastic_runner_agent_workers_kept_total") == 2
    assert _value(metrics, "elastic_runner_agent_workers_replaced_total") == 1
    assert _value(metrics, "elastic_runner_agent_restarts_total") == 0, "neither is a restart of the worker group"


def test_nodes_counted_out_of_the_rendezvous_are_counted_each() -> None:
    metrics = AgentMetrics(None)
    metrics.observe("members_counted_out", members=["node-a_1_0", "node-b_2_0"], group_ranks=[0, 2])
    assert _value(metrics, "elastic_runner_agent_nodes_counted_out_total") == 2
