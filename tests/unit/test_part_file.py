"""A sharded snapshot's part file (snapshot/part_file.py): the tensors' raw bytes behind a JSON header, read back
exactly and without an unpickler; anything malformed is refused with the file's name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from elastic_runner.snapshot import part_file
from elastic_runner.snapshot.part_file import PartFormatError


def _tensors() -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model/w": torch.randn(5, 7, generator=g),
        "model/half": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "optim/step": torch.tensor(11.0),
        "optim/empty": torch.empty(0, 4),
        "optim/transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "flags": torch.tensor([True, False, True]),
        "ids": torch.arange(9, dtype=torch.int64).view(3, 3),
        "f16": torch.randn(2, generator=g).half(),
    }
    offsets = {key: [2 * i] * t.dim() for i, (key, t) in enumerate(tensors.items())}
    return tensors, offsets


def _write(path: Path, rank: int = 3) -> tuple[str, int]:
    tensors, offsets = _tensors()
    with open(path, "wb") as fh:
        return part_file.write(fh, part_file.encode(rank, tensors, offsets))


def _same(read: dict, rank: int = 3) -> None:
    tensors, offsets = _tensors()
    assert read["rank"] == rank and list(read["tensors"]) == list(tensors)
    for key, tensor in tensors.items():
        got = read["tensors"][key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(got, tensor), key
    assert read["offsets"] == offsets


def test_a_part_reads_back_every_tensor_bit_for_bit_from_the_file_and_from_bytes(tmp_path: Path) -> None:
    path = tmp_path / "part-00003.bin"
    sha, size = _write(path)
    data = path.read_bytes()
    assert (sha, size) == (hashlib.sha256(data).hexdigest(), len(data)), "the record describes the bytes written"
    tensors, offsets = _tensors()
    assert data == part_file.to_bytes(3, tensors, offsets), "what is sent to another node is the file's bytes"
    _same(part_file.read(path, path.name))
    _same(part_file.read_bytes(data, path.name))
    _same(part_file.read_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy(), path.name))


def test_tensors_read_from_a_file_are_private_copies_on_write(tmp_path: Path) -> None:
    path = tmp_path / "part-00003.bin"
    _write(path)
    before = path.read_bytes()
    read = part_file.read(path, path.name)
    read["tensors"]["model/w"].add_(1.0)  # a loader may write into what it reads: never into the snapshot
    assert path.read_bytes() == before


def test_every_tensor_starts_on_a_64_byte_boundary(tmp_path: Path) -> None:
    path = tmp_path / "part-00003.bin"
    _write(path)
    data = path.read_bytes()
    length = int.from_bytes(data[8:16], "little")
    base = 16 + length + (-(16 + length) % 64)
    starts = [entry["start"] for entry in json.loads(data[16:16 + length])["tensors"]]
    assert all((base + s) % 64 == 0 for s in starts)


def test_a_part_of_the_earlier_torch_save_format_still_loads(tmp_path: Path) -> None:
    tensors, offsets = _tensors()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    path = tmp_path / "part-00003.pt"
    torch.save({"format": 1, "rank": 3, "tensors": tensors, "offsets": offsets}, path)
    read = part_file.read(path, path.name)
    assert read["rank"] == 3 and all(torch.equal(read["tensors"][k], v) for k, v in tensors.items())
    read = part_file.read_bytes(path.read_bytes(), path.name)
    assert all(torch.equal(read["tensors"][k], v) for k, v in tensors.items())


def _damaged(data: bytes, how: str) -> bytes:
    length = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + length])
    if how == "truncated":
        return data[: len(data) - 40]
    if how == "magic":
        return b"XXPART02" + data[8:]
    if how == "length":
        return data[:8] + (1 << 40).to_bytes(8, "little") + data[16:]
    if how == "json":
        return data[:16] + b"{" * length + data[16 + length:]
    entry = header["tensors"][0]
    if how == "dtype":
        entry["dtype"] = "object"
    elif how == "nbytes":
        entry["nbytes"] += 4
    elif how == "shape":
        entry["shape"] = [-5]
    elif how == "start":  # the last tensor (at 640, 4 bytes) moved past the end of the file, same digit count
        header["tensors"][-1]["start"] = 996
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw = raw + b" " * (length - len(raw))  # same length: the data stays where the header says
    assert len(raw) == length
    return data[:16] + raw + data[16 + length:]


@pytest.mark.parametrize("how", ["truncated", "magic", "length", "json", "dtype", "nbytes", "shape", "start"])
def test_a_malformed_part_is_refused_naming_the_file(tmp_path: Path, how: str) -> None:
    path = tmp_path / "part-00003.bin"
    _write(path)
    bad = _damaged(path.read_bytes(), how)
    if how == "magic":  # not ours: treated as the older format, which torch refuses safely
        with pytest.raises(Exception):
            part_file.read_bytes(bad, "part-00003.bin")
        return
    with pytest.raises(PartFormatError, match="part-00003.bin"):
        part_file.read_bytes(bad, "part-00003.bin")
    path.write_bytes(bad)
    with pytest.raises(PartFormatError, match="part-00003.bin"):
        part_file.read(path, path.name)


def test_a_tensor_of_a_dtype_the_format_does_not_know_is_refused_when_written() -> None:
    with pytest.raises(PartFormatError, match="shard q: dtype"):
        part_file.encode(0, {"q": torch.zeros(2, dtype=torch.float8_e4m3fn)}, {"q": [0]})
