"""data.sources in a bucket of a real S3 server (SeaweedFS): the shards are listed and read by range, never
downloaded whole, and the run is the run on the same files on a local disk, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runner.observe.audit import check_audit
from elastic_runner.testing.s3_server import S3Server

from ..corpus import mixture_config, write_corpus
from ..support import end_events, torchrun_standalone

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_sources_in_a_bucket_train_as_the_same_files_on_disk(s3_server: S3Server, s3_prefix: str,
                                                             tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    fs = s3_server.filesystem()
    bucket_corpus = f"{s3_prefix}/corpus"
    fs.put(str(corpus) + "/", bucket_corpus.removeprefix("s3://"), recursive=True)  # type: ignore[attr-defined]

    def sources(root: str) -> list[dict[str, object]]:
        return [{"path": f"{root}/tok/*.bin", "format": "tokens", "weight": 0.6, "label": "tok"},
                {"path": f"{root}/web/*.jsonl", "weight": 0.4, "label": "web"}]

    env = s3_server.env() | {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # each run's index: this node's cache
    runs = {}
    for name, root in (("bucket", bucket_corpus), ("disk", str(corpus))):
        config = mixture_config(tmp_path / f"{name}.yaml", sources(root), train={"max_steps": 80})
        result = torchrun_standalone(config, tmp_path / name, nproc=2, timeout=240, extra_env=env)
        assert result.returncode == 0, result.stdout[-4000:]
        report = check_audit(tmp_path / name)
        assert report.ok and report.finished and [s.label for s in report.sources] == ["tok", "web"], report.render()
        runs[name] = {e["params_sha256"] for e in end_events(tmp_path / name)}
    assert runs["bucket"] == runs["disk"], "the bucket's files are the disk's: the same model"
    indexed = list((tmp_path / "cache" / "elastic-runner" / "index").rglob("*.json"))
    assert len(indexed) == 5, f"one index record for each of the bucket's 5 shards: {indexed}"
