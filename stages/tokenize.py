"""DVC stage `tokenize`: corpora -> token shards per domain (length-filtered) + the tokenizer."""

from __future__ import annotations

if not __package__:  # `python stages/tokenize.py`: stages/ leads sys.path, its tokenize.py shadows Python's
    raise SystemExit("run it as `python -m stages.tokenize` from the project root (or `dvc repro tokenize`)")

from pathlib import Path

from longctx.config import Params, flat
from longctx.data.shards import id_dtype
from longctx.data.stats import format_table, length_table, plot_length_hist
from longctx.data.tokenize import tokenize_domains, training_text
from longctx.data.tokenizer import TextTokenizer
from longctx.io import atomic_dir, read_json, write_json
from longctx.tracking.runs import stage_run

from ._run import CORPORA, METRICS, PLOTS, TOKENS, main

TIMINGS = ("seconds", "tokens_per_s")  # kept out of outputs, so equal inputs give equal bytes


def run(cfg: Params, root: Path) -> None:
    """Encode every domain with the base model's tokenizer (or a BPE trained here)."""
    read_json(CORPORA / "manifest.json", "corpora manifest")
    tcfg = cfg.tokenize
    domains = {d: spec.kind for d, spec in cfg.corpora.domains.items()}
    with stage_run(cfg.tracking, root, "tokenize", flat(tcfg, "tokenize")) as tracker:
        with atomic_dir(TOKENS) as tmp:
            train = tcfg.tokenizer.train
            sample = training_text(CORPORA, domains, train.sample_bytes) if train else None
            tok = TextTokenizer.from_spec(tcfg.tokenizer, sample)
            tok.save(tmp / "tokenizer")
            report, lengths = tokenize_domains(tcfg, domains, CORPORA, tmp, tok)
            index = {
                "dtype": id_dtype(tok.vocab_size, tcfg.dtype).name,
                "vocab_size": tok.vocab_size,
                "fingerprint": tok.fingerprint,
                "tokenizer_spec": tcfg.tokenizer.model_dump(mode="json"),
                "long_min_tokens": tcfg.long_min_tokens,
                "domains": {d: {k: v for k, v in r.items() if k not in TIMINGS} for d, r in report.items()},
            }
            write_json(tmp / "index.json", index)
        table = length_table(lengths, extra=(tcfg.long_min_tokens,))
        METRICS.mkdir(exist_ok=True)
        PLOTS.mkdir(exist_ok=True)
        write_json(METRICS / "tokenize.json", {"vocab_size": tok.vocab_size, "domains": report, "lengths": table})
        plot_length_hist(lengths, tcfg.long_min_tokens, PLOTS / "length_hist.png")
        columns = [c for c in next(iter(table.values())) if c.startswith("pct_gt")]
        text = format_table(table, ["docs", "tokens", "p50", "p90", "max", *columns])
        print(f"document lengths (% of documents longer than each threshold):\n{text}")
        kept = {d: {"kept_docs": r["kept_docs"], "kept_tokens": r["kept_tokens"], "tokens/s": r["tokens_per_s"]}
                for d, r in report.items()}
        print(format_table(kept, ["kept_docs", "kept_tokens", "tokens/s"]))
        tracker.text(text, "length_table.txt")
        tracker.artifact(PLOTS / "length_hist.png")
        tracker.artifact(METRICS / "tokenize.json")
        tracker.metrics({"vocab_size": tok.vocab_size})
        for d, r in report.items():
            tracker.metrics({f"{d}.{k}": v for k, v in r.items() if k != "kind"})
            tracker.metrics({f"{d}.{k}": v for k, v in table[d].items()})


if __name__ == "__main__":
    main("tokenize", run, writes=(TOKENS,))
