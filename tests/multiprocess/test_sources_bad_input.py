"""data.sources' bad input in real runs: one line naming the key, exit 2, nothing saved touched."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ..corpus import mixture_config, write_corpus
from ..support import run_bounded

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def train(config: Path, *overrides: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "elastic_runner.train", "--config", str(config)]
    for item in overrides:
        cmd += ["--set", item]
    result = run_bounded(cmd, timeout=180, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    return result.returncode, result.stdout


def one_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("elastic_runner:")]
    assert len(lines) == 1 and "Traceback" not in output, output[-3000:]
    return lines[0]


def test_a_shard_changed_since_the_run_started_is_refused_by_name_on_resume(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    config = mixture_config(tmp_path / "mix.yaml", [{"path": str(corpus / "tok" / "*.bin"), "weight": 0.5},
                                                    {"path": str(corpus / "web" / "*.jsonl"), "weight": 0.5,
                                                     "label": "web"}], train={"max_steps": 30})
    code, output = train(config)
    assert code == 0, output[-3000:]
    snapshots = sorted(p.name for p in (tmp_path / "run" / "snapshots").glob("step-*"))
    with open(corpus / "web" / "part-1.jsonl", "a") as fh:  # the corpus grew under the run
        fh.write(json.dumps({"text": "one more document"}) + "\n")
    code, output = train(config, "train.max_steps=60")
    assert code == 2, output[-3000:]
    line = one_line(output)
    assert "source 'web'" in line and "part-1.jsonl" in line and "changed since the run started" in line, line
    assert sorted(p.name for p in (tmp_path / "run" / "snapshots").glob("step-*")) == snapshots, "nothing touched"


@pytest.mark.parametrize(("damage", "key"), [("truncated token file", "data.sources[0].path"),
                                             ("unreadable shard", "data.sources[1].path")])
def test_a_damaged_shard_stops_the_run_with_one_line_naming_its_source(damage: str, key: str,
                                                                      tmp_path: Path) -> None:
    if damage == "unreadable shard" and os.geteuid() == 0:
        pytest.skip("root reads every file: a shard cannot be made unreadable")
    corpus = write_corpus(tmp_path / "corpus")
    config = mixture_config(tmp_path / "mix.yaml", [{"path": str(corpus / "tok" / "*.bin"), "weight": 0.5},
                                                    {"path": str(corpus / "web" / "*.jsonl"), "weight": 0.5}],
                            train={"max_steps": 400})
    code, output = train(config, "train.max_steps=1")  # the index is built, one step trained
    assert code == 0, output[-3000:]
    if damage == "truncated token file":
        shard = corpus / "tok" / "shard-2.bin"
        data = shard.read_bytes()
        shard.write_bytes(data[:len(data) // 2] + bytes(len(data) - len(data) // 2))  # same size, other bytes
    else:
        os.chmod(corpus / "web" / "part-0.jsonl", 0)
    code, output = train(config, f"run.dir={tmp_path / 'again'}")
    assert code == 2, output[-3000:]
    line = one_line(output)
    assert f"{key}:" in line, line
