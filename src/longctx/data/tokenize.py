"""Stage 2: corpora parquet -> token shards per domain, with the long-data length filter.

Encoding runs in worker processes (each loads the saved tokenizer once) over batches of
documents, with a bounded number of batches in flight, so memory stays flat.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from ..config import TokenizeParams
from ..errors import DataError
from .corpora import domain_file, read_docs
from .shards import ShardWriter, doc_key, id_dtype
from .tokenizer import TextTokenizer

Encoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # flat ids, lengths, flat mask


def training_text(corpora_dir: Path, domains: dict[str, str], sample_bytes: int) -> Iterator[str]:
    """An even share of `sample_bytes` from each domain, in file order (deterministic)."""
    share = max(1, sample_bytes // len(domains))
    for domain, kind in domains.items():
        taken = 0
        for _, rows in read_docs(domain_file(corpora_dir, domain), kind):
            for row in rows:
                text = "\n".join(m["content"] for m in row) if kind == "sft" else row
                yield text[: share - taken]
                taken += len(text)
                if taken >= share:
                    break
            if taken >= share:
                break


# ---------------------------------------------------------------- encoding (runs in workers)

_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, add_bos: bool, add_eos: bool) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER.update(tok=TextTokenizer.load(tokenizer_dir), add_bos=add_bos, add_eos=add_eos)


def _encode(kind: str, rows: list) -> Encoded:
    tok: TextTokenizer = _WORKER["tok"]
    if kind == "sft":
        pairs = tok.encode_chats(rows)
        ids = [p[0] for p in pairs]
        mask = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0, np.uint8)
    else:
        ids = tok.encode_texts(rows, _WORKER["add_bos"], _WORKER["add_eos"])
        mask = None
    lengths = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
    flat = np.concatenate(ids) if ids else np.zeros(0, np.uint32)
    return flat, lengths, mask


class _Encoder:
    """Ordered map of `_encode` over batches, in a process pool or in this process."""

    def __init__(self, tokenizer_dir: Path, cfg: TokenizeParams):
        self.workers = cfg.num_workers
        args = (str(tokenizer_dir), cfg.add_bos, cfg.add_eos)
        if self.workers:
            self.pool = ProcessPoolExecutor(self.workers, mp.get_context("spawn"), _init_worker, args)
        else:
            _init_worker(*args)

    def map(self, kind: str, batches: Iterator) -> Iterator:
        """Yield (context, encoded) in input order; `batches` yields (context, rows)."""
        if not self.workers:
            for ctx, rows in batches:
                yield ctx, _encode(kind, rows)
            return
        pending: collections.deque[tuple[object, Future]] = collections.deque()
        for ctx, rows in batches:
            pending.append((ctx, self.pool.submit(_encode, kind, rows)))
            if len(pending) >= 2 * self.workers:
                ctx0, fut = pending.popleft()
                yield ctx0, fut.result()
        while pending:
            ctx0, fut = pending.popleft()
            yield ctx0, fut.result()

    def close(self) -> None:
        if self.workers:
            self.pool.shutdown(cancel_futures=True)


def tokenize_domains(
    cfg: TokenizeParams,
    domains: dict[str, str],
    corpora_dir: Path,
    out: Path,
    tok: TextTokenizer,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Encode every domain into <out>/<domain>/. Returns (per-domain report, all doc lengths
    before filtering, for statistics)."""
    dtype = id_dtype(tok.vocab_size, cfg.dtype)
    tok_dir = out / "tokenizer"
    encoder = _Encoder(tok_dir, cfg)
    report: dict[str, dict] = {}
    all_lengths: dict[str, np.ndarray] = {}
    try:
        for domain, kind in domains.items():
            path = domain_file(corpora_dir, domain)
            total = pq.ParquetFile(path).metadata.num_rows
            writer = ShardWriter(out / domain, dtype, cfg.shard_tokens, with_mask=kind == "sft")
            min_len = cfg.long_min_tokens if kind == "long" else 1
            lengths_seen: list[np.ndarray] = []
            kept_docs = kept_tokens = 0
            t0 = time.perf_counter()
            with tqdm(total=total, desc=f"tokenize {domain}", unit="doc", leave=False, mininterval=1.0) as bar:
                for ids_, (flat, lengths, mask) in encoder.map(kind, read_docs(path, kind, cfg.batch_size)):
                    lengths_seen.append(lengths)
                    keep = lengths >= min_len
                    if kind == "sft":
                        keep &= _has_loss(mask, lengths)
                    if not keep.all():
                        tok_keep = np.repeat(keep, lengths)
                        flat, lengths = flat[tok_keep], lengths[keep]
                        mask = mask[tok_keep] if mask is not None else None
                        ids_ = [i for i, k in zip(ids_, keep, strict=True) if k]
                    writer.add(flat, lengths, [doc_key(i) for i in ids_], mask)
                    kept_docs += len(lengths)
                    kept_tokens += int(lengths.sum())
                    bar.update(len(keep))
            seconds = time.perf_counter() - t0
            seen = np.concatenate(lengths_seen) if lengths_seen else np.zeros(0, np.int64)
            all_lengths[domain] = seen
            writer.close(domain=domain, kind=kind, min_tokens=min_len, fingerprint=tok.fingerprint)
            if kept_docs == 0:
                longest = int(seen.max()) if seen.size else 0
                hint = (f": none of its {seen.size} documents has >= {min_len} tokens (the longest has {longest}); "
                        "add longer documents or lower tokenize.long_min_tokens") if kind == "long" else ""
                raise DataError(f"{path}: domain {domain!r} kept no documents{hint}")
            report[domain] = {
                "kind": kind,
                "docs": int(seen.size),
                "tokens": int(seen.sum()),
                "kept_docs": kept_docs,
                "kept_tokens": kept_tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(int(seen.sum()) / max(seconds, 1e-9)),
            }
    finally:
        encoder.close()
    return report, all_lengths


def _has_loss(mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per conversation: does any token carry loss? (Empty assistant turns give none.)"""
    ends = np.cumsum(lengths)
    sums = np.add.reduceat(mask.astype(np.int64), np.r_[0, ends[:-1]]) if len(lengths) else np.zeros(0)
    return (sums > 0) & (lengths > 0)
