"""The safetensors files of a model folder: which file holds which tensor, and the tensors by name.

One layer under every reader of a folder (hybrid.checkpoint.reader, the quantizer's source in
hybrid.checkpoint.writer, GGUF export's hybrid.baselines.source, the planner's
hybrid.planner.model_bytes). Files are found through model.safetensors.index.json, else every
*.safetensors in the folder; each is opened once, lazily, as a safetensors mmap handle.
read_header parses one file's JSON header by hand (no handle) for callers that need only bytes.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid.errors import CheckpointError

INDEX = "model.safetensors.index.json"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1,
               "I8": 1, "I16": 2, "I32": 4, "I64": 8, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}
MAX_HEADER = 100 * 2**20


def index_map(folder: Path) -> dict[str, str] | None:
    """tensor name -> shard file from the folder's index (every shard checked present); None
    when the folder has no index."""
    index = folder / INDEX
    if not index.is_file():
        return None
    try:
        wm = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(wm.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
    for f in shards:
        if not (folder / f).is_file():
            raise CheckpointError(f"{folder / f}: shard listed in {INDEX} is missing")
    return dict(wm)


def shard_files(folder: Path) -> list[Path]:
    """The shards the index names, else every *.safetensors in the folder (possibly none)."""
    wm = index_map(folder)
    if wm is None:
        return sorted(folder.glob("*.safetensors"))
    return [folder / f for f in sorted(set(wm.values()))]


class SafetensorsFiles:
    """Tensors of a folder by name: where[name] = file name; handles opened lazily (mmap)."""

    def __init__(self, folder: str | Path, no_files_hint: str = ""):
        """no_files_hint: appended to the error when the folder holds no safetensors at all."""
        self.folder = Path(folder)
        self._handles: dict[str, object] = {}   # file name -> open safetensors handle
        self.where = self._locate(no_files_hint)

    def _locate(self, hint: str) -> dict[str, str]:
        wm = index_map(self.folder)
        if wm is not None:
            return wm
        files = shard_files(self.folder)
        if not files:
            raise CheckpointError(f"{self.folder}: no *.safetensors files{hint}")
        return {k: f.name for f in files for k in self._open(f.name).keys()}

    def _open(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            path = self.folder / fname
            try:
                h = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # SafetensorError, OSError: a corrupt or truncated file
                raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({exc})") from None
            self._handles[fname] = h
        return h

    def open_all(self) -> None:
        """Open every file now (a corrupt one is reported here rather than at its first read)."""
        for fname in sorted(set(self.where.values())):
            self._open(fname)

    def names(self) -> list[str]:
        return sorted(self.where)

    def has(self, name: str) -> bool:
        return name in self.where

    def path(self, name: str) -> Path:
        """The file that holds `name` (folder/? when none does)."""
        return self.folder / self.where.get(name, "?")

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape) from the header, no data read."""
        s = self._open(self.where[name]).get_slice(name)
        return s.get_dtype(), tuple(s.get_shape())

    def nbytes(self, name: str) -> int:
        """Stored bytes of `name` from its header (1 byte an element for dtypes not in DTYPE_BYTES)."""
        dtype, shape = self.meta(name)
        return math.prod(shape) * DTYPE_BYTES.get(dtype, 1)

    def tensor(self, name: str) -> torch.Tensor:
        """One stored tensor (mmap-backed where safetensors allows)."""
        fname = self.where.get(name)
        if fname is None:
            raise CheckpointError(f"{self.folder}: missing tensor {name!r}")
        try:
            return self._open(fname).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{self.folder / fname}: cannot read tensor {name!r} ({exc})") from None


def read_header(path: Path) -> dict[str, int]:
    """name -> stored bytes from one safetensors header; checks dtype x shape vs data_offsets.

    A safetensors file starts with an 8-byte little-endian header length and a JSON header
    {name: {dtype, shape, data_offsets}}; only that is read."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise CheckpointError(f"{path}: header length {n} is implausible (corrupt file?)")
        blob = fh.read(n)
    try:
        header = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: safetensors header is not valid JSON") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            nbytes = math.prod(shape) * DTYPE_BYTES[dt]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: bad header entry {json.dumps(info)[:80]}") from None
        if nbytes != end - begin:
            raise CheckpointError(f"{path}: tensor {name}: {dt} {shape} is {nbytes} bytes but "
                                  f"data_offsets span {end - begin}")
        out[name] = nbytes
    return out
