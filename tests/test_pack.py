"""Packing invariants, checked on a real run over stdlib text."""

from __future__ import annotations

import copy
import hashlib
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import SMALL, run_stages
from longctx import config
from longctx.data.loader import PackedDataset
from longctx.data.shards import ShardReader, doc_key
from longctx.data.tokenizer import TextTokenizer
from longctx.errors import DataError


def segments(ds: PackedDataset):
    """(sequence, position in sequence, domain, doc, start, length) for every segment."""
    for i in range(len(ds)):
        pos = 0
        for s in ds.segments[ds.seq_segments[i]:ds.seq_segments[i + 1]]:
            yield i, pos, ds.domains[s["domain"]], int(s["doc"]), int(s["start"]), int(s["length"])
            pos += int(s["length"])


def splits(project: Path):
    for split_dir in sorted((project / "data/packed").iterdir()):
        if split_dir.is_dir():
            for part in ("train", "val"):
                yield split_dir.name, part, PackedDataset(split_dir / part)


def test_boundaries_fill_every_sequence(small_project):
    for _, _, ds in splits(small_project):
        assert len(ds) > 0
        for i in range(len(ds)):
            sample = ds[i]
            assert sample.doc_lens.sum() == ds.seq_len
            assert sample.cu_seqlens[0] == 0 and sample.cu_seqlens[-1] == ds.seq_len
            # positions restart at every document start and count up inside it
            pos = sample.position_ids
            assert (pos[sample.cu_seqlens[:-1]] == 0).all()
            inside = np.ones(ds.seq_len, bool)
            inside[sample.cu_seqlens[:-1]] = False
            assert (np.diff(pos)[inside[1:]] == 1).all()


def test_segment_tokens_are_the_documents_tokens(small_project):
    readers = {}
    for _, _, ds in splits(small_project):
        for i, pos, domain, doc, start, length in segments(ds):
            r = readers.setdefault(domain, ShardReader(small_project / "data/tokens" / domain))
            assert np.array_equal(ds.tokens[i, pos:pos + length], r.tokens(doc, start, start + length))


def test_long_documents_are_cut_into_exact_single_document_chunks(small_project):
    cfg = config.load(small_project / "params.yaml")
    for split, part, ds in splits(small_project):
        lengths = {d: set(cfg.chunk_lengths(split, d)) for d in cfg.flat_mix(split)
                   if cfg.corpora.domains[d].kind == "long"}
        if not lengths:
            continue
        per_doc = defaultdict(list)
        for _, _, domain, doc, start, length in segments(ds):
            if domain in lengths:
                assert length in lengths[domain], (split, domain, length)
                per_doc[(domain, doc)].append((start, length))
        assert per_doc, f"{split}/{part} has no long data"
        for (domain, doc), chunks in per_doc.items():
            # Longer chunks are cut first; together a document's chunks tile a prefix of it:
            # every token used once, in order, none skipped.
            chunks.sort()
            expect = 0
            for start, length in chunks:
                assert start == expect, (domain, doc, chunks)
                expect += length
            reader = ShardReader(small_project / "data/tokens" / domain)
            assert expect <= int(reader.docs[doc]["length"])


def test_short_data_carry_over_loses_no_token(small_project):
    cfg = config.load(small_project / "params.yaml")
    ds = PackedDataset(small_project / "data/packed/stage1/train")
    short = {d for d, s in cfg.corpora.domains.items() if s.kind == "short"}
    pieces = defaultdict(list)
    for _, _, domain, doc, start, length in segments(ds):
        if domain in short:
            pieces[(domain, doc)].append((start, length))
    split_docs = 0
    for domain in short:
        reader = ShardReader(small_project / "data/tokens" / domain)
        docs = [k for k in pieces if k[0] == domain]
        partial = 0
        for key in docs:
            spans = sorted(pieces[key])
            covered = 0
            for start, length in spans:
                assert start == covered, (key, spans)  # no gap, no token twice
                covered += length
            split_docs += len(spans) > 1
            partial += covered < int(reader.docs[key[1]]["length"])
        # Only the stream's very last document may be cut short (the stream's unused end).
        assert partial <= 1, domain
    assert split_docs > 0, "no document was carried over into a next chunk"


def test_sft_tails_are_dropped_and_masks_mark_assistant_turns(small_project):
    """Conversations: the loss on assistant turns; retrieval documents replayed among them (the tiny
    profile's SFT mix): the loss on every token."""
    ds = PackedDataset(small_project / "data/packed/sft/train")
    tok = TextTokenizer.load(small_project / "data/tokens/tokenizer")
    reader = ShardReader(small_project / "data/tokens/chat")
    replayed = ShardReader(small_project / "data/tokens/retrieval_long")
    table = pq.read_table(small_project / "data/corpora/chat.parquet").to_pylist()
    by_key = {doc_key(r["id"]): r["messages"] for r in table}
    end = tok.tok.token_to_id("<|end|>")
    truncated = whole = replays = 0
    for i in range(len(ds)):
        sample = ds[i]
        segs = ds.segments[ds.seq_segments[i]:ds.seq_segments[i + 1]]
        pos = 0
        for j, s in enumerate(segs):
            n, doc = int(s["length"]), int(s["doc"])
            assert s["start"] == 0  # every conversation starts at its beginning: no carried tail
            if ds.domains[s["domain"]] == "retrieval_long":
                assert sample.loss_mask[pos:pos + n].all()
                assert (sample.input_ids[pos:pos + n] == replayed.tokens(doc, 0, n)).all()
                replays += 1
                pos += n
                continue
            full = int(reader.docs[doc]["length"])
            if n < full:
                assert j == len(segs) - 1  # only the last conversation of a chunk is cut
                truncated += 1
            else:
                whole += 1
                ids = sample.input_ids[pos:pos + n]
                mask = sample.loss_mask[pos:pos + n].astype(bool)
                messages = by_key[int(reader.docs[doc]["key"])]
                replies = [m["content"] for m in messages if m["role"] == "assistant"]
                assert tok.tok.decode(ids[mask].tolist(), skip_special_tokens=False) == "".join(
                    f"{r}<|end|>\n" for r in replies)
                assert ids[mask].tolist().count(end) == len(replies)
            pos += n
    assert truncated > 0 and whole > 0 and replays > 0
    # the cut-off tails appear nowhere: each conversation is used at most once
    docs = [(int(s["domain"]), int(s["doc"])) for s in ds.segments]
    assert len(docs) == len(set(docs))


def test_whole_documents_are_never_cut_across_chunks(small_project):
    """Synthetic retrieval documents (kind whole): each starts a chunk or follows a whole one;
    only a chunk's last document may lose its tail, which starts no other chunk."""
    ds = PackedDataset(small_project / "data/packed/base/train")
    reader = ShardReader(small_project / "data/tokens/retrieval")
    truncated = whole = 0
    for i in range(len(ds)):
        segs = [s for s in ds.segments[ds.seq_segments[i]:ds.seq_segments[i + 1]]
                if ds.domains[s["domain"]] == "retrieval"]
        for j, s in enumerate(segs):
            assert s["start"] == 0
            if int(s["length"]) < int(reader.docs[int(s["doc"])]["length"]):
                assert j == len(segs) - 1
                truncated += 1
            else:
                whole += 1
    docs = [int(s["doc"]) for s in ds.segments if ds.domains[s["domain"]] == "retrieval"]
    assert len(docs) == len(set(docs))
    assert whole > truncated > 0


def test_achieved_proportions_match_the_request(small_project):
    cfg = config.load(small_project / "params.yaml")
    manifest = json.loads((small_project / "data/packed/manifest.json").read_text())
    for split, part, ds in splits(small_project):
        counts = defaultdict(int)
        for _, _, domain, _, _, length in segments(ds):
            counts[domain] += length
        total = sum(counts.values())
        assert total == len(ds) * ds.seq_len
        reported = manifest["splits"][split]["parts"][part]["outside_tolerance"]
        for domain, want in cfg.flat_mix(split).items():
            outside = abs(counts[domain] / total - want) > cfg.pack.tolerance
            assert outside == (domain in reported), (split, part, domain)
            assert not (outside and part == "train")  # a training mix off the request is an error
        if part == "train":  # close, up to the chunks given up to fill whole sequences
            slack = 0.01 + ds.seq_len / total
            for domain, want in cfg.flat_mix(split).items():
                assert abs(counts[domain] / total - want) < slack, (split, domain, counts[domain] / total)
    assert set(manifest["splits"]) == set(cfg.pack.splits)


def test_train_and_val_share_no_document(small_project):
    for split_dir in (small_project / "data/packed").iterdir():
        if not split_dir.is_dir():
            continue
        docs = {}
        for part in ("train", "val"):
            ds = PackedDataset(split_dir / part)
            docs[part] = {(d, doc) for _, _, d, doc, _, _ in segments(ds)}
        assert not docs["train"] & docs["val"], split_dir.name


def test_stage2_mixes_chunk_lengths_as_asked(small_project):
    ds = PackedDataset(small_project / "data/packed/stage2/train")
    long_tokens = defaultdict(lambda: defaultdict(int))
    for _, _, domain, _, _, length in segments(ds):
        long_tokens[domain][length] += length
    code = long_tokens["code_repos"]
    assert abs(code[2048] / (code[2048] + code[512]) - 0.5) < 0.05
    books = long_tokens["books"]
    assert abs(books[2048] / (books[2048] + books[512]) - 0.17) < 0.05
    assert set(long_tokens["textbooks"]) == {2048}


def test_loader_is_zero_copy(small_project):
    ds = PackedDataset(small_project / "data/packed/stage1/train")
    ids = ds[0].input_ids
    assert isinstance(ids.base, np.memmap) or isinstance(ids, np.memmap)
    assert not ids.flags.writeable
    with pytest.raises(IndexError):
        ds[len(ds)]


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_gives_byte_identical_outputs(project_copy, small_project):
    for d in ("corpora", "tokens", "packed"):
        (project_copy / "data" / d).rename(project_copy / "data" / f"{d}.first")
    run_stages(project_copy, ["corpora", "tokenize", "pack"])
    for d in ("corpora", "tokens", "packed"):
        first, second = _hashes(project_copy / "data" / f"{d}.first"), _hashes(project_copy / "data" / d)
        assert first == second, d
    # and a different seed changes the packing
    overrides = {**SMALL, "pack": {**SMALL["pack"], "seed": 7}}
    run_stages(project_copy, ["pack"], overrides)
    assert _hashes(project_copy / "data/packed/stage1") != _hashes(project_copy / "data/packed.first/stage1")


def test_no_document_long_enough_is_a_clear_error_and_keeps_outputs(project_copy):
    before = _hashes(project_copy / "data/packed")
    overrides = copy.deepcopy(SMALL)
    overrides["pack"]["splits"]["stage2"] = {"seq_len": 1 << 20, "chunk_len": 512,
                                             "lengths": {"textbooks": {1 << 20: 1.0, 8192: None}, "code_repos": None,
                                                         "books": None}}
    with pytest.raises(DataError, match="textbooks.*1048576"):
        run_stages(project_copy, ["pack"], overrides)
    assert _hashes(project_copy / "data/packed") == before
    assert not [p for p in (project_copy / "data").iterdir() if p.name.startswith(".")]


def test_tokens_beyond_the_data_are_refused(project_copy):
    overrides = copy.deepcopy(SMALL)
    overrides["pack"]["splits"]["stage1"]["tokens"] = 10**9
    with pytest.raises(DataError, match="not enough data for 1000000000 tokens"):
        run_stages(project_copy, ["pack"], overrides)


def test_changed_tokenizer_is_detected(project_copy):
    path = project_copy / "data/tokens/tokenizer/tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["eos_token"] = "<|end|>"
    path.write_text(json.dumps(cfg))
    with pytest.raises(DataError, match="changed since tokenize ran"):
        run_stages(project_copy, ["pack"])


def test_changed_tokenizer_params_are_detected(project_copy):
    overrides = copy.deepcopy(SMALL)
    overrides["tokenize"]["tokenizer"]["train"]["vocab_size"] = 2048
    with pytest.raises(DataError, match="rerun the tokenize stage"):
        run_stages(project_copy, ["pack"], overrides)
