"""DVC stage `pack`: token shards -> packed train/val sequences per split (curriculum stage, SFT)."""

from __future__ import annotations

if not __package__:  # `python stages/pack.py`: stages/ leads sys.path, its tokenize.py shadows Python's
    raise SystemExit("run it as `python -m stages.pack` from the project root (or `dvc repro pack`)")

import time
from pathlib import Path

from longctx.config import Params, flat
from longctx.data.pack import estimated_bytes, pack_all
from longctx.data.stats import format_table, plot_proportions
from longctx.errors import DataError
from longctx.io import atomic_dir, check_room, read_json, write_json
from longctx.tracking.runs import stage_run

from ._run import METRICS, PACKED, PLOTS, TOKENS, main, tokenizer


def check_tokens(cfg: Params) -> dict:
    """The token shards must come from the tokenizer the params ask for, unchanged since."""
    index = read_json(TOKENS / "index.json", "token index")
    if index.get("tokenizer_spec") != cfg.tokenize.tokenizer.model_dump(mode="json"):
        raise DataError(f"{TOKENS}: made with tokenizer {index.get('tokenizer_spec')}, but params now ask for "
                        f"{cfg.tokenize.tokenizer.model_dump(mode='json')}: rerun the tokenize stage")
    tokenizer()
    for d in cfg.corpora.domains:
        if d not in index["domains"]:
            raise DataError(f"{TOKENS}: no shards for domain {d!r}: rerun the tokenize stage")
        if read_json(TOKENS / d / "index.json", "shard index")["fingerprint"] != index["fingerprint"]:
            raise DataError(f"{TOKENS / d}: made with another tokenizer: rerun the tokenize stage")
    return index


def run(cfg: Params, root: Path) -> None:
    """Cut, mix and pack every split of the curriculum, plus SFT."""
    token_index = check_tokens(cfg)
    check_room(PACKED, estimated_bytes(cfg, token_index), "the packed splits")
    with stage_run(cfg.tracking, root, "pack", flat(cfg.pack, "pack")) as tracker:
        t0 = time.perf_counter()
        with atomic_dir(PACKED) as tmp:
            manifest = pack_all(cfg, TOKENS, tmp, token_index)
            write_json(tmp / "manifest.json", manifest)  # no timings: a rerun rewrites the same bytes
        seconds = time.perf_counter() - t0
        tokens_per_s = manifest["tokens_written"] / max(seconds, 1e-9)
        METRICS.mkdir(exist_ok=True)
        PLOTS.mkdir(exist_ok=True)
        summary = {}
        rows = {}
        for split, entry in manifest["splits"].items():
            for part, p in entry["parts"].items():
                summary[f"{split}.{part}"] = {"sequences": p["sequences"], "tokens": p["tokens"]}
                rows[f"{split}/{part}"] = {"seq_len": entry["seq_len"], "sequences": p["sequences"],
                                           "tokens": p["tokens"],
                                           "max_share_gap": round(max(abs(p["achieved"][d] - w)
                                                                      for d, w in entry["requested"].items()), 4)}
                for d, share in p["achieved"].items():
                    summary[f"{split}.{part}"][f"share.{d}"] = round(share, 5)
        summary["tokens_per_s"] = tokens_per_s
        write_json(METRICS / "pack.json", summary)
        plot_proportions({s: e["parts"]["train"]["achieved"] for s, e in manifest["splits"].items()},
                         {s: e["requested"] for s, e in manifest["splits"].items()}, PLOTS / "proportions.png")
        print(format_table(rows, ["seq_len", "sequences", "tokens", "max_share_gap"], key="split"))
        tracker.metrics({"tokens_per_s": tokens_per_s, "seconds": seconds})
        for key, values in summary.items():
            if isinstance(values, dict):
                tracker.metrics({f"{key}.{k}": v for k, v in values.items()})
        tracker.artifact(PACKED / "manifest.json")
        tracker.artifact(PLOTS / "proportions.png")


if __name__ == "__main__":
    main("pack", run, writes=(PACKED,))
