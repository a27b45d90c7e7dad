"""Stage 1 of the data flow: raw documents per domain, as parquet, plus a manifest.

One parquet file per domain: (id, domain, source, text | messages). Written in row groups
as documents stream in, so memory does not grow with the corpus.
"""

from __future__ import annotations

import functools
import multiprocessing
import platform
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from ..config import CorporaParams, DomainParams
from ..errors import DataError
from .sources import Doc, describe, iter_docs

ROW_GROUP_BYTES = 64 << 20
STREAM_BUFFER = 4 << 20
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def schema(kind: str) -> pa.Schema:
    body = ("messages", MESSAGES) if kind == "sft" else ("text", pa.string())
    return pa.schema([("id", pa.string()), ("domain", pa.string()), ("source", pa.string()), body])


@dataclass
class DomainStats:
    docs: int = 0
    bytes: int = 0
    replaced_chars: int = 0
    docs_with_replacements: int = 0


class _Writer:
    """Buffers rows and flushes them as parquet row groups."""

    def __init__(self, path: Path, kind: str):
        self.kind = kind
        self.schema = schema(kind)
        self.writer = pq.ParquetWriter(path, self.schema, compression="zstd")
        self.rows: dict[str, list] = {n: [] for n in self.schema.names}
        self.buffered = 0

    def add(self, domain: str, source: str, doc: Doc) -> None:
        self.rows["id"].append(doc.id)
        self.rows["domain"].append(domain)
        self.rows["source"].append(source)
        self.rows[self.schema.names[-1]].append(doc.messages if self.kind == "sft" else doc.text)
        self.buffered += doc.nbytes
        if self.buffered >= ROW_GROUP_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.rows["id"]:
            self.writer.write_table(pa.table(self.rows, schema=self.schema))
            self.rows = {n: [] for n in self.schema.names}
            self.buffered = 0

    def close(self) -> None:
        self.flush()
        self.writer.close()


def _version(package: str) -> str | None:
    """The installed version; None where absent (`datasets` is imported by hub sources alone, and a
    GPU machine given only what the pipeline imports has none)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def build(cfg: CorporaParams, out: Path) -> dict:
    """Write <out>/<domain>.parquet for every domain; return the manifest."""
    manifest: dict = {
        "seed": cfg.seed,
        "invalid_utf8": cfg.invalid_utf8,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in ("datasets", "pyarrow", "tokenizers")},
        "domains": {},
    }
    one = functools.partial(_build_domain, out=out, seed=cfg.seed, invalid_utf8=cfg.invalid_utf8)
    workers = min(cfg.num_workers, len(cfg.domains))
    if workers > 1:  # spawned: a forked pyarrow or tokenizers thread pool can deadlock the child
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            entries = list(pool.map(one, cfg.domains, cfg.domains.values()))
    else:
        entries = list(map(one, cfg.domains, cfg.domains.values()))
    manifest["domains"] = dict(zip(cfg.domains, entries, strict=True))
    return manifest


def _build_domain(domain: str, spec: DomainParams, out: Path, seed: int, invalid_utf8: str) -> dict:
    """One domain's parquet file from its sources; its manifest entry."""
    stats = DomainStats()
    sources = []
    writer = _Writer(out / f"{domain}.parquet", spec.kind)
    bar = tqdm(desc=f"corpora {domain}", unit="doc", leave=False, mininterval=1.0)
    try:
        for source in spec.sources:
            name = describe(source)
            n0, b0 = stats.docs, stats.bytes
            for doc in iter_docs(source, spec.kind, seed, invalid_utf8):
                if not (doc.text or doc.messages):
                    continue
                writer.add(domain, name, doc)
                stats.docs += 1
                stats.bytes += doc.nbytes
                if doc.replaced:
                    stats.replaced_chars += doc.replaced
                    stats.docs_with_replacements += 1
                bar.update()
            if stats.docs == n0:
                raise DataError(f"corpora.domains.{domain}: source {name} yielded no documents")
            sources.append({**source.model_dump(exclude_defaults=True), "docs": stats.docs - n0,
                            "bytes": stats.bytes - b0})
    finally:
        bar.close()
        writer.close()
    return {"kind": spec.kind, "sources": sources, **vars(stats)}


def read_docs(path: Path, kind: str, batch_rows: int = 256,
              batch_bytes: int = 4 << 20) -> Iterator[tuple[list[str], list]]:
    """(ids, texts or message lists) from a domain's parquet file, in batches of at most
    `batch_rows` documents and, past the first document, `batch_bytes` of text, so a batch of
    long documents stays as small in memory as a batch of short ones."""
    body = "messages" if kind == "sft" else "text"
    ids: list[str] = []
    rows: list = []
    size = 0
    try:
        # A buffered stream reads column chunks a piece at a time instead of a row group whole.
        pf = pq.ParquetFile(path, buffer_size=STREAM_BUFFER, pre_buffer=False)
        for batch in pf.iter_batches(batch_size=min(batch_rows, 64), columns=["id", body]):
            for id_, row in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True):
                n = len(row) if kind != "sft" else sum(len(m["content"]) for m in row)
                if rows and (len(rows) >= batch_rows or size + n > batch_bytes):
                    yield ids, rows
                    ids, rows, size = [], [], 0
                ids.append(id_)
                rows.append(row)
                size += n
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: corrupt or unreadable corpora file: {e}") from None
    if rows:
        yield ids, rows


def domain_file(corpora_dir: Path, domain: str) -> Path:
    path = corpora_dir / f"{domain}.parquet"
    if not path.is_file():
        raise DataError(f"{path}: corpora output for domain {domain!r} not found (run the corpora stage)")
    return path
