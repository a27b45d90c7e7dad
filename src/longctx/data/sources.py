"""Document streams: local files, `datasets` hub ids (streamed), and the builtin corpus.

Every stream yields `Doc`s lazily, so a source of any size is read in bounded memory, and
stops at the source's document or byte budget.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import SourceParams
from ..errors import DataError
from . import builtin, synthetic

LOCAL_TEXT = {".txt", ".md", ".rst"}
LOCAL_SUFFIXES = LOCAL_TEXT | {".jsonl", ".parquet"}
Messages = list[dict[str, str]]


@dataclass
class Doc:
    id: str
    text: str | None = None
    messages: Messages | None = None
    replaced: int = 0
    """Characters that were not valid UTF-8 and became U+FFFD."""

    @property
    def nbytes(self) -> int:
        if self.text is not None:
            return len(self.text.encode("utf-8"))
        return sum(len(m["content"].encode("utf-8")) for m in self.messages or [])


def describe(spec: SourceParams) -> str:
    if spec.path is not None:
        return f"path {spec.path}"
    if spec.hub is not None:
        return f"hub {spec.hub}" + (f" ({spec.name})" if spec.name else "")
    if spec.synthetic is not None:
        return f"synthetic {'/'.join(spec.synthetic.formats)}"
    return f"builtin {spec.builtin}" + (f" ({spec.part})" if spec.part else "")


def iter_docs(spec: SourceParams, kind: str, seed: int, invalid_utf8: str) -> Iterator[Doc]:
    """All documents of one source, within its budget. `kind` is the domain's kind."""
    if spec.path is not None:
        docs = _local(Path(spec.path), spec, kind, invalid_utf8)
    elif spec.hub is not None:
        docs = _hub(spec, kind, seed)
    elif spec.synthetic is not None:
        docs = _synthetic(spec, kind, seed)
    else:
        docs = _builtin(spec, kind, seed)
    return _budget(docs, spec)


def _budget(docs: Iterable[Doc], spec: SourceParams) -> Iterator[Doc]:
    n = size = 0
    for doc in docs:
        if spec.max_docs is not None and n >= spec.max_docs:
            return
        if spec.max_bytes is not None and size >= spec.max_bytes:
            return
        if spec.doc_max_bytes is not None and doc.text is not None and doc.nbytes > spec.doc_max_bytes:
            doc = replace(doc, text=doc.text.encode("utf-8")[:spec.doc_max_bytes].decode("utf-8", "ignore"))
        n += 1
        size += doc.nbytes
        yield doc


# ---------------------------------------------------------------- builtin


def _builtin(spec: SourceParams, kind: str, seed: int) -> Iterator[Doc]:
    name, part = spec.builtin, spec.part
    if (kind == "sft") != (name == "stdlib_sft"):
        raise DataError(f"builtin {name}: does not fit a {kind} domain")
    if name == "stdlib_sft":
        for id_, messages in builtin.conversations(seed):
            yield Doc(id_, messages=messages)
        return
    makers = {
        ("stdlib_repos", None): lambda: builtin.repos(seed, spec.site_packages),
        ("stdlib_books", None): builtin.docstring_books,
        ("stdlib_books", "docstrings"): builtin.docstring_books,
        ("stdlib_books", "topics"): builtin.topic_volumes,
        ("stdlib_short", None): builtin.short_docstrings,
        ("stdlib_short", "docstrings"): builtin.short_docstrings,
        ("stdlib_short", "modules"): builtin.short_modules,
    }
    if (name, part) not in makers:
        parts = sorted(p for n, p in makers if n == name and p)
        raise DataError(f"builtin {name}: unknown part {part!r} (choose from {parts})")
    for id_, text in makers[(name, part)]():
        yield Doc(id_, text=text)


def _synthetic(spec: SourceParams, kind: str, seed: int) -> Iterator[Doc]:
    """Retrieval documents; in an sft domain, as chats (the user asks, the assistant answers)."""
    syn = spec.synthetic
    if kind == "sft":
        for id_, messages in synthetic.conversations(seed, syn.formats, syn.min_chars, syn.max_chars):
            yield Doc(id_, messages=messages)
        return
    for id_, text in synthetic.documents(seed, syn.formats, syn.min_chars, syn.max_chars):
        yield Doc(id_, text=text)


# ---------------------------------------------------------------- local files


def _local(path: Path, spec: SourceParams, kind: str, invalid_utf8: str) -> Iterator[Doc]:
    if not path.exists():
        raise DataError(f"{path}: source path does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES)
        if not files:
            raise DataError(f"{path}: no {sorted(LOCAL_SUFFIXES)} files in this directory")
    elif path.suffix in LOCAL_SUFFIXES:
        files = [path]
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r} (use {sorted(LOCAL_SUFFIXES)})")
    for f in files:
        if f.suffix in LOCAL_TEXT:
            if kind == "sft":
                raise DataError(f"{f}: sft domains need conversations (.jsonl or .parquet with {spec.messages_field})")
            text, replaced = _decode(f.read_bytes(), f, invalid_utf8)
            yield Doc(str(f), text=text, replaced=replaced)
        elif f.suffix == ".jsonl":
            yield from _jsonl(f, spec, kind, invalid_utf8)
        else:
            yield from _parquet(f, spec, kind)


def _decode(raw: bytes, where: Any, invalid_utf8: str) -> tuple[str, int]:
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if invalid_utf8 == "reject":
            raise DataError(
                f"{where}: not valid UTF-8 at byte {e.start} (set corpora.invalid_utf8: replace to keep it)"
            ) from None
    text = raw.decode("utf-8", errors="replace")
    return text, text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")


def _jsonl(f: Path, spec: SourceParams, kind: str, invalid_utf8: str) -> Iterator[Doc]:
    with f.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            line, replaced = _decode(raw, f"{f}:{lineno}", invalid_utf8)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{f}:{lineno}: corrupt JSON line: {e.msg}") from None
            if not isinstance(row, dict):
                raise DataError(f"{f}:{lineno}: each line must be a JSON object")
            doc = _row_doc(row, f"{f}:{lineno}", spec, kind)
            doc.replaced = replaced
            yield doc


def _parquet(f: Path, spec: SourceParams, kind: str) -> Iterator[Doc]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = spec.messages_field if kind == "sft" else spec.text_field
    try:
        pf = pq.ParquetFile(f)
        if column not in pf.schema_arrow.names:
            raise DataError(f"{f}: no column {column!r} (columns: {pf.schema_arrow.names})")
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=[column]):
            for value in batch.column(0).to_pylist():
                yield _row_doc({column: value}, f"{f}:{row}", spec, kind)
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{f}: corrupt or unreadable parquet file: {e}") from None


# ---------------------------------------------------------------- rows (jsonl, parquet, hub)


def _row_doc(row: dict, where: str, spec: SourceParams, kind: str) -> Doc:
    if kind == "sft":
        return Doc(where, messages=_messages(row.get(spec.messages_field), where, spec.messages_field))
    value = row.get(spec.text_field)
    if isinstance(value, list):  # a conversation used as plain text (Tulu-v2 in ShortMix)
        value = "\n\n".join(f"{m['role']}: {m['content']}" for m in _messages(value, where, spec.text_field))
    if not isinstance(value, str):
        raise DataError(f"{where}: field {spec.text_field!r} must be a string, got {type(value).__name__}")
    return Doc(where, text=value)


def _messages(value: Any, where: str, key: str) -> Messages:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {key!r} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {key}[{i}] must be {{'role': str, 'content': str}}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: conversation has no assistant message")
    return out


def _dotted(row: dict, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(row, dict):
            return None
        row = row.get(part)
    return row


def _hub(spec: SourceParams, kind: str, seed: int) -> Iterator[Doc]:
    """Stream a `datasets` dataset (hub id or local dataset directory)."""
    import datasets

    try:
        ds = datasets.load_dataset(spec.hub, spec.name, split=spec.split, streaming=True)
        rows = iter(ds)
        index = 0
        group_key, group = None, []
        for row in rows:
            index += 1
            if any(str(_dotted(row, k)) != v for k, v in spec.filter.items()):
                continue
            where = f"{spec.hub}:{spec.split}:{index - 1}"
            if spec.group_by is None:
                yield _row_doc(row, where, spec, kind)
                continue
            key = _dotted(row, spec.group_by)
            if group and key != group_key:
                yield _group_doc(group_key, group, spec, seed)
                group = []
            group_key = key
            group.append(_group_part(row, where, spec))
        if group:
            yield _group_doc(group_key, group, spec, seed)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (not found, auth, network, schema)
        raise DataError(f"hub source {spec.hub!r}: {type(e).__name__}: {e}") from None


def _group_part(row: dict, where: str, spec: SourceParams) -> str:
    text = _row_doc(row, where, spec, "long").text
    if spec.header_field:
        return f"### File: {_dotted(row, spec.header_field)}\n{text}\n"
    return text + "\n"


def _group_doc(key: Any, parts: list[str], spec: SourceParams, seed: int) -> Doc:
    """Files of one repository in random order: ProLong concatenates without dependency order."""
    random.Random(f"{seed}:{key}").shuffle(parts)
    return Doc(f"{spec.hub}:{spec.group_by}={key}", text="".join(parts))
