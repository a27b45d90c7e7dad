"""Zero-copy reader of a packed split, for the training and evaluation stages."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import DataError
from ..io import read_json, sampled_digest
from .pack import SEG_DTYPE

if TYPE_CHECKING:
    from ..config import StageParams


@dataclass(frozen=True)
class Sample:
    input_ids: np.ndarray
    """seq_len token ids (a read-only view of the memory-mapped file)."""
    doc_lens: np.ndarray
    """Length of each document segment, in order; sums to seq_len."""
    domains: np.ndarray
    """Domain index of each segment (names in PackedDataset.domains)."""
    loss_mask: np.ndarray | None
    """1 on tokens that carry loss (SFT: assistant tokens); None for pretraining splits."""

    @property
    def cu_seqlens(self) -> np.ndarray:
        """Segment boundaries [0, l0, l0+l1, ..., seq_len], as variable-length attention takes them."""
        return np.concatenate(([0], np.cumsum(self.doc_lens))).astype(np.int32)

    @property
    def position_ids(self) -> np.ndarray:
        """Positions that restart at 0 at every document start."""
        starts = self.cu_seqlens[:-1]
        return (np.arange(self.input_ids.size) - np.repeat(starts, self.doc_lens)).astype(np.int64)


class PackedDataset:
    """data/packed/<split>/<part>: sequences by index, memory-mapped, nothing copied."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.folder = folder
        self.index = read_json(folder / "index.json", "packed split index")
        self.seq_len = int(self.index["seq_len"])
        self.domains: list[str] = self.index["domains"]
        self.kinds: dict[str, str] = self.index.get("kinds", {})
        """Domain -> corpora kind (long, short, whole, sft); empty for data packed before it was recorded."""
        n = int(self.index["sequences"])
        dtype = np.dtype(self.index["dtype"])
        self.tokens = self._map("tokens.bin", dtype, (n, self.seq_len))
        self.loss_mask = self._map("loss_mask.bin", np.uint8, (n, self.seq_len)) if self.index["loss_mask"] else None
        self.seq_segments = np.fromfile(self._file("seq_segments.bin", (n + 1) * 8), dtype=np.int64)
        self.segments = self._map("segments.bin", SEG_DTYPE, (int(self.seq_segments[-1]),))

    def _file(self, name: str, size: int) -> Path:
        path = self.folder / name
        if not path.is_file() or path.stat().st_size != size:
            raise DataError(f"{path}: missing or truncated (expected {size} bytes); rerun the pack stage")
        recorded = self.index.get("digests", {}).get(name)  # (data packed before digests were recorded: none)
        if recorded is not None and sampled_digest(path) != recorded:
            raise DataError(f"{path}: its contents are not what the pack stage wrote (sampled checksum); "
                            "rerun the pack stage (`dvc repro pack`)")
        return path

    def _map(self, name: str, dtype, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        path = self._file(name, size)
        if size == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r", shape=shape)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> Sample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} of {len(self)}")
        i %= len(self)
        segs = self.segments[self.seq_segments[i]:self.seq_segments[i + 1]]
        return Sample(
            input_ids=self.tokens[i],
            doc_lens=segs["length"].astype(np.int64),
            domains=segs["domain"].astype(np.int64),
            loss_mask=None if self.loss_mask is None else self.loss_mask[i],
        )

    def provenance(self, i: int) -> list[dict]:
        """Where each segment of sequence i came from: domain, document index in the token
        shards of that domain, first token, length (to report the documents of a bad batch)."""
        segs = self.segments[self.seq_segments[i]:self.seq_segments[i + 1]]
        return [
            {"domain": self.domains[s["domain"]], "doc": int(s["doc"]), "start": int(s["start"]),
             "length": int(s["length"])}
            for s in segs
        ]


class Curriculum:
    """Packed splits trained on in turn (a stage's `curriculum`, then its own split): the steps
    of each phase draw from its split alone, in seeded epochs of it, under the stage's one
    optimizer and learning-rate schedule. Indices run over the splits one after another."""

    def __init__(self, phases: list[tuple[PackedDataset, int]]):
        """(split, steps) in order; the last phase runs to the end, whatever its steps."""
        self.parts = [data for data, _ in phases]
        self.ends = [int(e) for e in np.cumsum([steps for _, steps in phases[:-1]])]
        self.offsets = [int(o) for o in np.cumsum([0] + [len(d) for d in self.parts])]

    def __len__(self) -> int:
        return self.offsets[-1]

    def phase(self, step: int) -> tuple[int, int]:
        """The phase a step belongs to and the step that phase starts at."""
        k = int(np.searchsorted(self.ends, step, side="right"))
        return k, (self.ends[k - 1] if k else 0)

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} of {len(self)}")
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return k, i - self.offsets[k]

    def __getitem__(self, i: int) -> Sample:
        k, j = self._locate(i)
        return self.parts[k][j]

    def provenance(self, i: int) -> list[dict]:
        k, j = self._locate(i)
        return [{"split": self.parts[k].folder.parent.name} | seg for seg in self.parts[k].provenance(j)]


def training_data(packed: Path, stage: StageParams) -> PackedDataset | Curriculum:
    """What a training stage trains on: its split's train part, after its curriculum's splits."""
    data = PackedDataset(packed / stage.split / "train")
    if not stage.curriculum:
        return data
    return Curriculum([*((PackedDataset(packed / p.split / "train"), p.steps) for p in stage.curriculum),
                       (data, stage.steps)])
