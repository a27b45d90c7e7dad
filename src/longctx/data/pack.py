"""Stage 3: token shards -> fixed-length training sequences, ProLong style.

Each domain gives *chunks*, the units of the mix:
  long   documents >= L are cut into single-document chunks of exactly L tokens (a document's
         last piece shorter than L is unused);
  short  documents are concatenated into L-token chunks; the truncated tail of the last one
         starts the next chunk, so no token is lost;
  whole  documents are concatenated into L-token chunks; the one that overflows loses its tail,
         so no document is split over two chunks (a retrieval question never loses its needle);
  sft    conversations, packed as whole documents (with their loss masks).
A split asks for token shares per domain (and, for long domains, per chunk length). Chunks
shorter than the sequence length are shuffled together and placed side by side; every piece
of a document is a segment whose boundaries the attention masks and position ids use.
Only a plan (a few integers per chunk) is held in memory; tokens are copied through.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..config import Params
from ..errors import DataError
from ..io import sampled_digest, write_json
from .shards import ShardReader

SEG_DTYPE = np.dtype([("doc", "<u8"), ("start", "<u8"), ("length", "<u4"), ("domain", "<u2")])
PARTS = ("train", "val")
VAL_BUCKETS = 1 << 20


# ---------------------------------------------------------------- document pools


@dataclass
class Pool:
    """One domain's documents for one part (train or val), in a seeded random order."""

    domain: str
    kind: str
    reader: ShardReader
    docs: np.ndarray
    lengths: np.ndarray

    @classmethod
    def select(cls, domain: str, kind: str, reader: ShardReader, part: str, val_fraction: float,
               rng: np.random.Generator) -> Pool:
        keys = reader.docs["key"]
        in_val = (keys % VAL_BUCKETS) < int(val_fraction * VAL_BUCKETS)
        if not in_val.any() and keys.size > 1:  # a small domain still gets one held-out document
            in_val[np.argmin(keys % VAL_BUCKETS)] = True
        docs = np.flatnonzero(in_val if part == "val" else ~in_val)
        docs = docs[rng.permutation(docs.size)]
        return cls(domain, kind, reader, docs, reader.docs["length"][docs].astype(np.int64))


Segment = tuple[int, int, int]  # doc (index in the domain's shards), start, length


class LongChunks:
    """Single-document chunks; longer lengths are cut first, later lengths use what is left."""

    def __init__(self, pool: Pool, need: dict[int, int]):
        self.pool = pool
        self.chunks: dict[int, np.ndarray] = {}
        self.short_of: tuple[int, int, int] | None = None  # (length, needed, found)
        cursor = np.zeros(pool.docs.size, dtype=np.int64)
        for length in sorted(need, reverse=True):
            avail = (pool.lengths - cursor) // length
            take = _take_in_order(avail, need[length])
            if take.sum() < need[length]:
                self.short_of = (length, need[length], int(avail.sum()))
                return
            doc_pos = np.repeat(np.arange(pool.docs.size), take)
            first = np.repeat(cursor, take)
            within = np.arange(doc_pos.size) - np.repeat(np.cumsum(take) - take, take)
            self.chunks[length] = np.stack([doc_pos, first + within * length], axis=1)
            cursor += take * length

    def segments(self, length: int, k: int) -> list[Segment]:
        pos, start = self.chunks[length][k]
        return [(int(self.pool.docs[pos]), int(start), length)]


class ShortChunks:
    """Documents concatenated in pool order and cut every L tokens (carry-over)."""

    def __init__(self, pool: Pool, length: int):
        self.pool = pool
        self.length = length
        self.ends = np.cumsum(pool.lengths)
        self.capacity = int(self.ends[-1] // length) if pool.docs.size else 0

    def segments(self, length: int, k: int) -> list[Segment]:
        lo, hi = k * length, (k + 1) * length
        i = int(np.searchsorted(self.ends, lo, side="right"))
        out = []
        while lo < hi:
            doc_start = int(self.ends[i] - self.pool.lengths[i])
            stop = min(hi, int(self.ends[i]))
            out.append((int(self.pool.docs[i]), lo - doc_start, stop - lo))
            lo = stop
            i += 1
        return out


class WholeChunks:
    """Documents (conversations) concatenated in pool order; the one that overflows a chunk is
    truncated and its tail dropped, so each chunk starts with a whole document and no document
    continues into another chunk."""

    def __init__(self, pool: Pool, length: int):
        self.pool = pool
        firsts = []
        i, n = 0, pool.docs.size
        lengths = pool.lengths
        while i < n:
            first, fill = i, 0
            while fill < length and i < n:
                fill += min(int(lengths[i]), length - fill)
                i += 1
            if fill == length:
                firsts.append(first)
        self.firsts = np.asarray(firsts, dtype=np.int64)
        self.capacity = len(firsts)

    def segments(self, length: int, k: int) -> list[Segment]:
        i, fill, out = int(self.firsts[k]), 0, []
        while fill < length:
            take = min(int(self.pool.lengths[i]), length - fill)
            out.append((int(self.pool.docs[i]), 0, take))
            fill += take
            i += 1
        return out


def _take_in_order(avail: np.ndarray, need: int) -> np.ndarray:
    """Take chunks from documents in order until `need` are taken."""
    csum = np.cumsum(avail)
    take = avail.copy()
    over = np.searchsorted(csum, need, side="left")
    if over < take.size:
        take[over] -= csum[over] - need
        take[over + 1:] = 0
    return take


# ---------------------------------------------------------------- planning


@dataclass
class SplitPlan:
    name: str
    part: str
    seq_len: int
    tokens: int
    sequences: list[list[tuple[str, int, int]]]  # per sequence: (domain, chunk length, chunk index)
    sources: dict[str, LongChunks | ShortChunks | WholeChunks]


class Planner:
    def __init__(self, cfg: Params, split: str, pools: dict[str, Pool]):
        self.cfg = cfg
        self.split = split
        self.spec = cfg.pack.splits[split]
        self.pools = pools
        self.units = {
            (d, length): share * w
            for d, share in cfg.flat_mix(split).items()
            for length, w in cfg.chunk_lengths(split, d).items()
        }
        self.fixed: dict[str, ShortChunks | WholeChunks] = {}
        for d in cfg.flat_mix(split):
            pool = pools[d]
            if pool.kind == "short":
                self.fixed[d] = ShortChunks(pool, self.spec.base_len)
            elif pool.kind in ("whole", "sft"):
                self.fixed[d] = WholeChunks(pool, self.spec.base_len)

    def need(self, tokens: int) -> dict[tuple[str, int], int]:
        """Chunks per (domain, length) for `tokens`; chunks shorter than a sequence come in
        whole sequences' worth (the largest counts give up the remainder), so no chunk is cut
        and left unused."""
        need = {(d, length): max(int(round(share * tokens / length)), int(tokens > 0))
                for (d, length), share in self.units.items()}
        for length in {length for _, length in need}:
            per_seq = self.spec.seq_len // length
            units = sorted((u for u in need if u[1] == length), key=lambda u: (-need[u], u))
            extra = sum(need[u] for u in units) % per_seq
            for u in units:
                cut = min(extra, need[u])
                need[u] -= cut
                extra -= cut
        return need

    def build(self, tokens: int) -> tuple[dict, str | None]:
        """Chunk sources for `tokens`, or the reason they cannot be had."""
        need = self.need(tokens)
        sources: dict = {}
        for d in self.cfg.flat_mix(self.split):
            per_len = {length: n for (dd, length), n in need.items() if dd == d}
            pool = self.pools[d]
            if d in self.fixed:
                src = self.fixed[d]
                n = sum(per_len.values())
                if n > src.capacity:
                    return {}, (f"domain {d!r} gives {src.capacity} chunks of {self.spec.base_len} tokens "
                                f"({int(pool.lengths.sum())} tokens in {pool.docs.size} documents), {n} needed")
            else:
                src = LongChunks(pool, per_len)
                if src.short_of:
                    length, n, found = src.short_of
                    longest = int(pool.lengths.max()) if pool.lengths.size else 0
                    return {}, (f"domain {d!r} gives {found} single-document chunks of {length} tokens, "
                                f"{n} needed ({pool.docs.size} documents, longest {longest} tokens)")
            sources[d] = src
        return sources, None

    def largest_tokens(self) -> int:
        """The most tokens the data supports at the requested mix (binary search)."""
        hi = min(
            int(self.pools[d].lengths.sum() / share) + 1
            for d, share in self.cfg.flat_mix(self.split).items()
        )
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.build(mid)[1] is None:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def plan(self, part: str, tokens: int | None, rng: np.random.Generator) -> SplitPlan:
        where = f"pack.splits.{self.split} ({part})"
        if tokens is None:
            tokens = self.largest_tokens()
            if tokens == 0:
                raise DataError(f"{where}: the data cannot fill one sequence at the requested mix: "
                                f"{self.build(self.spec.seq_len)[1]}")
        sources, why = self.build(tokens)
        if why:
            raise DataError(f"{where}: not enough data for {tokens} tokens at the requested mix: {why}")
        seq_len = self.spec.seq_len
        by_len: dict[int, list[tuple[str, int, int]]] = {}
        for (d, length), n in self.need(tokens).items():
            by_len.setdefault(length, []).extend((d, length, k) for k in range(n))
        sequences: list[list[tuple[str, int, int]]] = []
        for length in sorted(by_len):
            chunks = by_len[length]
            order = rng.permutation(len(chunks))
            per_seq = seq_len // length
            sequences += [[chunks[j] for j in order[i:i + per_seq]] for i in range(0, len(chunks), per_seq)]
        if not sequences:
            raise DataError(f"{where}: no complete sequence of {seq_len} tokens (the data allows "
                            f"{tokens} tokens at the requested mix); add data or lower seq_len")
        order = rng.permutation(len(sequences))
        return SplitPlan(self.split, part, seq_len, tokens, [sequences[i] for i in order], sources)


# ---------------------------------------------------------------- writing


def write_split(plan: SplitPlan, folder: Path, domains: list[str], dtype: np.dtype) -> dict[str, int]:
    """Write one planned split; returns tokens per domain."""
    folder.mkdir(parents=True, exist_ok=True)
    domain_id = {d: i for i, d in enumerate(domains)}
    sft = any(s.pool.kind == "sft" for s in plan.sources.values())
    per_domain = dict.fromkeys(plan.sources, 0)
    seq_segs = [0]
    with contextlib.ExitStack() as stack:
        ftok = stack.enter_context(open(folder / "tokens.bin", "wb"))
        fseg = stack.enter_context(open(folder / "segments.bin", "wb"))
        fmask = stack.enter_context(open(folder / "loss_mask.bin", "wb")) if sft else None
        bar = stack.enter_context(tqdm(total=len(plan.sequences), desc=f"pack {plan.name}/{plan.part}",
                                       unit="seq", leave=False, mininterval=1.0))
        buf = np.empty(plan.seq_len, dtype=dtype)
        mbuf = np.empty(plan.seq_len, dtype=np.uint8)
        for seq in plan.sequences:
            pos = 0
            segs = []
            for d, length, k in seq:
                src = plan.sources[d]
                reader = src.pool.reader
                for doc, start, n in src.segments(length, k):
                    buf[pos:pos + n] = reader.tokens(doc, start, start + n)
                    if fmask:  # (whole documents replayed among conversations: the loss on every token)
                        mbuf[pos:pos + n] = reader.mask(doc, start, start + n) if src.pool.kind == "sft" else 1
                    segs.append((doc, start, n, domain_id[d]))
                    pos += n
                per_domain[d] += length
            if pos != plan.seq_len:
                raise AssertionError(f"sequence filled {pos} of {plan.seq_len} tokens")
            ftok.write(buf.tobytes())
            if fmask:
                fmask.write(mbuf.tobytes())
            fseg.write(np.array(segs, dtype=SEG_DTYPE).tobytes())
            seq_segs.append(seq_segs[-1] + len(segs))
            bar.update()
    np.asarray(seq_segs, dtype=np.int64).tofile(folder / "seq_segments.bin")
    return per_domain


def estimated_bytes(cfg: Params, token_index: dict) -> int:
    """At most what pack_all writes: per split its token budget (without one, the most the
    scarcest domain allows at the mix, as in Planner.largest_tokens), a loss-mask byte per token
    where it has SFT data."""
    itemsize = np.dtype(token_index["dtype"]).itemsize
    total = 0
    for split, spec in cfg.pack.splits.items():
        mix = cfg.flat_mix(split)
        tokens = spec.tokens or min(token_index["domains"][d]["kept_tokens"] / share
                                    for d, share in mix.items() if share > 0)
        total += tokens * (itemsize + any(cfg.corpora.domains[d].kind == "sft" for d in mix))
    return int(total)


def pack_all(cfg: Params, tokens_dir: Path, out: Path, token_index: dict) -> dict:
    """Plan and write every split (train and val); return the manifest."""
    readers = {d: ShardReader(tokens_dir / d) for d in cfg.corpora.domains}
    domains = list(cfg.corpora.domains)
    dtype = np.dtype(token_index["dtype"])
    manifest: dict = {"seed": cfg.pack.seed, "val_fraction": cfg.pack.val_fraction, "splits": {}}
    written = 0
    try:
        for split, spec in cfg.pack.splits.items():
            requested = cfg.flat_mix(split)
            entry: dict = {"seq_len": spec.seq_len, "requested": requested, "parts": {}}
            for part in PARTS:
                seed = [cfg.pack.seed, zlib.crc32(split.encode()), PARTS.index(part)]
                pools = {
                    d: Pool.select(d, cfg.corpora.domains[d].kind, readers[d], part, cfg.pack.val_fraction,
                                   np.random.default_rng([*seed, zlib.crc32(d.encode())]))
                    for d in requested
                }
                plan = Planner(cfg, split, pools).plan(part, spec.tokens if part == "train" else None,
                                                       np.random.default_rng(seed))
                per_domain = write_split(plan, out / split / part, domains, dtype)
                total = sum(per_domain.values())
                achieved = {d: n / total for d, n in per_domain.items()}
                gaps = {d: achieved[d] - want for d, want in requested.items()
                        if abs(achieved[d] - want) > cfg.pack.tolerance}
                if gaps and part == "train":
                    d = max(gaps, key=lambda x: abs(gaps[x]))
                    raise DataError(
                        f"pack.splits.{split} ({part}): domain {d!r} is {achieved[d]:.3f} of the tokens, "
                        f"{requested[d]:.3f} requested (tolerance pack.tolerance={cfg.pack.tolerance}); "
                        "more data or more tokens make the mix exact"
                    )
                index = {
                    "split": split, "part": part, "seq_len": spec.seq_len, "sequences": len(plan.sequences),
                    "tokens": total, "dtype": dtype.name, "vocab_size": token_index["vocab_size"],
                    "fingerprint": token_index["fingerprint"], "domains": domains,
                    "kinds": {d: cfg.corpora.domains[d].kind for d in domains},
                    "loss_mask": any(cfg.corpora.domains[d].kind == "sft" for d in requested),
                    "digests": {f.name: sampled_digest(f) for f in sorted((out / split / part).glob("*.bin"))},
                }
                write_json(out / split / part / "index.json", index)
                written += total
                entry["parts"][part] = {
                    "sequences": len(plan.sequences), "tokens": total, "achieved": achieved,
                    "tokens_per_domain": per_domain,
                    # validation parts are small: whole chunks can move a share past the tolerance
                    "outside_tolerance": {d: round(g, 4) for d, g in gaps.items()},
                }
            manifest["splits"][split] = entry
    finally:
        for r in readers.values():
            r.close()
    manifest["tokens_written"] = written
    return manifest

