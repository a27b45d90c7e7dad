"""Token shards of one domain: flat id files, an optional loss-mask file, and a document table.

Layout of a domain directory:
  tokens-00000.bin ...  ids, uint16 or uint32, documents back to back (memory-mappable)
  mask-00000.bin ...    uint8 loss mask, same layout (SFT domains only)
  docs.bin              one DOC_DTYPE record per kept document
  index.json            dtype, shard sizes, counts

Reads go through positioned file reads, not long-lived memory maps, so a pass over a corpus
keeps resident memory flat however large the corpus is.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ..errors import ConfigError, DataError
from ..io import read_json, write_json

DOC_DTYPE = np.dtype([("shard", "<u4"), ("length", "<u4"), ("offset", "<u8"), ("key", "<u8")])


def doc_key(doc_id: str) -> int:
    """A stable 64-bit key per document id (decides the train/validation split)."""
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little")


def id_dtype(vocab_size: int, requested: str) -> np.dtype:
    if requested == "auto":
        return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    dtype = np.dtype(requested)
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ConfigError(
            f"tokenize.dtype: {requested} cannot hold ids of a vocabulary of {vocab_size} (use uint32 or auto)"
        )
    return dtype


class ShardWriter:
    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, with_mask: bool):
        self.folder = folder
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.with_mask = with_mask
        folder.mkdir(parents=True, exist_ok=True)
        self.docs = open(folder / "docs.bin", "wb")
        self.shards: list[int] = []
        self.n_docs = 0
        self._open_shard()

    def _open_shard(self) -> None:
        i = len(self.shards)
        self.shards.append(0)
        self.tokens = open(self.folder / f"tokens-{i:05d}.bin", "wb")
        self.mask = open(self.folder / f"mask-{i:05d}.bin", "wb") if self.with_mask else None

    def _close_shard(self) -> None:
        self.tokens.close()
        if self.mask:
            self.mask.close()

    def add(self, flat: np.ndarray, lengths: np.ndarray, keys: list[int], mask: np.ndarray | None = None) -> None:
        """Append a batch of whole documents: their ids back to back, and each one's length."""
        if not len(lengths):
            return
        if self.shards[-1] >= self.shard_tokens:
            self._close_shard()
            self._open_shard()
        if flat.size and int(flat.max()) > np.iinfo(self.dtype).max:
            raise DataError(f"token id {int(flat.max())} does not fit {self.dtype} (tokenize.dtype)")
        recs = np.empty(len(lengths), dtype=DOC_DTYPE)
        recs["shard"] = len(self.shards) - 1
        recs["length"] = lengths
        recs["offset"] = self.shards[-1] + np.cumsum(lengths) - lengths
        recs["key"] = np.asarray(keys, dtype=np.uint64)
        self.tokens.write(flat.astype(self.dtype, copy=False).tobytes())
        if self.mask is not None:
            self.mask.write(mask.astype(np.uint8, copy=False).tobytes())
        self.docs.write(recs.tobytes())
        self.shards[-1] += int(flat.size)
        self.n_docs += len(lengths)

    def close(self, **extra) -> dict:
        self._close_shard()
        self.docs.close()
        index = {
            "dtype": self.dtype.name,
            "shards": self.shards,
            "docs": self.n_docs,
            "tokens": sum(self.shards),
            "mask": self.with_mask,
            **extra,
        }
        write_json(self.folder / "index.json", index)
        return index


class ShardReader:
    """Random access to the documents of one domain."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.index = read_json(folder / "index.json", "token shard index")
        self.dtype = np.dtype(self.index["dtype"])
        self.has_mask = bool(self.index["mask"])
        docs_path = folder / "docs.bin"
        expect = self.index["docs"] * DOC_DTYPE.itemsize
        if not docs_path.is_file() or docs_path.stat().st_size != expect:
            raise DataError(f"{docs_path}: missing or truncated (expected {expect} bytes); rerun tokenize")
        self.docs = np.fromfile(docs_path, dtype=DOC_DTYPE)
        self._fds: dict[tuple[str, int], int] = {}
        for i, n in enumerate(self.index["shards"]):
            path = folder / f"tokens-{i:05d}.bin"
            if not path.is_file() or path.stat().st_size != n * self.dtype.itemsize:
                raise DataError(f"{path}: missing or truncated; rerun tokenize")

    def _fd(self, kind: str, shard: int) -> int:
        if (kind, shard) not in self._fds:
            self._fds[(kind, shard)] = os.open(self.folder / f"{kind}-{shard:05d}.bin", os.O_RDONLY)
        return self._fds[(kind, shard)]

    def _read(self, kind: str, dtype: np.dtype, doc: int, start: int, stop: int) -> np.ndarray:
        rec = self.docs[doc]
        n = stop - start
        offset = (int(rec["offset"]) + start) * dtype.itemsize
        buf = os.pread(self._fd(kind, int(rec["shard"])), n * dtype.itemsize, offset)
        if len(buf) != n * dtype.itemsize:
            raise DataError(f"{self.folder}: short read in {kind} shard {int(rec['shard'])}; rerun tokenize")
        return np.frombuffer(buf, dtype=dtype)

    def tokens(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = int(self.docs[doc]["length"]) if stop is None else stop
        return self._read("tokens", self.dtype, doc, start, stop)

    def mask(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = int(self.docs[doc]["length"]) if stop is None else stop
        return self._read("mask", np.dtype(np.uint8), doc, start, stop)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
