"""Compiled models: ``model.compile`` and ``fit(compile=...)`` train through ``torch.compile``, snapshots hold the
plain model (they load compiled or not), and the compile cache is a directory of this user's only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from elastic_runner.config import ConfigError, load_config
from elastic_runner.training.compiling import (
    CACHE_VAR,
    unwrap_compiled,
    use_private_cache,
    without_compile_prefix,
)

from ..support import ROOT

BASE = ["train.epochs=1"]


def test_compile_is_a_boolean_and_may_change_between_attempts() -> None:
    assert load_config(None, BASE).model.compile is False
    assert load_config(None, [*BASE, "model.compile=true"]).model.compile is True
    with pytest.raises(ConfigError, match="model.compile: got 'fast', expected true or false"):
        load_config(None, [*BASE, "model.compile=fast"])
    plain, compiled = load_config(None, BASE), load_config(None, [*BASE, "model.compile=true"])
    assert plain.fingerprint() == compiled.fingerprint(), "a run resumes compiled or not"
    assert plain.fingerprint() != load_config(None, [*BASE, "model.name=mlp"]).fingerprint()


def test_a_compiled_wrapper_is_unwrapped_to_the_model_it_holds() -> None:
    model = nn.Linear(3, 2)
    compiled = torch.compile(model)
    assert unwrap_compiled(compiled) == (model, compiled)
    assert unwrap_compiled(model) == (model, None)
    assert set(compiled.state_dict()) == {"_orig_mod.weight", "_orig_mod.bias"}  # what a snapshot must not hold
    assert set(without_compile_prefix(compiled.state_dict())) == {"weight", "bias"}
    mixed = {"_orig_mod.weight": 1, "bias": 2}  # not a compiled model's state: left as it is
    assert without_compile_prefix(mixed) == mixed


def test_the_compile_cache_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    environ = {CACHE_VAR: default_cache_dir()}  # what importing torch._dynamo leaves in the variable
    path = use_private_cache(environ)
    assert path == tmp_path / f"elastic-runner-{os.getuid()}" / "compile-cache" and environ[CACHE_VAR] == str(path)
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o700, 0o700)
    assert use_private_cache({CACHE_VAR: str(tmp_path / "mine")}) == tmp_path / "mine", "the user's choice holds"

    os.chmod(path, 0o777)  # another user could plant compiled code that torch loads
    with pytest.raises(ConfigError, match=rf"model.compile: .*{path}.* other users may write into it.*{CACHE_VAR}"):
        use_private_cache({})
    os.chmod(path, 0o700)
    path.rmdir()
    path.symlink_to(tmp_path)  # a link planted in its place
    with pytest.raises(ConfigError, match="symbolic link"):
        use_private_cache({})


SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import elastic_runner

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(96, 8)
    data = TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
    given = torch.compile(model, dynamic=False) if sys.argv[2] == "script" else model
    kwargs = {"compile": True} if sys.argv[2] == "fit" else {}
    sys.exit(elastic_runner.fit(given, data, config={"run": {"dir": sys.argv[1]}, "batch": {"global_size": 32},
                                                     "train": {"epochs": 2}, "snapshot": {"every_steps": 3}},
                                **kwargs))
""")


@pytest.fixture(scope="module")
def temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TMPDIR of the scripts below: where their private compile cache is (shared by them: the second finds the
    first's kernels)."""
    return tmp_path_factory.mktemp("tmpdir")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["script", "fit"])
def test_a_compiled_scripts_snapshots_hold_the_plain_model(how: str, tmp_path: Path, temp_dir: Path) -> None:
    """``how``: the script compiles its model itself, or asks fit to."""
    from elastic_runner import load_model
    from elastic_runner.snapshot.cli import load_for_export

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK", "WORLD_SIZE", "MASTER_",
                                                                      "TORCHINDUCTOR"))}
    out = subprocess.run([sys.executable, str(script), str(run_dir), how], capture_output=True, text=True,
                         timeout=300, env=env | {"PYTHONPATH": str(ROOT), "TMPDIR": str(temp_dir)}, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    cache = temp_dir / f"elastic-runner-{os.getuid()}" / "compile-cache"
    assert any(cache.rglob("*.py")), f"the model was compiled, with its kernels in {cache}"
    _, _, state = load_for_export(str(run_dir), None)
    assert set(state["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}, "no '_orig_mod.' in a snapshot"
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    loaded = load_model(run_dir, plain)
    assert loaded is plain and not torch.equal(plain[0].weight, nn.Linear(8, 16).weight)
    again = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    load_model(run_dir, torch.compile(again))  # and into a compiled model: the same weights
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), again.state_dict().values()))
