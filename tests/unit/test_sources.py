"""data.sources read lazily: shard files and streams as one index space, packed windows, the shard index, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from elastic_runner.config import ConfigError, load_config
from elastic_runner.config.sources import PackSpec, parse_sources
from elastic_runner.data.packing import IGNORE_INDEX, document_ids, load_tokenizer
from elastic_runner.data.readers import DataError
from elastic_runner.data.shards import open_source

BYTES = load_tokenizer("bytes")


def spec(**entry: Any) -> Any:
    return parse_sources([entry])[0]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> None:
    path.write_text("".join(json.dumps({field: t, "n": i}) + "\n" for i, t in enumerate(texts)))


def stream_of(texts: list[str]) -> np.ndarray:
    """The packed token stream of documents under the byte tokenizer: each document's bytes, then 256."""
    return np.concatenate([np.append(np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64), 256) for t in texts])


def test_a_jsonl_shards_windows_are_its_documents_packed_end_to_end(tmp_path: Path) -> None:
    texts = [f"document number {i} " * (i % 5 + 1) for i in range(40)]
    write_jsonl(tmp_path / "a.jsonl", texts[:25])
    write_jsonl(tmp_path / "b.jsonl", texts[25:])
    source = open_source(spec(path=str(tmp_path / "*.jsonl")), PackSpec(16), BYTES)
    streams = [stream_of(texts[:25]), stream_of(texts[25:])]
    windows = [(len(s) - 1) // 16 for s in streams]
    assert len(source) == sum(windows)
    for i in range(len(source)):
        shard = 0 if i < windows[0] else 1
        w = i - (0 if shard == 0 else windows[0])
        expected = torch.from_numpy(streams[shard][w * 16:w * 16 + 17])
        x, y = source[i]
        assert torch.equal(x, expected[:-1]) and torch.equal(y, expected[1:]), i


def test_the_index_is_built_once_beside_the_corpus_and_read_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "a.jsonl", ["hello world"] * 30)
    open_source(spec(path=str(tmp_path / "a.jsonl")), PackSpec(8), BYTES)
    built = sorted((tmp_path / ".elastic-runner-index").rglob("*.json"))
    assert len(built) == 1 and oct(built[0].stat().st_mode & 0o777) == "0o600"
    import elastic_runner.data.shards as shards

    monkeypatch.setattr(shards, "_build_index", lambda *a: pytest.fail("built again"))
    assert len(open_source(spec(path=str(tmp_path / "a.jsonl")), PackSpec(8), BYTES)) == (30 * 12 - 1) // 8


def test_a_tokens_source_reads_windows_of_its_files_without_an_index_of_documents(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint32"}))
    tokens = np.arange(1000, dtype=np.uint32) * 70_000  # beyond uint16: the meta.json's dtype is used
    tokens.tofile(tmp_path / "x.bin")
    np.save(tmp_path / "y.npy", np.arange(300, dtype=np.int32))
    source = open_source(spec(path=str(tmp_path / "x.bin")), PackSpec(10), None)
    assert len(source) == 99
    x, y = source[5]
    assert torch.equal(x, torch.from_numpy(tokens[50:60].astype(np.int64)))
    assert torch.equal(y, torch.from_numpy(tokens[51:61].astype(np.int64)))
    npy = open_source(spec(path=str(tmp_path / "y.npy")), PackSpec(10), None)
    assert len(npy) == 29 and npy[3][0].tolist() == list(range(30, 40))


def test_documents_masked_at_their_boundary_and_each_tokens_document(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ["ab", "cde", "f"])  # a b EOD c d e EOD f EOD
    source = open_source(spec(path=str(tmp_path / "a.jsonl")), PackSpec(8, mask="documents"), BYTES)
    x, y = source[0]
    assert x.tolist() == [97, 98, 256, 99, 100, 101, 256, 102]
    assert y.tolist() == [98, 256, IGNORE_INDEX, 100, 101, 256, IGNORE_INDEX, 256], "no loss across documents"
    assert document_ids(x, 256).tolist() == [0, 0, 0, 1, 1, 1, 1, 2]


class Listing:
    """A shard-addressable stream: the bring-your-own protocol."""

    opened: list[tuple[str, int]] = []

    def __init__(self, shards: int = 3, items: int = 20, text: bool = True) -> None:
        self.n, self.items, self.text = shards, items, text

    def shards(self) -> list[str]:
        return [f"part-{k}" for k in range(self.n)]

    def open(self, shard: str, offset: int) -> Iterator[Any]:
        Listing.opened.append((shard, offset))
        k = int(shard.split("-")[1])
        for i in range(offset, self.items):
            yield {"text": f"shard {k} item {i}"} if self.text else torch.tensor([k, i])


def stream_factory(**params: Any) -> Listing:
    return Listing(**params)


def test_a_users_stream_is_one_index_space_read_forward_without_reopening(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    items = open_source(spec(name=f"{__name__}:stream_factory", params={"text": False}), None, None)
    assert len(items) == 60 and items[25].tolist() == [1, 5]
    Listing.opened.clear()
    assert [items[i].tolist() for i in (26, 27, 28)] == [[1, 6], [1, 7], [1, 8]]
    assert Listing.opened == [], "reading on from where the last read ended opens nothing"
    packed = open_source(spec(name=f"{__name__}:stream_factory"), PackSpec(12), BYTES)
    texts = [f"shard 0 item {i}" for i in range(20)]
    assert packed[1][0].tolist() == stream_of(texts)[12:24].tolist()


@pytest.mark.parametrize(("entry", "key", "words"), [
    ({"path": "nowhere/*.jsonl"}, "data.sources[0].path", "matches no file"),
    ({"path": "corpus/*.txt"}, "data.sources[0].format", "does not say it"),
    ({"path": "corpus/*.bin", "weight": 0}, "data.sources[0].weight", "must be a positive number"),
    ({"path": "corpus/*.bin", "dtype": "int8"}, "data.sources[0].dtype", "got 'int8'"),
    ({"name": "not an import path"}, "data.sources[0].name", "not an import path"),
    ({"path": "a.jsonl", "name": "m:f"}, "data.sources[0]", "either path"),
])
def test_bad_sources_are_one_line_naming_the_key(entry: dict[str, Any], key: str, words: str,
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        cfg = load_config(None, ["train.max_steps=5", f"data.sources=[{json.dumps(entry)}]", "data.pack={block_size: 8}"])
        open_source(parse_sources(cfg.data.sources)[0], PackSpec(8), BYTES)
    assert refused.value.key == key and words in str(refused.value), refused.value
    assert "\n" not in str(refused.value)


def test_a_jsonl_line_without_its_text_names_the_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n\n{"body": "no text here"}\n')
    with pytest.raises(DataError) as refused:
        open_source(spec(path=str(tmp_path / "a.jsonl")), PackSpec(8), BYTES)
    assert refused.value.key == "data.sources[0].text_field"
    assert f"{tmp_path / 'a.jsonl'} line 3 has no 'text' text field" in str(refused.value)


def test_a_shard_changed_since_its_index_is_refused_by_name_at_its_first_read(tmp_path: Path) -> None:
    texts = ["some text that is long enough"] * 20
    write_jsonl(tmp_path / "a.jsonl", texts)
    source = open_source(spec(path=str(tmp_path / "a.jsonl")), PackSpec(8), BYTES)
    data = bytearray((tmp_path / "a.jsonl").read_bytes())
    data[10:14] = b"TEXT"  # the same size, other bytes
    (tmp_path / "a.jsonl").write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"the shard {tmp_path / 'a.jsonl'} changed since its index was built"):
        source[0]
    # A new run (the listing's size differs from the index's) builds the index again.
    write_jsonl(tmp_path / "a.jsonl", texts + ["one more"])
    assert len(open_source(spec(path=str(tmp_path / "a.jsonl")), PackSpec(8), BYTES)) > len(source)


def test_a_truncated_token_file_is_refused_by_name(tmp_path: Path) -> None:
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "x.bin")
    source = open_source(spec(path=str(tmp_path / "x.bin")), PackSpec(10), None)
    os.truncate(tmp_path / "x.bin", 400)
    with pytest.raises(DataError):
        source[40]


def test_a_parquet_shards_rows_are_its_documents(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"row {i} of the table" for i in range(50)]
    pq.write_table(pa.table({"body": texts}), tmp_path / "t.parquet", row_group_size=7)
    source = open_source(spec(path=str(tmp_path / "t.parquet"), text_field="body"), PackSpec(16), BYTES)
    stream = stream_of(texts)
    assert len(source) == (len(stream) - 1) // 16
    assert source[9][0].tolist() == stream[144:160].tolist()
    with pytest.raises(DataError, match="has no column 'text'"):
        open_source(spec(path=str(tmp_path / "t.parquet")), PackSpec(16), BYTES)


class Drifting(Listing):
    """A stream whose store changes under the run: after ``drift`` is set, shard 1's item 4 reads otherwise."""

    drift = False

    def open(self, shard: str, offset: int) -> Iterator[Any]:
        for i, item in enumerate(super().open(shard, offset), start=offset):
            yield {"text": item["text"].replace("item", "ITEM")} if Drifting.drift and (shard, i) == ("part-1", 4) \
                else item


def drifting() -> Drifting:
    return Drifting()


@pytest.mark.parametrize("pack", [None, PackSpec(12)])
def test_a_stream_that_gives_other_items_than_before_is_refused_where_it_is_read(
        pack: PackSpec | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(Drifting, "drift", False)
    source = open_source(spec(name=f"{__name__}:drifting"), pack, BYTES if pack else None)
    wanted = [i for i in range(len(source)) if source.locate(i)[0] == 1]
    for i in wanted:
        source[i]  # as it was: fine
    monkeypatch.setattr(Drifting, "drift", True)
    again = open_source(spec(name=f"{__name__}:drifting"), pack, BYTES if pack else None)  # the index as it was
    with pytest.raises(DataError, match="'part-1' gave at offset 4 an item other than the one its index read"):
        for i in wanted:
            again[i]


def test_an_index_without_what_this_source_reads_is_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    stream = spec(name=f"{__name__}:stream_factory")
    open_source(stream, None, None)
    arrays = sorted((tmp_path / "cache").rglob("*.npz"))[0]
    with np.load(arrays) as data:
        kept = {k: data[k] for k in data.files if k != "digest"}  # an index as an older version wrote it
    with open(arrays, "wb") as fh:
        np.savez(fh, **kept)
    source = open_source(stream, None, None)
    with np.load(arrays) as data:
        assert "digest" in data.files, "built again, with the items' fingerprints"
    assert source[0] == {"text": "shard 0 item 0"}
