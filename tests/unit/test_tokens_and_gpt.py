"""Token files for language models, and the built-in GPT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from elastic_runner.config import ConfigError, load_config
from elastic_runner.data.datasets import build_datasets
from elastic_runner.data.tokens import prepare_once, prepare_text, read_meta, token_datasets
from elastic_runner.workload.gpt import GPT

from ..support import ROOT, rank_context


def test_prepare_text_writes_token_files_that_read_back_as_windows(tmp_path: Path) -> None:
    text = tmp_path / "in.txt"
    text.write_text("hello world, " * 200, encoding="utf-8")
    meta = prepare_text(text, tmp_path / "tok", val_fraction=0.1)
    assert meta["vocab_size"] == len(set("hello world, ")) and read_meta(tmp_path / "tok")["dtype"] == "uint16"
    train, val, _ = token_datasets(tmp_path / "tok", block_size=16)
    x, y = train[3]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    assert torch.equal(train[4][0][0], y[-1]), "windows are contiguous: exactly once per epoch"
    assert len(train) == (meta["train_tokens"] - 1) // 16 and len(val) > 0


def test_bad_token_inputs_name_the_file_and_the_fix(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf".encode() + b"\xe9 au lait")
    with pytest.raises(ConfigError, match=r"latin1.txt: is not UTF-8: byte 3 \(0xe9\) cannot be decoded"):
        prepare_text(bad, tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"has no meta.json.*prepare-text"):
        read_meta(empty)
    (empty / "meta.json").write_text(json.dumps({"vocab_size": 70000, "dtype": "uint16"}))
    with pytest.raises(ConfigError, match=r"vocab_size 70000 does not fit dtype uint16"):
        read_meta(empty)


def test_gpt_checks_its_shape_and_predicts_every_position() -> None:
    with pytest.raises(ConfigError, match=r"model.params.n_embd: 100 is not divisible by model.params.n_head=3"):
        GPT(vocab_size=10, n_embd=100, n_head=3)
    model = GPT(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16)
    assert model(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 10)
    assert model.head.weight is model.wte.weight, "weight tying"


def test_bf16_autocast_runs_the_gpt_on_the_cpu() -> None:
    model = GPT(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def _prepare_in_a_process(text: str, out: str, results: "mp.Queue[bool]") -> None:
    from elastic_runner.data.tokens import prepare_once as prepare

    results.put(prepare(text, out))


def test_a_missing_token_directory_names_the_command_that_builds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "tiny-lm.yaml", ["data.params={block_size: 64}"])
    assert err.value.key == "data.path"
    assert "elastic-runner data prepare-text TEXT.txt --out data/shakespeare-char" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "tiny-lm.yaml", ["data.params={text: nowhere.txt}"])
    assert err.value.key == "data.params.text" and "nowhere.txt" in str(err.value)


def test_the_shipped_corpus_is_prepared_on_first_use_once_whatever_the_number_of_workers(tmp_path: Path) -> None:
    text = ROOT / "examples" / "data" / "shakespeare.txt"
    out = tmp_path / "data" / "shakespeare-char"
    ctx = rank_context()
    results: mp.Queue[bool] = ctx.Queue()
    workers = [ctx.Process(target=_prepare_in_a_process, args=(str(text), str(out), results)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    wrote = sorted(results.get(timeout=5) for _ in workers)
    assert sum(wrote) >= 1 and all(w.exitcode == 0 for w in workers)
    assert sorted(p.name for p in out.parent.iterdir()) == ["shakespeare-char"], "no staging directory is left"
    reference = tmp_path / "by-hand"
    assert prepare_text(text, reference) == read_meta(out)
    for name in ("train.bin", "val.bin"):
        assert (out / name).read_bytes() == (reference / name).read_bytes()
    assert prepare_once(text, out) is False, "a prepared directory is used as it is"
    cfg = load_config(ROOT / "configs" / "tiny-lm.yaml", [f"data.path={out}", f"data.params.text={text}"])
    assert build_datasets(cfg.data).vocab_size == read_meta(out)["vocab_size"]
