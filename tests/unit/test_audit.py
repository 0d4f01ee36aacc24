"""The audit checker replays the trail and catches every way of losing or repeating samples."""

from __future__ import annotations

import json
from pathlib import Path

from elastic_runner.data.sampler import ElasticSampler
from elastic_runner.observe.audit import AuditWriter, check_audit
from elastic_runner.observe.records import FROM_BUCKET

N, G = 40, 8


def header(**extra: object) -> dict:
    return {"num_samples": N, "seed": 0, "shuffle": True, "partial_batch": "drop", "global_batch": G,
            "sampler": "elastic"} | extra


def simulate(run_dir: Path, generation: int, world: int, start_state: dict | None, steps: int,
             first_step: int, tamper=None, end: bool = False, skipped: frozenset[int] = frozenset(),  # noqa: ANN001
             snapshot_at: int | None = None) -> dict:
    """Run `steps` steps of a `world`-rank job from `start_state`, writing its audit trail."""
    resumed = {"resumed_at": {"step": first_step, "epoch": start_state["epoch"], "consumed": start_state["consumed"]}} \
        if start_state else {}  # as a resumed attempt's header says where its snapshot left the sampler
    writers = [AuditWriter(run_dir, generation=generation, rank=r, world_size=world, header=header(**resumed))
               for r in range(world)]
    samplers = [ElasticSampler(N, G, rank=r, world_size=world) for r in range(world)]
    for s in samplers:
        if start_state:
            s.load_state_dict(start_state)
    step, snapshot = first_step, None
    for _ in range(steps):
        if samplers[0].epoch_done():
            for s in samplers:
                s.next_epoch()
        plans = [next(s.plans()) for s in samplers]
        step += 1
        for w, p in zip(writers, plans):
            indices = tamper(step, w.rank, list(p.indices)) if tamper else p.indices
            w.step(step=step, epoch=p.epoch, start=p.start, global_count=p.global_count, indices=indices,
                   micro_batch=len(p.indices), accumulation=1, skipped=step in skipped)
        for s, p in zip(samplers, plans):
            s.advance(p)
        if step == snapshot_at:
            snapshot = samplers[0].state_dict()
    if end:
        writers[0].end(step)
    for w in writers:
        w.close()
    return snapshot if snapshot is not None else samplers[0].state_dict()


def test_a_clean_run_with_a_restart_and_a_world_size_change_is_clean(tmp_path: Path) -> None:
    snap = simulate(tmp_path, 1, 2, None, 7, 0)  # steps 1..7 at world size 2
    # generation 1 crashed after step 9 but its last snapshot was at step 7:
    simulate(tmp_path, 1, 2, snap, 2, 7)
    simulate(tmp_path, 2, 3, snap, 13, 7, end=True)  # resumed at world size 3, redid 8..9
    report = check_audit(tmp_path)
    assert report.ok, report.render()
    assert report.finished and report.final_step == 20
    assert report.steps_superseded == 2
    assert [e.seen for e in report.epochs] == [40, 40, 40, 40]
    assert set(report.world_sizes.values()) == {2, 3}


def test_a_step_skipped_by_rule_uses_its_samples_once_and_the_report_says_they_were_not_trained_on(
        tmp_path: Path) -> None:
    """A non-finite rollback: generation 1 met a NaN at step 8 and rolled back to its step-5 snapshot; generation 2
    redid steps 6..20 with step 8 skipped. Generation 1's own skipped record of step 7, which generation 2 redid and
    trained on, does not count."""
    snap = simulate(tmp_path, 1, 2, None, 9, 0, skipped=frozenset({7}), snapshot_at=5)
    simulate(tmp_path, 2, 2, snap, 15, 5, skipped=frozenset({8}), end=True)
    report = check_audit(tmp_path)
    assert report.ok and report.final_step == 20, report.render()
    assert report.skipped_steps == [8]
    assert [e.skipped for e in report.epochs] == [0, G, 0, 0] and [e.seen for e in report.epochs] == [N] * 4
    assert f"epoch 1: seen {N}/{N} ({G} skipped by rule: consumed, not trained on)" in report.render()
    assert report.to_dict()["skipped_steps"] == [8] and report.to_dict()["epochs"][1]["skipped"] == G


def test_a_repeated_sample_is_a_violation(tmp_path: Path) -> None:
    def repeat(step: int, rank: int, indices: list[int]) -> list[int]:
        return [indices[0]] + indices[:-1] if (step, rank) == (3, 1) else indices

    simulate(tmp_path, 1, 2, None, 10, 0, tamper=repeat, end=True)
    report = check_audit(tmp_path)
    assert not report.ok
    assert len(report.epochs[0].duplicates) == 1 and len(report.epochs[0].missing) == 1


def test_a_lost_step_is_a_violation(tmp_path: Path) -> None:
    snap = simulate(tmp_path, 1, 2, None, 3, 0)
    # the restart wrongly resumed one step later than the snapshot said
    skipped = dict(snap, consumed=snap["consumed"] + G)
    simulate(tmp_path, 2, 2, skipped, 6, 4, end=True)
    report = check_audit(tmp_path)
    assert not report.ok
    assert "step 4 has no records" in report.violations
    assert len(report.epochs[0].missing) == G


def test_a_step_missing_a_rank_is_a_violation(tmp_path: Path) -> None:
    simulate(tmp_path, 1, 2, None, 5, 0, end=True)
    path = tmp_path / "audit" / "gen-000001-rank-00001.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(line for line in lines if '"step":3,' not in line))
    report = check_audit(tmp_path)
    assert any("step 3" in v and "ranks [0]" in v for v in report.violations)


def test_a_torn_last_line_from_a_killed_writer_is_ignored(tmp_path: Path) -> None:
    simulate(tmp_path, 1, 2, None, 4, 0, end=True)
    with open(tmp_path / "audit" / "gen-000001-rank-00001.jsonl", "a") as fh:
        fh.write('{"type":"step","generation":1,"epoch":0,"step":5,"ra')
    report = check_audit(tmp_path)
    assert report.ok and report.torn_lines == 1


def test_a_changing_global_batch_is_a_violation(tmp_path: Path) -> None:
    def shrink(step: int, rank: int, indices: list[int]) -> list[int]:
        return indices

    simulate(tmp_path, 1, 2, None, 3, 0, tamper=shrink, end=True)
    path = tmp_path / "audit" / "gen-000001-rank-00000.jsonl"
    path.write_text(path.read_text().replace('"global_count":8', '"global_count":6', 1))
    assert not check_audit(tmp_path).ok


def test_no_audit_directory_is_reported(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("audit: {samples: false}\n")  # a run directory, without a trail
    report = check_audit(tmp_path)
    assert not report.ok and "audit.samples" in report.violations[0]


# -- a node lost with its disk, records read from a bucket ----------------------------------------------------------


def keep_steps_up_to(run_dir: Path, generation: int, rank: int, last: int, hole: int | None = None) -> None:
    """Cut a rank's trail as an upload that stopped at step ``last`` leaves it (``hole``: also drop that step)."""
    path = run_dir / "audit" / f"gen-{generation:06d}-rank-{rank:05d}.jsonl"
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if '"type":"step"' not in line or (int(line.split('"step":')[1].split(",")[0]) <= last
                                                and f'"step":{hole},' not in line)]
    path.write_text("".join(kept))


def node_lost_after_upload(run_dir: Path, *, from_bucket: bool, hole: int | None = None, final: bool = False,
                           sampler: str = "elastic") -> None:
    """Generation 1 at world 3: rank 2's node uploaded its records up to step 5 and was lost with its disk at step 9;
    the survivors resumed from memory at step 9 at world 2 (generation 2) and finished."""
    snap = simulate(run_dir, 1, 3, None, 9, 0)
    keep_steps_up_to(run_dir, 1, 2, 5, hole)
    if not final:
        simulate(run_dir, 2, 2, snap, 11, 9, end=True)
    if sampler != "elastic":
        for path in (run_dir / "audit").glob("*.jsonl"):
            path.write_text(path.read_text().replace('"sampler":"elastic"', f'"sampler":"{sampler}"'))
    if from_bucket:
        fetched_from_bucket(run_dir)


def fetched_from_bucket(run_dir: Path, cut_short: tuple[str, ...] = ()) -> None:
    """Mark ``run_dir`` as fetch_records leaves a directory it rebuilt from a bucket."""
    (run_dir / FROM_BUCKET).write_text(json.dumps({"url": "s3://bucket/run/records", "cut_short": list(cut_short)}))


def test_records_a_lost_node_had_not_uploaded_are_named_and_their_samples_follow_from_the_order(tmp_path: Path) -> None:
    node_lost_after_upload(tmp_path, from_bucket=True)
    report = check_audit(tmp_path)
    assert report.ok and report.finished and report.final_step == 20, report.render()
    assert report.records_lost == [{"generation": 1, "ranks": [2], "first_step": 6, "last_step": 9}]
    assert [e.seen for e in report.epochs] == [40, 40, 40, 40]
    assert "steps 6-9 were lost with their node" in report.render()


def test_on_a_shared_directory_nothing_is_lost_with_a_node_so_a_missing_rank_stays_a_violation(tmp_path: Path) -> None:
    node_lost_after_upload(tmp_path, from_bucket=False)
    report = check_audit(tmp_path)
    assert not report.ok and not report.records_lost
    assert any("step 6 (generation 1) has records from ranks [0, 1]" in v for v in report.violations)


def test_a_hole_in_a_trail_is_not_a_lost_upload(tmp_path: Path) -> None:
    node_lost_after_upload(tmp_path, from_bucket=True, hole=3)
    report = check_audit(tmp_path)
    assert not report.ok
    assert any(v.startswith("step 3 (generation 1)") for v in report.violations), report.render()


def test_the_last_generation_and_a_custom_sampler_lose_nothing_silently(tmp_path: Path) -> None:
    node_lost_after_upload(tmp_path / "last", from_bucket=True, final=True)
    assert not check_audit(tmp_path / "last").ok, "nothing ended the generation: its ranks owe their records"
    node_lost_after_upload(tmp_path / "custom", from_bucket=True, sampler="custom")
    assert not check_audit(tmp_path / "custom").ok, "a custom sampler's order cannot stand in for the records"


def test_samples_of_lost_records_still_count_towards_exactly_once(tmp_path: Path) -> None:
    snap = simulate(tmp_path, 1, 3, None, 9, 0)
    keep_steps_up_to(tmp_path, 1, 2, 5)
    # Resumed with the sampler one step behind the step count: step 9's window, rank 2's share included, again.
    simulate(tmp_path, 2, 2, dict(snap, consumed=snap["consumed"] - G), 11, 9, end=True)
    fetched_from_bucket(tmp_path)
    report = check_audit(tmp_path)
    assert not report.ok and len(report.epochs[1].duplicates) == G, report.render()


def test_a_rank_without_any_record_of_a_generation_is_not_a_lost_upload(tmp_path: Path) -> None:
    snap = simulate(tmp_path, 1, 3, None, 9, 0)
    (tmp_path / "audit" / "gen-000001-rank-00002.jsonl").unlink()  # never took part, or claimed a world it lacked
    simulate(tmp_path, 2, 2, snap, 11, 9, end=True)
    fetched_from_bucket(tmp_path)
    report = check_audit(tmp_path)
    assert not report.ok and not report.records_lost
    assert any(v.startswith("step 1 (generation 1)") for v in report.violations), report.render()


def test_a_node_lost_before_its_first_step_reached_the_bucket_left_its_header_which_is_enough(tmp_path: Path) -> None:
    node_lost_after_upload(tmp_path, from_bucket=True)
    keep_steps_up_to(tmp_path, 1, 2, 0)  # only the header: its attempt had just begun
    report = check_audit(tmp_path)
    assert report.ok, report.render()
    assert report.records_lost == [{"generation": 1, "ranks": [2], "first_step": 1, "last_step": 9}]


def test_a_file_the_bucket_has_a_gap_in_is_not_a_lost_upload(tmp_path: Path) -> None:
    node_lost_after_upload(tmp_path, from_bucket=False)
    fetched_from_bucket(tmp_path, cut_short=("audit/gen-000001-rank-00002.jsonl",))
    report = check_audit(tmp_path)
    assert not report.ok and not report.records_lost, report.render()


def test_lost_records_need_a_later_generation_that_stepped_and_the_elastic_order_of_their_own(tmp_path: Path) -> None:
    # A later generation that only wrote its headers did not end the one that lost records.
    snap = simulate(tmp_path / "headers", 1, 3, None, 9, 0)
    keep_steps_up_to(tmp_path / "headers", 1, 2, 5)
    simulate(tmp_path / "headers", 2, 2, snap, 0, 9)
    fetched_from_bucket(tmp_path / "headers")
    assert not check_audit(tmp_path / "headers").ok
    # A custom sampler in the generation that lost them, the elastic one later: its order cannot stand in.
    node_lost_after_upload(tmp_path / "mixed", from_bucket=True)
    first = tmp_path / "mixed" / "audit" / "gen-000001-rank-00000.jsonl"
    first.write_text(first.read_text().replace('"sampler":"elastic"', '"sampler":"custom"', 1))
    assert not check_audit(tmp_path / "mixed").ok


def test_a_malformed_record_is_a_violation_not_a_crash(tmp_path: Path) -> None:
    simulate(tmp_path, 1, 2, None, 4, 0, end=True)
    with open(tmp_path / "audit" / "gen-000001-rank-00001.jsonl", "a") as fh:
        fh.write('[1, 2]\n{"type": "step", "generation": 1, "step": "five"}\n')
    report = check_audit(tmp_path)
    assert not report.ok and any("2 record(s) of the audit trail are malformed" in v for v in report.violations)


def every_node_lost_after_step_3(run_dir: Path, resumed_position_shift: int = 0) -> None:
    """Generation 1 at world 2 trained to step 9 and snapshotted there; both nodes uploaded their records up to step 3
    and were lost with their disks; fresh nodes resumed from the bucket's snapshot of step 9 and finished."""
    snap = simulate(run_dir, 1, 2, None, 9, 0)
    for rank in (0, 1):
        keep_steps_up_to(run_dir, 1, rank, 3)
    simulate(run_dir, 2, 2, dict(snap, consumed=snap["consumed"] + resumed_position_shift), 11, 9, end=True)


def test_records_lost_with_every_node_are_records_lost_not_samples_lost_where_a_resume_proves_the_steps(
        tmp_path: Path) -> None:
    """Measured in a soak before: a model that counted every sample's sightings said each was trained exactly once,
    and the audit said VIOLATIONS FOUND (1,365 steps "have no records")."""
    every_node_lost_after_step_3(tmp_path)
    fetched_from_bucket(tmp_path)
    report = check_audit(tmp_path)
    assert report.ok and report.finished and report.final_step == 20, report.render()
    assert report.records_lost == [{"generation": 0, "ranks": [], "first_step": 4, "last_step": 9, "proved_by_step": 9}]
    assert [e.seen for e in report.epochs] == [40, 40, 40, 40]
    assert "every record of steps 4-9 was lost with the nodes that held them (records lost, not samples)" in \
        report.render()


def test_without_a_bucket_or_with_a_resume_that_does_not_fit_the_records_it_stays_a_violation(tmp_path: Path) -> None:
    every_node_lost_after_step_3(tmp_path / "shared")
    assert any(v == "step 4 has no records" for v in check_audit(tmp_path / "shared").violations)
    every_node_lost_after_step_3(tmp_path / "shifted", resumed_position_shift=-G)  # a position one step behind
    fetched_from_bucket(tmp_path / "shifted")
    report = check_audit(tmp_path / "shifted")
    assert not report.ok and any(e.duplicates for e in report.epochs), report.render()
