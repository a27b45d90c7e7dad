"""What it takes for the tiny profile's base model to retrieve (issue 18): train a small model on
synthetic retrieval documents (data/synthetic.py, the corpora stage's source) mixed with real
short text, and score the eval's own passkey and NIAH-single prompts (eval/suite.py) at the
window's length as training goes, with the teacher-forced loss of their answers (it falls
before greedy answers come right). The training is the stages' math in fp32 on any device (the
CPU's path), so a GPU runs many variants side by side, one process each, far faster than the
2-core machine the tiny profile is timed on; `train_s` here is the GPU's, not that machine's.

    python bench/tiny_retrieval.py --tokens data/tokens --variants tiny d128 --parallel 2

`--tokens`: a tokenize stage's output (its tokenizer and the --text domains' shards). Findings:
docs/retrieval.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import multiprocessing
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from longctx.config.train_params import RunParams
from longctx.data.loader import PackedDataset, Sample
from longctx.data.shards import ShardReader
from longctx.data.synthetic import documents
from longctx.data.tokenizer import TextTokenizer
from longctx.eval import tasks
from longctx.eval.suite import Encoder, build_prompts
from longctx.model.config import ModelConfig, RopeConfig
from longctx.model.decode import generate
from longctx.perf import write_result
from longctx.train.batches import make_batch
from longctx.train.loop import prepare, queue_step
from longctx.train.models import build, load_model
from longctx.train.optim import adamw, lr_at
from longctx.train.parallel import Parallel

Sequence = tuple[np.ndarray, list[int]]
"""A packed sequence: token ids and its document lengths."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """Defaults: the tiny base's training (src/longctx/profiles/tiny-scratch.yaml)."""

    steps: int = 1000
    batch: int = 16
    seq_len: int = 512
    lr: float = 6e-3
    lr_min: float = 6e-4
    warmup: float = 0.05
    weight_decay: float = 0.1
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 2
    ffn_dim: int = 192
    theta: float = 10000.0
    share: float = 0.9
    """Token share of synthetic sequences (the rest real short text)."""
    formats: tuple[str, ...] = ("passkey", "kv", "multiquery")
    min_chars: int = 120
    max_chars: int = 1200
    whole: bool = True
    """Documents never cut across sequences (the pack stage's kind `whole`); False: cut with
    carry-over (kind `short`)."""
    short_first: float = 0.0
    """Share of the steps trained first on short documents alone (min_chars to SHORT_CHARS), the
    rest on the whole [min_chars, max_chars]: a curriculum, retrieval learned near then far."""
    seed: int = 0
    path: str = "fp32"
    """"fp32": the CPU's math (sdpa, fp32, eager AdamW) on any device; "stage": what a training
    stage runs on its device (`auto` attention, prepare()'s bf16 compute weights and compiled
    blocks on a GPU, queue_step's fused AdamW), to check the GPU's fast path learns as the CPU's."""
    backend: str = ""
    """The attention backend (default: the path's, sdpa or auto)."""
    compile: bool = True
    """path "stage": compiled blocks on a GPU (RunParams.compile)."""
    splits: tuple[str, ...] = ()
    """The pack stage's splits under --packed instead of generated sequences: the first short_first
    of the steps from the first, the rest from the second (a stage's curriculum), each in seeded
    order; seq_len and the text share are then the splits'."""


SHORT_CHARS = 1200

VARIANTS: dict[str, Variant] = {
    "tiny": Variant(),
    "tiny_seed1": Variant(seed=1),
    "tiny_seed2": Variant(seed=2),
    "d128": Variant(d_model=128, n_heads=4, ffn_dim=384, lr=3e-3, lr_min=3e-4),
    "carry": Variant(whole=False),
    "share07": Variant(share=0.7),
    "long_docs": Variant(max_chars=2000),
    "stage": Variant(path="stage"),
    "stage_seed2": Variant(path="stage", seed=2),
    "tiny_seed2_fp32": Variant(seed=2),
    "d128_stage": Variant(d_model=128, n_heads=4, ffn_dim=384, lr=3e-3, lr_min=3e-4, path="stage"),
    "stage_sdpa": Variant(path="stage", backend="sdpa"),
    "stage_eager": Variant(path="stage", compile=False),
    # gpu-64k's base shape and schedule (~100M parameters, 4,096 tokens, 500 x 16) on this data
    "base100m": Variant(steps=500, seq_len=4096, d_model=768, n_layers=12, n_heads=12, ffn_dim=2048, lr=2e-3,
                        lr_min=2e-4, path="stage"),
    # and with gpu-64k's base-length retrieval documents too (retrieval across the whole window)
    "base100m_4k": Variant(steps=500, seq_len=4096, d_model=768, n_layers=12, n_heads=12, ffn_dim=2048,
                           lr=6e-4, lr_min=6e-5, max_chars=13000, path="stage"),
    # the same tokens in twice the updates (8 x 4,096 a step)
    "base100m_4k_b8": Variant(steps=1000, batch=8, seq_len=4096, d_model=768, n_layers=12, n_heads=12, ffn_dim=2048,
                              lr=6e-4, lr_min=6e-5, max_chars=13000, path="stage"),
    # 52M tokens, or the first half on short documents alone
    "base100m_4k_800": Variant(steps=800, seq_len=4096, d_model=768, n_layers=12, n_heads=12, ffn_dim=2048,
                               lr=6e-4, lr_min=6e-5, max_chars=13000, path="stage"),
    "base100m_4k_cur": Variant(steps=500, seq_len=4096, d_model=768, n_layers=12, n_heads=12, ffn_dim=2048,
                               lr=6e-4, lr_min=6e-5, max_chars=13000, short_first=0.5, path="stage"),
    # base100m_4k_cur on the pack stage's splits (gpu-64k's base_short then base): the pipeline's data
    "base100m_packed": Variant(steps=500, seq_len=4096, d_model=768, n_layers=12, n_heads=12, ffn_dim=2048,
                               lr=6e-4, lr_min=6e-5, short_first=0.5, splits=("base_short", "base"), path="stage"),
    "base100m_lr6e-4": Variant(steps=500, seq_len=4096, d_model=768, n_layers=12, n_heads=12, ffn_dim=2048,
                               lr=6e-4, lr_min=6e-5, path="stage"),
}


class Packed:
    """In-memory packed sequences in the PackedDataset interface the training loop reads."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> Sample:
        ids, lens = self.seqs[i]
        return Sample(ids, np.asarray(lens, dtype=np.int64), np.zeros(len(lens), dtype=np.int64), None)


class FromSplits:
    """The steps' sequences drawn from packed splits in turn, as a stage's curriculum reads them."""

    def __init__(self, parts: list[tuple[PackedDataset, int]], rng: np.random.Generator):
        self.picks = [(data, int(i)) for data, n in parts
                      for i in np.concatenate([rng.permutation(len(data)) for _ in range(-(-n // len(data)))])[:n]]

    def __len__(self) -> int:
        return len(self.picks)

    def __getitem__(self, i: int) -> Sample:
        data, j = self.picks[i]
        return data[j]


def synthetic_sequences(tok: TextTokenizer, v: Variant, n: int) -> list[Sequence]:
    docs = documents(v.seed, list(v.formats), v.min_chars, v.max_chars)
    out, ids, lens = [], [], []
    carry: np.ndarray | None = None
    while len(out) < n:
        doc = carry if carry is not None else tok.encode_texts([next(docs)[1]], True, True)[0]
        carry = None
        room = v.seq_len - sum(lens)
        if len(doc) > room:
            carry = None if v.whole else doc[room:]
            doc = doc[:room]
        ids.append(doc)
        lens.append(len(doc))
        if sum(lens) == v.seq_len:
            out.append((np.concatenate(ids).astype(np.int64), lens))
            ids, lens = [], []
    return out


def text_sequences(readers: list[ShardReader], seq_len: int, n: int) -> list[Sequence]:
    """Real short documents concatenated and cut every seq_len tokens (carry-over)."""
    out, ids, lens = [], [], []
    if n <= 0:
        return out
    for reader in itertools.cycle(readers):
        for d in range(len(reader.docs)):
            doc = reader.tokens(d).astype(np.int64)
            while len(doc):
                take = doc[:seq_len - sum(lens)]
                ids.append(take)
                lens.append(len(take))
                doc = doc[len(take):]
                if sum(lens) == seq_len:
                    out.append((np.concatenate(ids), lens))
                    ids, lens = [], []
                    if len(out) == n:
                        return out
    return out


def answer_nll(model, enc: Encoder, prompts: list[tasks.Prompt], device: torch.device) -> float:
    """Mean per-token loss of each prompt's gold answer (" <gold>.") after the prompt."""
    total, count = 0.0, 0
    for p in prompts:
        ids = enc.prompt(p)
        gold = enc.tok.tok.encode(" " + p.gold[0] + ".", add_special_tokens=False).ids
        with torch.no_grad():
            logits = model(torch.tensor(ids + gold, device=device))[len(ids) - 1:-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(gold, device=device), reduction="sum"))
        count += len(gold)
    return total / max(count, 1)


def scores(model, enc: Encoder, prompts: list[tasks.Prompt], device: torch.device) -> dict:
    """Each task's accuracy by greedy decoding, and the first answers (to see what it says)."""
    by_task: dict[str, list[float]] = {}
    answers = []
    eos = enc.eos()
    for p in prompts:
        ids = enc.prompt(p)
        with torch.no_grad():
            out = generate(model, torch.tensor(ids, device=device), p.max_new_tokens, eos)[len(ids):].tolist()
        text = enc.tok.tok.decode(out[:out.index(eos)] if eos in out else out)
        by_task.setdefault(p.task, []).append(tasks.score(p, text))
        answers.append(text[:24])
    return {t: float(np.mean(s)) for t, s in by_task.items()} | {"answers": answers[:4]}


def training_data(v: Variant, tok: TextTokenizer, readers: list[ShardReader], packed: Path) -> Packed | FromSplits:
    rng = np.random.default_rng(v.seed)
    first = round(v.steps * v.short_first) * v.batch
    if v.splits:
        parts = [PackedDataset(packed / split / "train") for split in v.splits]
        if any(p.seq_len != v.seq_len for p in parts):
            raise ValueError(f"{v.splits}: packed at {[p.seq_len for p in parts]} tokens, the variant at {v.seq_len}")
        counts = [first, v.steps * v.batch - first] if len(parts) == 2 else [v.steps * v.batch]
        return FromSplits(list(zip(parts, counts, strict=True)), rng)
    data = []
    for n, part in ((first, dataclasses.replace(v, max_chars=SHORT_CHARS)), (v.steps * v.batch - first, v)):
        if n == 0:
            continue
        n_syn = round(n * v.share)
        seqs = synthetic_sequences(tok, part, n_syn) + text_sequences(readers, v.seq_len, n - n_syn)
        data += [seqs[i] for i in rng.permutation(len(seqs))]
    return Packed(data)


def score_rows(model, enc: Encoder, prompts: list[tasks.Prompt], lengths: list[int], device: torch.device,
               bf16: bool) -> dict:
    """Answer loss and accuracy at each length (bf16 autocast: as the eval stage runs a GPU model)."""
    row = {}
    scoring = torch.autocast("cuda", torch.bfloat16) if bf16 else nullcontext()
    for n in lengths:
        at_n = [p for p in prompts if p.length == n]
        with scoring:
            row[f"nll_{n}"] = answer_nll(model, enc, at_n, device)
            row |= {f"{k}_{n}": s for k, s in scores(model, enc, at_n, device).items()}
    return row


def task_prompts(enc: Encoder, lengths: list[int], per_task: int) -> list[tasks.Prompt]:
    depths = [float(d) for d in np.linspace(0.05, 0.95, per_task)]
    return build_prompts(enc, ["passkey", "niah_single_noise"], lengths, per_task, depths, 1, "")


def fit(model, v: Variant, data: Packed | FromSplits, device: torch.device,
        on_eval: Callable[[int, float], None] | None = None, evals: int = 0) -> None:
    """Train `model` in place for v.steps steps of v.batch sequences (the variant's path and
    schedule), calling on_eval(step, loss) `evals` times along the way, in eval mode."""
    if v.path not in ("fp32", "stage"):
        raise ValueError(f"path: {v.path!r} is not fp32 or stage")
    stage = v.path == "stage"
    par = Parallel(device=device)
    if stage:
        prepare(model, RunParams(steps=v.steps, micro_batch=v.batch, lr=v.lr, seed=v.seed, compile=v.compile), par)
    opt = adamw(model, v.lr, (0.9, 0.95), v.weight_decay)
    at = {round(v.steps * (i + 1) / evals) for i in range(evals)}
    model.train()
    for step in range(v.steps):
        b = make_batch(data, list(range(step * v.batch, (step + 1) * v.batch)), device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, v.steps, v.lr, v.warmup, v.lr_min)
        if stage:
            loss = torch.tensor(queue_step(model, opt, [b], par, 1.0).result()[0])
        else:
            loss = model(b.ids, b.cu_seqlens.tolist(), labels=b.labels) / b.valid
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if on_eval is not None and step + 1 in at:
            model.eval()
            on_eval(step + 1, float(loss.detach()))
            model.train()
    model.eval()


def new_model(v: Variant, tok: TextTokenizer, device: torch.device):
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=v.d_model, n_layers=v.n_layers, n_heads=v.n_heads,
                      ffn_dim=v.ffn_dim, max_position_embeddings=v.seq_len, rope=RopeConfig(theta=v.theta))
    return build(cfg, v.backend or ("auto" if v.path == "stage" else "sdpa"), v.seed, device)


def run(name: str, v: Variant, tok: TextTokenizer, data: Packed | FromSplits, device: torch.device,
        evals: int, lengths: list[int], per_task: int) -> dict:
    """Train one variant, scoring `evals` times along the way; its rows."""
    model = new_model(v, tok, device)
    enc = Encoder(tok, chat=False)
    prompts = task_prompts(enc, lengths, per_task)
    rows, t0, scoring_s = [], time.perf_counter(), 0.0

    def on_eval(step: int, loss: float) -> None:
        nonlocal scoring_s
        start = time.perf_counter()
        row = {"step": step, "tokens": step * v.batch * v.seq_len, "loss": loss,
               "train_s": start - t0 - scoring_s}  # the training alone
        row |= score_rows(model, enc, prompts, lengths, device, v.path == "stage" and device.type == "cuda")
        rows.append(row)
        print(name, json.dumps(row), flush=True)
        scoring_s += time.perf_counter() - start

    fit(model, v, data, device, on_eval, evals)
    return {"variant": name, **dataclasses.asdict(v), "rows": rows, "seconds": time.perf_counter() - t0}


def _job(job: tuple[str, Variant, argparse.Namespace]) -> dict:
    name, v, args = job
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = TextTokenizer.load(args.tokens / "tokenizer")
    readers = [] if v.splits else [ShardReader(args.tokens / d) for d in args.text]
    data = training_data(v, tok, readers, args.packed)
    return run(name, v, tok, data, device, args.evals, args.lengths, args.prompts)


def score_checkpoints(args: argparse.Namespace) -> list[dict]:
    """A stage's saved models (models/<name>), loaded as the eval stage loads them, scored here; an
    SFT model (a folder named sft) asked in the chat template, as the eval asks it."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = TextTokenizer.load(args.tokens / "tokenizer")
    out = []
    for folder in args.score:
        enc = Encoder(tok, chat=folder.name == "sft")
        prompts = task_prompts(enc, args.lengths, args.prompts)
        model = load_model(folder).to(device).eval()
        row = {"step": 0, "tokens": 0} | score_rows(model, enc, prompts, args.lengths, device, device.type == "cuda")
        print(folder, json.dumps(row), flush=True)
        out.append({"variant": str(folder), "rows": [row]})
    return out


def _parse(kind: str, value: str):
    if kind.startswith("tuple"):
        return tuple(x for x in value.split(",") if x)  # "splits=": none (generated sequences)
    return {"int": int, "float": float, "str": str, "bool": lambda x: x.lower() in ("1", "true")}[kind](value)


def variant_fields(pairs: list[str]) -> dict:
    """FIELD=VALUE pairs as typed Variant fields (ValueError naming unknown ones)."""
    types = {f.name: f.type for f in dataclasses.fields(Variant)}
    unknown = [kv.split("=", 1)[0] for kv in pairs if kv.split("=", 1)[0] not in types]
    if unknown:
        raise ValueError(f"unknown fields {unknown} (known: {sorted(types)})")
    return {k: _parse(types[k], v) for k, v in (kv.split("=", 1) for kv in pairs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=Path, default=Path("data/tokens"))
    ap.add_argument("--text", nargs="+", default=["docstrings", "modules"], help="domains of real short text")
    ap.add_argument("--packed", type=Path, default=Path("data/packed"), help="the pack stage's splits (Variant.splits)")
    ap.add_argument("--score", type=Path, nargs="+", default=[], help="score these saved models instead of training")
    ap.add_argument("--variants", nargs="+", default=["tiny"], choices=sorted(VARIANTS))
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override fields of every variant")
    ap.add_argument("--evals", type=int, default=5, help="scorings over the run")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512])
    ap.add_argument("--prompts", type=int, default=16, help="prompts per task and length")
    ap.add_argument("--parallel", type=int, default=1, help="variants run side by side (processes)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/tiny-retrieval"),
                   help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    args = ap.parse_args()
    try:
        overrides = variant_fields(args.set)
    except ValueError as e:
        ap.error(f"--set: {e}")
    jobs = [(n, dataclasses.replace(VARIANTS[n], **overrides), args) for n in args.variants]
    if args.score:
        results = score_checkpoints(args)
    elif args.parallel > 1:
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.parallel, mp_context=spawn) as pool:
            results = list(pool.map(_job, jobs))
    else:
        results = [_job(j) for j in jobs]
    print(f"{'variant':>12} {'tokens':>10}  answer nll / passkey / NIAH-single accuracy, at each length")
    for r in results:
        for row in r["rows"]:
            cells = "  ".join(f"{n}: {row[f'nll_{n}']:.2f} / {row[f'passkey_{n}']:.2f} / "
                              f"{row[f'niah_single_noise_{n}']:.2f}" for n in args.lengths)
            print(f"{r['variant']:>12} {row['tokens']:>10,}  {cells}")
    write_result(args.out, "tiny_retrieval", {"results": results}, None if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
