"""The failure story told from a run's event log: cause first, outcome last, effects left out."""

from __future__ import annotations

from pathlib import Path

from elastic_runner.observe.events import EventLog
from elastic_runner.observe.failure_story import failure_story

RESUME = {"step": 40, "furthest_step": 41, "steps_recomputed": 1, "tier": "memory"}
#: What a worker's start event says of where it runs: under torchrun (a run id), and its agent's name.
UNDER_AGENT = {"run_id": "job1", "agent": "node-a-100-0"}


def previous_attempt(run_dir: Path, world: int) -> None:
    for rank in range(world):
        log = EventLog(run_dir, f"gen-000001-rank-{rank:05d}", generation=1, rank=rank)
        log.emit("start", world_size=world, **UNDER_AGENT)
        log.close()


def started(run_dir: Path, generation: int, world: int, agent: str = UNDER_AGENT["agent"], **context: int) -> None:
    EventLog(run_dir, f"gen-{generation:06d}-rank-00000", generation=generation, rank=0, **context).emit(
        "start", world_size=world, run_id="job1", agent=agent)


def agent_saw(run_dir: Path, name: str, *failures: dict[str, int]) -> None:
    log = EventLog(run_dir, f"agent-{name}", role="agent")
    log.emit("agent_worker_failed", failures=list(failures))
    log.close()


def test_a_killed_rank_is_the_cause_and_the_peers_it_broke_are_not(tmp_path: Path) -> None:
    previous_attempt(tmp_path, 3)
    broken = EventLog(tmp_path, "gen-000001-rank-00000", generation=1, rank=0)
    broken.emit("failure", error="RuntimeError: [gloo] Read error: Connection reset by peer")
    agent_saw(tmp_path, "a", {"rank": 0, "pid": broken.context["pid"], "exitcode": 1})
    agent_saw(tmp_path, "b", {"rank": 2, "pid": 4242, "exitcode": -9})
    agent_saw(tmp_path, "c", {"rank": 1, "pid": 4243, "exitcode": 75})
    story = failure_story(tmp_path, 2, 3, RESUME, now=__import__("time").time() + 0.5)
    assert story is not None and story.startswith("rank 2 (node ") and "pid 4242) was killed by SIGKILL at step 41" in story
    assert "rank 0" not in story and "rank 1" not in story
    assert story.endswith("at world size 3, resumed step 40 from memory, 1 steps lost")


def test_a_node_that_left_or_joined_is_told_as_such(tmp_path: Path) -> None:
    previous_attempt(tmp_path, 2)
    left = failure_story(tmp_path, 2, 1, RESUME, now=__import__("time").time())
    assert left is not None and left.startswith("a node left (world size 2 → 1) at step 41 → recovered")
    joined = failure_story(tmp_path, 2, 3, RESUME, now=__import__("time").time())
    assert joined is not None and joined.startswith("a node joined (world size 2 → 3)") and "→ training at world size 3" in joined


def test_a_first_start_has_no_story(tmp_path: Path) -> None:
    assert failure_story(tmp_path, 1, 2, RESUME, now=0.0) is None


def test_a_recovery_where_rank_0_kept_its_process_is_told_in_process(tmp_path: Path) -> None:
    previous_attempt(tmp_path, 2)  # this process's pid, as rank 0 and 1 of generation 1
    agent_saw(tmp_path, "b", {"rank": 1, "pid": 4242, "exitcode": -9})
    started(tmp_path, 2, 2)
    story = failure_story(tmp_path, 2, 2, RESUME, now=__import__("time").time() + 0.5)
    assert story is not None and "was killed by SIGKILL at step 41 → recovered in process in " in story, story


def test_a_recovery_in_new_processes_is_not_told_in_process(tmp_path: Path) -> None:
    previous_attempt(tmp_path, 2)
    agent_saw(tmp_path, "b", {"rank": 1, "pid": 4242, "exitcode": -9})
    started(tmp_path, 2, 2, pid=4343)
    story = failure_story(tmp_path, 2, 2, RESUME, now=__import__("time").time() + 0.5)
    assert story is not None and "→ recovered in " in story and "in process" not in story, story


def test_a_node_lost_under_in_process_recovery_is_timed_from_the_survivors_broken_collective(tmp_path: Path) -> None:
    """No worker fails for an agent to report (the lost node's agent went with it; the survivor keeps its process):
    the survivor's own failure event is when the loss was noticed."""
    import time

    previous_attempt(tmp_path, 2)
    survivor = EventLog(tmp_path, "gen-000001-rank-00000", generation=1, rank=0)
    survivor.emit("failure", error="RuntimeError: [gloo] Read error: Connection reset by peer")
    survivor.close()
    started(tmp_path, 2, 1)
    story = failure_story(tmp_path, 2, 1, RESUME, now=time.time() + 2.5)
    assert story is not None and story.startswith("a node left (world size 2 → 1) at step 41 → recovered in process in 2."), story


def test_a_job_started_again_at_another_world_size_is_no_node_that_left(tmp_path: Path) -> None:
    """The run stopped, and its command was run again with fewer processes: new agents on every node."""
    previous_attempt(tmp_path, 2)
    started(tmp_path, 2, 1, agent="node-a-200-5")
    story = failure_story(tmp_path, 2, 1, {"step": 40, "tier": "disk"}, now=__import__("time").time())
    assert story == ("the job was started again (new agents on every node, world size 2 before) → training at world "
                     "size 1, resumed step 40 from disk"), story


def test_a_rollback_is_told_as_the_replicas_that_differed_not_as_every_worker_exiting(tmp_path: Path) -> None:
    previous_attempt(tmp_path, 3)
    rank0 = EventLog(tmp_path, "gen-000001-rank-00000", generation=1, rank=0)
    rank0.emit("replica_mismatch", step=80, verified_step=60, suspects=[2], nodes=[1], status="rolled_back")
    for rank in range(3):  # every worker leaves with status 1 on purpose
        agent_saw(tmp_path, f"n{rank}", {"rank": rank, "pid": 5000 + rank, "exitcode": 1})
    resume = {"step": 50, "furthest_step": 80, "steps_recomputed": 30, "tier": "disk"}
    story = failure_story(tmp_path, 2, 3, resume, now=__import__("time").time() + 0.5)
    assert story is not None and story.startswith(
        "the replicas' fingerprints differed at step 80 (suspect: rank 2; the last check that agreed: step 60), "
        "a rollback → recovered in "), story
    assert "exited with status" not in story and story.endswith("resumed step 50 from disk, 30 steps lost")
