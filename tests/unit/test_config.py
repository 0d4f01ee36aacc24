"""Config: file < --set < validation; every error is one line naming source and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runner.config import (
    Config,
    ConfigError,
    load_config,
    parse_override,
    reference_markdown,
    write_effective_config,
)


def test_quickstart_loads_with_the_documented_names(quickstart: Path) -> None:
    cfg = load_config(quickstart)
    assert cfg.run.dir == "runs/quickstart"
    assert cfg.batch.global_size == 32
    assert cfg.snapshot.every_steps == 50
    assert cfg.audit.samples is True
    assert cfg.train.epochs == 6
    assert cfg.metrics.port == 0


def test_cli_overrides_beat_the_file_and_convert_types(quickstart: Path) -> None:
    cfg = load_config(quickstart, ["optim.lr=0.05", "train.max_steps=7", "audit.samples=false", "run.dir=/tmp/x"])
    assert cfg.optim.lr == 0.05 and isinstance(cfg.optim.lr, float)
    assert cfg.train.max_steps == 7
    assert cfg.audit.samples is False
    assert cfg.run.dir == "/tmp/x"


def test_integer_given_for_a_float_is_accepted(quickstart: Path) -> None:
    assert load_config(quickstart, ["optim.lr=1"]).optim.lr == 1.0


def test_overrides_reach_into_free_form_params(quickstart: Path) -> None:
    cfg = load_config(quickstart, ["model.params.hidden=32", "data.params.x.y=1", "data.name=mypkg.data:build"])
    assert cfg.model.params == {"channels": 16, "hidden": 32}
    assert cfg.data.params == {"x": {"y": 1}}


def test_defaults_apply_for_keys_the_file_leaves_out(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 3\n")
    cfg = load_config(path)
    assert cfg == Config(train=cfg.train) and cfg.train.max_steps == 3


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        ("batch.global_size=-4", "batch.global_size", "positive"),
        ("batch.micro_size=0", "batch.micro_size", "positive"),
        ("optim.lr=0", "optim.lr", "positive"),
        ("optim.lr=fast", "optim.lr", "expected a number"),
        ("train.max_steps=1.5", "train.max_steps", "integer"),
        ("train.epochs=-1", "train.epochs", "positive"),
        ("snapshot.keep_last=0", "snapshot.keep_last", ">= 1"),
        ("snapshot.every_steps=-1", "snapshot.every_steps", ">= 0"),
        ("data.name=mnist", "data.name", "unknown dataset"),
        ("data.name=image_folder", "data.path", "required"),
        ("data.test_fraction=1.5", "data.test_fraction", "between 0 and 1"),
        ("model.name=resnet", "model.name", "unknown model"),
        ("optim.name=lion", "optim.name", "unknown optimizer"),
        ("schedule.name=linear", "schedule.name", "unknown schedule"),
        ("metrics.port=70000", "metrics.port", "0..65535"),
        ("logging.level=LOUD", "logging.level", "one of"),
        ("dist.backend=mpi", "dist.backend", "one of"),
        ("audit.samples=maybe", "audit.samples", "true or false"),
        ("train.precision=fp8", "train.precision", "one of"),
        ("batch.scale_lr=linear", "batch.scale_lr", "per_rank_size"),
        ("recovery.straggler_ratio=1", "recovery.straggler_ratio", "must be a number > 1"),
        ("recovery.straggler_window_seconds=0", "recovery.straggler_window_seconds", "must be > 0"),
        ("recovery.health_check=maybe", "recovery.health_check", "true or false"),
        ("train.skip_steps=[12, 0]", "train.skip_steps", "each must be a step number >= 1"),
        ("train.skip_steps=12", "train.skip_steps", "expected a list"),
        ("train.on_nonfinite=retry", "train.on_nonfinite", "one of"),
    ],
)
def test_each_invalid_value_names_its_key_and_a_fix(quickstart: Path, override: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(quickstart, [override])
    message = str(info.value)
    assert key in message and words in message
    assert "\n" not in message
    assert message.startswith("--set ") or message.startswith(str(quickstart)) or message.startswith("defaults")
    # every message ends with an instruction
    assert info.value.fix and info.value.fix[0].isupper()


def test_missing_dataset_directory_is_named(quickstart: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.path: directory '.*nope' does not exist"):
        load_config(quickstart, ["data.name=cifar10", f"data.path={tmp_path / 'nope'}"])


def test_unknown_key_in_the_file_names_file_key_and_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_steps: 5\nbatch:\n  global_szie: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(str(path)) and "batch.global_szie" in message and "global_size" in message


def test_unknown_section_gets_a_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("optimizer:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="Did you mean 'optim'"):
        load_config(path)


def test_yaml_syntax_error_reports_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_steps: 5\n  epochs: [1\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d+"):
        load_config(path)


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")


def test_both_batch_policies_at_once_is_refused(quickstart: Path) -> None:
    with pytest.raises(ConfigError, match="exactly one of batch.global_size and batch.per_rank_size"):
        load_config(quickstart, ["batch.per_rank_size=8"])
    cfg = load_config(quickstart, ["batch.per_rank_size=8", "batch.global_size=null"])
    assert cfg.batch.per_rank_size == 8 and cfg.batch.global_size is None


def test_a_run_length_is_required(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  seed: 1\n")
    with pytest.raises(ConfigError, match="neither train.max_steps nor train.epochs"):
        load_config(path)


def test_override_without_equals_sign_is_explained() -> None:
    with pytest.raises(ConfigError, match="no '='"):
        parse_override("optim.lr")


def test_effective_config_is_written_and_reloads_identically(quickstart: Path, tmp_path: Path) -> None:
    cfg = load_config(quickstart, ["optim.lr=0.02"])
    path = write_effective_config(cfg, str(tmp_path))
    assert load_config(path) == cfg


def test_fingerprint_ignores_run_length_but_not_the_model(quickstart: Path) -> None:
    base = load_config(quickstart).fingerprint()
    assert load_config(quickstart, ["train.max_steps=10", "snapshot.every_steps=5"]).fingerprint() == base
    changed = load_config(quickstart, ["model.params.hidden=8"]).fingerprint()
    assert changed["model"] != base["model"] and changed["data"] == base["data"]


def test_reference_documents_every_key() -> None:
    text = reference_markdown()
    for key in ("run.dir", "run.seed", "train.max_steps", "train.epochs", "batch.global_size",
                "snapshot.every_steps", "audit.samples", "metrics.port"):
        assert f"`{key}`" in text


def test_yaml_1_2_floats_and_on_off_words_are_understood(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("optim: {lr: 3e-4, weight_decay: 1e-2}\nschedule: {gamma: 1.5E+3}\n"
                    "logging: {progress_bar: off}\ntrain: {epochs: 1}\n")
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.schedule.gamma) == (3e-4, 1e-2, 1500.0)
    assert cfg.logging.progress_bar == "off"
    assert load_config(path, ["logging.progress_bar=on", "optim.lr=5e-5"]).logging.progress_bar == "on"
    assert load_config(path, ["optim.lr=5e-5"]).optim.lr == 5e-5
    assert load_config({"optim": {"lr": "3e-4"}, "train": {"epochs": 1}}).optim.lr == 3e-4  # a mapping built in Python


def test_memory_settings_do_not_change_the_fingerprint(quickstart: Path) -> None:
    base = load_config(quickstart).fingerprint()
    assert load_config(quickstart, ["batch.micro_size=4", "batch.uneven=refuse"]).fingerprint() == base


def test_in_process_recovery_is_on_for_a_replicated_model_and_off_for_a_sharded_one_unless_set(quickstart: Path) -> None:
    assert load_config(quickstart).recovery.in_process == "auto"
    assert load_config(quickstart).in_process
    assert not load_config(quickstart, ["parallel.strategy=fsdp"]).in_process
    assert load_config(quickstart, ["parallel.strategy=fsdp", "recovery.in_process=true"]).in_process
    assert not load_config(quickstart, ["recovery.in_process=false"]).in_process
    with pytest.raises(ConfigError, match=r"recovery\.in_process: got 'sometimes', expected"):
        load_config(quickstart, ["recovery.in_process=sometimes"])


def test_reconfiguring_the_process_group_of_a_sharded_model_is_refused_with_the_alternatives(quickstart: Path) -> None:
    with pytest.raises(ConfigError, match=r"recovery\.regroup: reconfigure is for replicated models, and "
                                          r"parallel\.strategy is fsdp .* Use auto or recreate"):
        load_config(quickstart, ["recovery.regroup=reconfigure", "parallel.strategy=fsdp"])
    assert load_config(quickstart, ["parallel.strategy=fsdp"]).recovery.regroup == "auto"
    with pytest.raises(ConfigError, match="recovery.regroup"):
        load_config(quickstart, ["recovery.regroup=rebuild"])


def test_an_error_from_a_files_values_names_the_file_not_the_defaults(tmp_path: Path) -> None:
    """data.path is missing *because* the file chose data.name: tokens; train's length is missing from the file."""
    bad = tmp_path / "job.yaml"
    bad.write_text("data: {name: tokens}\ntrain: {epochs: 1}\n")
    with pytest.raises(ConfigError) as missing_path:
        load_config(bad)
    assert str(missing_path.value).startswith(f"{bad}: data.path:"), missing_path.value
    bad.write_text("batch: {global_size: 8}\n")
    with pytest.raises(ConfigError) as no_length:
        load_config(bad)
    assert str(no_length.value).startswith(f"{bad}: train:"), no_length.value
    with pytest.raises(ConfigError) as from_set:
        load_config(None, ["data.name=tokens", "train.epochs=1"])
    assert str(from_set.value).startswith("--set data.name=tokens: data.path:"), from_set.value
