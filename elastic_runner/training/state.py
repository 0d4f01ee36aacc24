"""TrainState: the job's progress that is not already inside the model, optimizer or sampler.

The step count, the samples consumed, the world sizes seen and the live goodput clock. It travels
in every snapshot, so a resume rolls all of them back with the model: time spent on steps that are
later recomputed, or lost with a process, never counts as productive.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Job-level progress that is not already inside the model/optimizer/sampler."""

    step: int = 0  #: optimizer steps completed (the next step is step + 1)
    generation: int = 0  #: training attempt that produced this state
    samples_total: int = 0  #: samples consumed over all epochs, all ranks
    membership_changes: int = 0
    recoveries: int = 0
    lr_scale: float = 1.0  #: the learning-rate factor the optimizer state was built with
    world_history: list[dict[str, Any]] = field(default_factory=list)
    # The live goodput clock (elastic_runner.observe.goodput). Kept in the state, so a resume rolls it back with the
    # steps: time spent on steps that are later recomputed, or lost with a process, never counts.
    productive_s: float = 0.0  #: seconds of training that count (snapshot blocking and restarts excluded)
    closed_sessions_s: float = 0.0  #: wall time of the job's earlier sessions, each up to its last saved state
    session_started: float = 0.0  #: wall clock at which this session's first attempt began (0: not yet)
    state_time: float = 0.0  #: wall clock of this state (set when it is captured: state_dict)
    session_agents: list[str] = field(default_factory=list)  #: agents seen in this session (newest 64)
    #: Steps skipped by rule (train.skip_steps, and those a non-finite rollback added): kept in every snapshot, so a
    #: later resume from before such a step skips it again instead of meeting its NaN again.
    skipped_steps: list[int] = field(default_factory=list)

    def add_skipped(self, steps: Any) -> None:
        self.skipped_steps = sorted(set(self.skipped_steps) | {int(s) for s in steps})

    def state_dict(self) -> dict[str, Any]:
        # The state's wall-clock time is when it is captured (a snapshot), not kept up to date every step.
        return asdict(self) | {"state_time": time.time()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)

    def enter_generation(self, generation: int, world_size: int, resumed: bool) -> None:
        previous = self.world_history[-1]["world_size"] if self.world_history else None
        if previous is not None and previous != world_size:
            self.membership_changes += 1
        if resumed:
            self.recoveries += 1
        self.generation = generation
        self.world_history.append({"generation": generation, "step": self.step, "world_size": world_size, "time": time.time()})

    def start_clock(self, now: float, agents: list[str], resumed: bool, by_hand: bool) -> bool:
        """Count this attempt into the job's wall time; True when it begins a new session. A resume is a
        recovery (its gap is lost time) unless every agent of the attempt is new to the session (every
        node was started again by hand) or, without agent names, the worker was started by hand
        (``by_hand``): then the pause between the two sessions is nobody's loss."""
        seen = set(self.session_agents)
        new_session = not resumed or not self.session_started or (
            bool(agents) and bool(seen) and seen.isdisjoint(agents)) or (not agents and by_hand)
        known = list(self.session_agents)
        if new_session:
            if resumed and self.session_started:
                self.closed_sessions_s += max(0.0, self.state_time - self.session_started)
            self.session_started, known = now, []
        self.session_agents = (known + [a for a in dict.fromkeys(agents) if a not in known])[-64:]
        self.state_time = now
        return new_session

    def goodput_wall_s(self, now: float) -> float:
        """The job's wall time so far: its earlier sessions and this one."""
        return self.closed_sessions_s + (now - self.session_started) if self.session_started else 0.0

    def goodput(self, now: float) -> float | None:
        """Productive time over the job's wall time so far (None before the clock started)."""
        wall = self.goodput_wall_s(now)
        return min(1.0, self.productive_s / wall) if wall > 0 else None
