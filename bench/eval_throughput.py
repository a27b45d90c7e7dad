"""Eval throughput on one GPU: prompts/s and tokens/s of the eval stage's greedy
decoding for a 125M model at 4K and 16K prompts: ours (attention backend for the prompt, KV cache
after) against transformers' generate on the HF export of the same weights (the peer, same run),
and FoX (Pro) with ours. Random weights (speed does not depend on them); answers are checked to
agree between ours and transformers.

    python bench/eval_throughput.py --tokenizer data/tokens/tokenizer --out bench/results
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from longctx.data.tokenizer import TextTokenizer
from longctx.eval import suite
from longctx.model.hf import save_hf
from longctx.model.transformer import Transformer
from longctx.perf import write_result
from longctx.train.models import build, preset

TASKS = ["niah_single_noise", "json_kv", "variable_tracking", "passkey"]


def model(fox: bool, vocab: int) -> Transformer:
    cfg = preset("fox-125m", "fox" if fox else "llama", 32768).model_copy(update={"vocab_size": vocab})
    return build(cfg, device="cuda").eval()


def timed(answer, enc: suite.Encoder, prompts) -> tuple[dict, list[list[int]]]:
    answer(enc.prompt(prompts[0]), 4)  # warm-up (compilation, allocator)
    torch.cuda.synchronize()
    outs, tokens, t0 = [], 0, time.perf_counter()
    for p in prompts:
        ids = enc.prompt(p)
        out = answer(ids, p.max_new_tokens)
        outs.append(out)
        tokens += len(ids) + len(out)
    torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    return {"prompts": len(prompts), "seconds": round(sec, 3), "prompts_per_s": round(len(prompts) / sec, 3),
            "tokens_per_s": round(tokens / sec)}, outs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--per-task", type=int, default=3)
    args = parser.parse_args()
    tok = TextTokenizer.load(args.tokenizer)
    enc = suite.Encoder(tok, chat=False)
    vocab = max(tok.vocab_size, 32000)
    rows = []
    for length in (4096, 16384):
        prompts = suite.build_prompts(enc, TASKS, [length], args.per_task, [0.5], 0, tasks_text())
        llama = model(False, vocab)
        with tempfile.TemporaryDirectory() as d:
            save_hf(llama, Path(d) / "hf", args.tokenizer)
            ours, ours_out = timed(suite.our_answerer(llama, enc.eos()), enc, prompts)
            peer, peer_out = timed(suite.hf_answerer(Path(d) / "hf", enc.eos(), dtype=torch.bfloat16), enc, prompts)
        agree = sum(a[:8] == b[:8] for a, b in zip(ours_out, peer_out, strict=True)) / len(prompts)
        rows.append({"length": length, "model": "Transformer", "ours": ours, "transformers": peer,
                     "speedup_vs_transformers": round(ours["prompts_per_s"] / peer["prompts_per_s"], 3),
                     "first_8_tokens_agree": agree})
        del llama
        fox = model(True, vocab)
        fox_row, _ = timed(suite.our_answerer(fox, enc.eos()), enc, prompts)
        rows.append({"length": length, "model": "FoX (Pro)", "ours": fox_row})
        del fox
        torch.cuda.empty_cache()
        print(rows[-2], rows[-1], flush=True)
    print(f"{'length':>7} {'model':<12} {'ours prompts/s':>15} {'tok/s':>9} {'transformers':>13} {'ratio':>6}")
    for r in rows:
        peer = r.get("transformers", {})
        print(f"{r['length']:>7} {r['model']:<12} {r['ours']['prompts_per_s']:>15} {r['ours']['tokens_per_s']:>9} "
              f"{peer.get('prompts_per_s', '-'):>13} {r.get('speedup_vs_transformers', '-'):>6}")
    write_result(args.out, "eval_throughput", {"shape": "125m", "tasks": TASKS, "rows": rows})


def tasks_text() -> str:
    return "A long text about nothing in particular, repeated to make a haystack. " * 50


if __name__ == "__main__":
    main()
