"""Read TensorFlow checkpoints without TensorFlow: the TensorBundle format that ``tf.train.Saver`` writes.
Design notes: docs/internals.md#txlinteroptf_checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from txl.model.pretrained import CheckpointError

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_BYTES = 48
# DataType enum values (tensorflow/core/framework/types.proto) -> numpy dtype (little-endian)
DTYPES = {1: "<f4", 2: "<f8", 3: "<i4", 4: "u1", 5: "<i2", 6: "i1", 9: "<i8", 10: "?", 17: "<u2", 19: "<f2"}
DT_BFLOAT16 = 14


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints as int, length-delimited and fixed fields as bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + n], pos + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, pos = buf[pos : pos + n], pos + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def _snappy(data: bytes) -> bytes:
    """Decompress a raw snappy block (the format's own description: a length, then literals and back-copies)."""
    n, pos = _varint(data, 0)
    out = bytearray()
    while pos < len(data):
        tag = data[pos]
        pos += 1
        kind = tag & 3
        if kind == 0:  # literal
            length = tag >> 2
            if length >= 60:
                extra = length - 59
                length = int.from_bytes(data[pos : pos + extra], "little")
                pos += extra
            length += 1
            out += data[pos : pos + length]
            pos += length
            continue
        if kind == 1:
            length, offset = 4 + ((tag >> 2) & 7), ((tag >> 5) << 8) | data[pos]
            pos += 1
        else:
            width = 2 if kind == 2 else 4
            length, offset = (tag >> 2) + 1, int.from_bytes(data[pos : pos + width], "little")
            pos += width
        if not 0 < offset <= len(out):
            raise ValueError("bad snappy back-reference")
        for _ in range(length):  # (copies may overlap what they write)
            out.append(out[-offset])
    if len(out) != n:
        raise ValueError("snappy length mismatch")
    return bytes(out)


def _block(data: bytes, handle: bytes) -> bytes:
    offset, pos = _varint(handle, 0)
    size, _ = _varint(handle, pos)
    block, kind = data[offset : offset + size], data[offset + size : offset + size + 1]
    if len(block) != size or not kind:
        raise ValueError("a table block runs past the end of the file")
    if kind == b"\x00":
        return block
    if kind == b"\x01":
        return _snappy(block)
    raise ValueError(f"unsupported table block compression {kind[0]}")


def _entries(block: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The (key, value) pairs of a table block (keys prefix-compressed, a restart array at the end)."""
    n_restarts = int.from_bytes(block[-4:], "little")
    end = len(block) - 4 - 4 * n_restarts
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        own, pos = _varint(block, pos)
        size, pos = _varint(block, pos)
        key = key[:shared] + block[pos : pos + own]
        pos += own
        yield key, block[pos : pos + size]
        pos += size


def _table(path: Path) -> dict[bytes, bytes]:
    data = path.read_bytes()
    if len(data) < FOOTER_BYTES or int.from_bytes(data[-8:], "little") != TABLE_MAGIC:
        raise ValueError("not a TensorFlow checkpoint index (no table magic number at its end)")
    footer = data[-FOOTER_BYTES:]
    _, pos = _varint(footer, 0)  # metaindex handle (offset, size): unused
    _, pos = _varint(footer, pos)
    index = _block(data, footer[pos:])
    return {k: v for _, handle in _entries(index) for k, v in _entries(_block(data, handle))}


def _shape(buf: bytes) -> list[int]:
    dims = []
    for number, value in _fields(buf):
        if number == 2:  # Dim { int64 size = 1; string name = 2; }
            dims.append(next((int(v) for n, v in _fields(value) if n == 1), 0))
    return dims


def checkpoint_prefix(path: str | Path) -> Path:
    """The prefix of a checkpoint: given as is, as its ``.index`` file, or as a folder (its ``checkpoint`` file's
    ``model_checkpoint_path``, else its one ``*.index``)."""
    p = Path(path)
    if p.name.endswith(".index"):
        return p.with_name(p.name.removesuffix(".index"))
    if p.is_dir():
        state = p / "checkpoint"
        if state.is_file():
            for line in state.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.startswith("model_checkpoint_path:"):
                    named = p / line.split(":", 1)[1].strip().strip('"')  # (an absolute path stays as it is)
                    here = p / named.name  # a checkpoint copied from another machine names a path of that machine
                    return named if named.with_name(named.name + ".index").is_file() else here
        found = sorted(p.glob("*.index"))
        if len(found) == 1:
            return found[0].with_name(found[0].name.removesuffix(".index"))
        what = "no" if not found else f"{len(found)}"
        raise CheckpointError(f"{p}: {what} TensorFlow checkpoint (*.index) here; give the checkpoint's prefix")
    return p


def read_tf_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every variable of a TensorFlow checkpoint (``PREFIX``, ``PREFIX.index`` or its folder) as a CPU tensor."""
    prefix = checkpoint_prefix(path)
    index = prefix.with_name(prefix.name + ".index")
    if not index.is_file():
        raise CheckpointError(f"{index}: not found (a TensorFlow checkpoint is PREFIX.index + PREFIX.data-*)")
    try:
        table = _table(index)
        header = dict(_fields(table.get(b"", b"")))
        if header.get(2, 0) != 0:
            raise ValueError("a big-endian checkpoint")
        n_shards = int(header.get(1, 1))
        shards: dict[int, np.ndarray] = {}  # (memory-mapped: a published model's shard is gigabytes)
        out: dict[str, torch.Tensor] = {}
        for key, value in table.items():
            if not key:
                continue
            name = key.decode("utf-8")
            entry: dict[int, int | bytes] = {}
            for number, v in _fields(value):
                entry.setdefault(number, v)
            if 7 in entry:
                raise ValueError(f"{name} is a partitioned variable (saved in slices)")
            dtype = int(entry.get(1, 0))
            if dtype not in DTYPES and dtype != DT_BFLOAT16:
                continue  # strings and other non-numeric state (never model weights)
            shape = _shape(entry.get(2, b""))
            shard, offset, size = int(entry.get(3, 0)), int(entry.get(4, 0)), int(entry.get(5, 0))
            if shard not in shards:
                data_file = prefix.with_name(f"{prefix.name}.data-{shard:05d}-of-{n_shards:05d}")
                if not data_file.is_file():
                    raise CheckpointError(f"{data_file}: missing data shard of {index}")
                shards[shard] = np.memmap(data_file, dtype=np.uint8, mode="r") if data_file.stat().st_size else b""
            raw = shards[shard][offset : offset + size]
            if len(raw) != size:
                raise ValueError(f"{name}: its bytes run past the end of data shard {shard}")
            if dtype == DT_BFLOAT16:
                array = np.frombuffer(raw, dtype="<u2").astype(np.int32) << 16
                tensor = torch.from_numpy(array.astype("<i4").view("<f4").copy())
            else:
                tensor = torch.from_numpy(np.frombuffer(raw, dtype=DTYPES[dtype]).copy())
            out[name] = tensor.reshape(shape)
        return out
    except CheckpointError:
        raise
    except (ValueError, IndexError, UnicodeDecodeError, RuntimeError) as e:
        raise CheckpointError(f"{index}: not a readable TensorFlow checkpoint ({e})") from None
