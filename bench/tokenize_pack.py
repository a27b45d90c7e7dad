"""Tokenize+pack throughput and peak memory, against plain `tokenizers` batch encoding.

A corpus of real text (slices of the Python standard library's sources and docs, in documents
of ProLong-like lengths: half long documents, half short ones) is written at 1x and 4x a base
size. For each size, in separate processes on the same machine:
  peer         read the same parquet, `Tokenizer.encode_batch` 512 documents at a time, take the ids;
  peer_capped  the same with batches of at most 4 MB of text (plain usage at its best: huge
               batches of long documents parallelize badly and take GBs);
  ours         the tokenize stage (worker processes, shards, length filter) then the pack stage.
The ratio that counts is ours / the faster peer.
Peak memory is the largest summed RSS of the process and its children, sampled every 20 ms.
Targets: ours/peer time <= 1.25; our peak RSS at 4x <= 1.2x that at 1x.

    python bench/tokenize_pack.py                 # 200 MB and 800 MB
    python bench/tokenize_pack.py --mb 20         # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 16384
SEQ_LEN = 8192
LONG_MIN = 8192


def text_pool() -> str:
    from longctx.data import builtin

    parts = [text for _, text in builtin.repos(0)]
    parts += [text for _, text in builtin.short_modules()]
    parts += [text for _, text in builtin.topic_volumes()]
    return "\n".join(parts)


def generate(folder: Path, megabytes: int, seed: int = 0) -> Path:
    """<folder>/{long,short}.parquet with `megabytes` MB of text in all (cached)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = folder / "done"
    if done.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    pool = text_pool()
    rng = random.Random(seed)
    for domain, (lo, hi) in {"long": (40_000, 800_000), "short": (300, 30_000)}.items():
        target = megabytes * 1_000_000 // 2
        writer = pq.ParquetWriter(folder / f"{domain}.parquet", pa.schema([("id", pa.string()), ("text", pa.string())]))
        size = n = 0
        batch: list[str] = []
        while size < target:
            length = int(lo * (hi / lo) ** rng.random())  # log-uniform lengths
            start = rng.randrange(0, len(pool) - length)
            batch.append(pool[start:start + length])
            size += length
            if len(batch) == 256 or size >= target:
                writer.write_table(pa.table({"id": [f"{domain}-{n + i}" for i in range(len(batch))], "text": batch}))
                n += len(batch)
                batch = []
        writer.close()
    done.write_text("ok")
    return folder


def train_tokenizer(folder: Path, corpus: Path) -> Path:
    from longctx.config import BPEParams
    from longctx.data.tokenize import training_text
    from longctx.data.tokenizer import TextTokenizer

    if not (folder / "tokenizer.json").is_file():
        sample = training_text(corpus, {"long": "long", "short": "short"}, 20_000_000)
        TextTokenizer.train(sample, BPEParams(vocab_size=VOCAB, min_frequency=2)).save(folder)
    return folder


# ---------------------------------------------------------------- children (one per measurement)


def child_peer(corpus: Path, tokenizer: Path, capped: bool) -> dict:
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    tokens = 0

    def encode(texts: list[str]) -> int:
        return sum(len(enc.ids) for enc in tok.encode_batch(texts, add_special_tokens=False))

    for domain in ("long", "short"):
        for batch in pq.ParquetFile(corpus / f"{domain}.parquet").iter_batches(batch_size=512, columns=["text"]):
            texts = batch.column(0).to_pylist()
            if not capped:
                tokens += encode(texts)
                continue
            group, size = [], 0
            for t in texts:
                if group and size + len(t) > 4 << 20:
                    tokens += encode(group)
                    group, size = [], 0
                group.append(t)
                size += len(t)
            tokens += encode(group)
    return {"tokens": tokens}


def child_ours(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    import shutil

    from longctx import config
    from longctx.data.pack import pack_all
    from longctx.data.tokenize import tokenize_domains
    from longctx.data.tokenizer import TextTokenizer

    tiny = config.resolve({"profile": "tiny"})
    overrides = {
        "corpora": {"domains": {**dict.fromkeys(tiny.corpora.domains),
                                "long": {"kind": "long", "sources": [{"path": str(corpus / "long.parquet")}]},
                                "short": {"kind": "short", "sources": [{"path": str(corpus / "short.parquet")}]}}},
        "tokenize": {"tokenizer": {"train": None, "path": str(tokenizer)}, "long_min_tokens": LONG_MIN,
                     "num_workers": workers, "add_bos": False, "add_eos": False},
        "pack": {"groups": None, "splits": {**dict.fromkeys(tiny.pack.splits),
                                            "bench": {"seq_len": SEQ_LEN, "mix": {"long": 0.5, "short": 0.5}}}},
    }
    cfg = config.resolve(overrides)
    shutil.rmtree(out, ignore_errors=True)
    tok = TextTokenizer.from_spec(cfg.tokenize.tokenizer)
    tok.save(out / "tokens" / "tokenizer")
    t0 = time.perf_counter()
    report, _ = tokenize_domains(cfg.tokenize, {"long": "long", "short": "short"}, corpus, out / "tokens", tok)
    t1 = time.perf_counter()
    index = {"dtype": "uint16", "vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint}
    manifest = pack_all(cfg, out / "tokens", out / "packed", index)
    t2 = time.perf_counter()
    return {
        "tokens": sum(r["tokens"] for r in report.values()),
        "kept_tokens": sum(r["kept_tokens"] for r in report.values()),
        "packed_tokens": manifest["tokens_written"],
        "tokenize_s": round(t1 - t0, 3),
        "pack_s": round(t2 - t1, 3),
    }


# ---------------------------------------------------------------- measuring


def measure(args: list[str]) -> dict:
    """Run a child; wall time and peak summed RSS of it and its children."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"child {args[:2]} failed with {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "wall_s": round(wall, 3), "peak_rss_mb": round(peak / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="base corpus size in MB of text")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "work")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tokenize-pack",
                        help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind.startswith("peer"):
            result = child_peer(Path(rest[0]), Path(rest[1]), capped=kind == "peer_capped")
        else:
            result = child_ours(Path(rest[0]), Path(rest[1]), Path(rest[2]), int(rest[3]))
        print(json.dumps(result))
        return

    sys.path.insert(0, str(ROOT / "src"))
    rows = []
    tokenizer = None
    for scale in args.scales:
        mb = args.mb * scale
        print(f"generating {mb} MB corpus ...", flush=True)
        corpus = generate(args.work / f"corpus-{mb}mb", mb)
        tokenizer = tokenizer or train_tokenizer(args.work / "tokenizer", corpus)
        text_mb = sum(os.path.getsize(corpus / f"{d}.parquet") for d in ("long", "short")) / 1e6
        peers = {}
        for kind in ("peer", "peer_capped"):
            print(f"[{mb} MB] {kind}: tokenizers encode_batch ...", flush=True)
            peers[kind] = measure(["--child", kind, str(corpus), str(tokenizer)])
        print(f"[{mb} MB] ours: tokenize + pack ...", flush=True)
        ours = measure(["--child", "ours", str(corpus), str(tokenizer), str(args.work / "out"), str(args.workers)])
        best = min(peers.values(), key=lambda p: p["wall_s"])
        assert all(p["tokens"] == ours["tokens"] for p in peers.values()), "peers and ours saw different text"
        rows.append({"scale": scale, "text_mb": mb, "parquet_mb": round(text_mb, 1), **peers, "ours": ours,
                     "peer_tokens_per_s": round(best["tokens"] / best["wall_s"]),
                     "ours_tokens_per_s": round(ours["tokens"] / ours["wall_s"]),
                     "time_ratio": round(ours["wall_s"] / best["wall_s"], 3)})
    base = rows[0]["ours"]["peak_rss_mb"]
    for r in rows:
        r["rss_vs_first"] = round(r["ours"]["peak_rss_mb"] / base, 3)

    head = f"{'text':>7} {'tokens':>11} {'peer s':>8} {'capped s':>8} {'ours s':>8} {'tok':>7} {'pack':>6} " \
           f"{'ours/best':>9} {'best tok/s':>11} {'ours tok/s':>11} {'peer MB':>8} {'capped MB':>9} {'ours MB':>8} " \
           f"{'RSS vs 1x':>9}"
    print("\ntokenize+pack vs plain tokenizers (same machine, same run)")
    print(head)
    for r in rows:
        p, c, o = r["peer"], r["peer_capped"], r["ours"]
        print(f"{r['text_mb']:>5}MB {o['tokens']:>11} {p['wall_s']:>8.1f} {c['wall_s']:>8.1f} {o['wall_s']:>8.1f} "
              f"{o['tokenize_s']:>7.1f} {o['pack_s']:>6.1f} {r['time_ratio']:>9.3f} {r['peer_tokens_per_s']:>11} "
              f"{r['ours_tokens_per_s']:>11} {p['peak_rss_mb']:>8.0f} {c['peak_rss_mb']:>9.0f} "
              f"{o['peak_rss_mb']:>8.0f} "
              f"{r['rss_vs_first']:>9.3f}")
    worst = max(r["time_ratio"] for r in rows)
    growth = rows[-1]["rss_vs_first"]
    print(f"targets: ours/best peer <= 1.25 (worst {worst:.3f}: {'met' if worst <= 1.25 else 'MISSED'}); "
          f"peak RSS at {rows[-1]['scale']}x <= 1.2x of 1x ({growth:.3f}: {'met' if growth <= 1.2 else 'MISSED'})")

    import tokenizers

    result = {
        "benchmark": "tokenize_pack",
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "memory_gb": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version()},
        "tokenizers": tokenizers.__version__,
        "settings": {"vocab": VOCAB, "seq_len": SEQ_LEN, "long_min_tokens": LONG_MIN, "workers": args.workers},
        "rows": rows,
        "targets": {"time_ratio_max": 1.25, "rss_growth_max": 1.2, "worst_time_ratio": worst, "rss_growth": growth},
    }
    out = args.out / f"tokenize_pack-cpu{os.cpu_count()}-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
