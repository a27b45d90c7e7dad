"""Running the evaluation on one checkpoint: task prompts answered by greedy decoding (our KV
cache, or `transformers` for an HF export), per-position loss, perplexity against length, and
short-context retention."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..config import EvalParams
from ..data.loader import PackedDataset
from ..data.tokenizer import TextTokenizer
from ..errors import ConfigError, DataError
from ..model import attention
from ..model.decode import generate_batch
from ..model.fox import Acp
from ..model.hf import native_config
from ..model.loss import IGNORE
from ..model.transformer import Transformer
from ..progress import progress
from . import helmet, needle, tasks
from .report import cells, length_cells, mean_scores


@dataclass(frozen=True)
class Encoder:
    """Prompt text -> token ids for one checkpoint: plain with BOS for pretrained models, the
    chat template (one user turn, then the answer prefix) for SFT models."""

    tok: TextTokenizer
    chat: bool

    def count(self, text: str) -> int:
        """Tokens of text, through encode_batch: it releases the GIL where encode holds it, so the
        prompts build_prompts fills on threads tokenize side by side (encode: no faster on 2 threads
        than on one)."""
        return len(self.tok.tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def prompt(self, p: tasks.Prompt) -> list[int]:
        return self.prompts([p])[0]

    def prompts(self, ps: list[tasks.Prompt]) -> list[list[int]]:
        """Prompts' ids, in one batch call of the tokenizer (it spreads them over the cores)."""
        if self.chat:
            texts = [self.tok.chat_prompt(f"{p.context}\n\n{p.question}") + p.answer_prefix for p in ps]
            head = []
        else:
            texts = [p.text() for p in ps]
            head = [self.tok.token_id(self.tok.bos_token, "bos")] if self.tok.bos_token else []
        return [head + e.ids for e in self.tok.tok.encode_batch(texts, add_special_tokens=False)]

    def eos(self) -> int | None:
        return self.tok.token_id(self.tok.eos_token, "eos") if self.tok.eos_token else None


def cell_size(task: str, samples: int, depths: int) -> int:
    """Prompts of a task at one length: `samples`, the single-needle noise task at least one per
    depth (the NIAH depth x length grid)."""
    return max(samples, depths) if task == "niah_single_noise" else samples


def build_prompts(enc: Encoder, names: list[str], lengths: list[int], samples: int, depths: list[float],
                  seed: int, haystack: str, wrappers: tuple[Encoder, ...] = (),
                  stop: threading.Event | None = None) -> list[tasks.Prompt]:
    """Every task at every length: `samples` prompts each, depths cycling; the single-needle
    noise task at least once at every depth (the NIAH depth x length grid). The same seed, the
    same prompts (a length's do not depend on the others asked).
    Each fits the length under `enc` and every one of `wrappers` (the chat template too: then the
    pretrained and the SFT checkpoints read the same texts). `stop`, once set, ends the building
    (Stopped) before the next prompt."""
    empty = tasks.Prompt("", 0, "", "", "", [""], "all", 0)
    wrap = max(len(e.prompt(empty)) for e in (enc, *wrappers))
    jobs = []
    for length in lengths:
        budget = tasks.Budget(enc.count, length, reserve=wrap + 8)
        for name in names:
            for i in range(cell_size(name, samples, len(depths))):
                jobs.append((name, budget, np.random.default_rng([seed, length, tasks.TASKS.index(name), i]),
                             depths[i % len(depths)]))

    def build(job: tuple) -> tasks.Prompt:
        if stop is not None and stop.is_set():
            raise Stopped
        return tasks.build(*job, haystack)

    with ThreadPoolExecutor() as pool:  # tokenizing (most of the time) runs outside the GIL: one prompt a core
        return list(pool.map(build, jobs))


class Stopped(Exception):
    """The prompt bank was closed while it was still building."""


class PromptBank:
    """The task prompts at every eval length and their token ids under each encoder (plain, and
    the chat template's), made on one background thread while checkpoints are scored: a length at
    a time from the shortest, the chat template's ids last. The first checkpoint starts on the
    shortest prompts as soon as they exist (filling 64K-token prompts to the token takes seconds
    each) and the SFT checkpoint finds its ids made. `order(enc, n)`: the prompts to batch in
    (`alike_first`)."""

    def __init__(self, encoders: tuple[Encoder, ...], ec: EvalParams, haystack: str):
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prompts")
        self._prompts: dict[int, Future] = {}
        self._ids: dict[tuple[bool, int], Future] = {}
        lengths = sorted(set(ec.lengths))
        for i, enc in enumerate(encoders):
            for n in lengths:
                if i == 0:
                    self._prompts[n] = self._pool.submit(build_prompts, enc, ec.tasks, [n], ec.samples, ec.depths,
                                                         ec.seed, haystack, encoders[1:], self._stop)
                self._ids[enc.chat, n] = self._pool.submit(self._encode, enc, n)

    def _encode(self, enc: Encoder, n: int) -> tuple[list[list[int]], list[int]]:
        ids = enc.prompts(self._prompts[n].result())
        return ids, alike_first(ids)

    def prompts(self, n: int) -> list[tasks.Prompt]:
        return self._prompts[n].result()

    def ids(self, enc: Encoder, n: int) -> list[list[int]]:
        return self._ids[enc.chat, n].result()[0]

    def order(self, enc: Encoder, n: int) -> list[int]:
        return self._ids[enc.chat, n].result()[1]

    def close(self) -> None:
        """Stop building (an error, Ctrl-C): the thread ends after its current prompt."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PromptBank:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def first_of_cells(prompts: list[tasks.Prompt], samples: int, depths: int) -> list[int]:
    """The indices of each task and length's first `cell_size` prompts, in order: a checkpoint
    asked fewer prompts asks a prefix of every cell, the prompts the others ask first."""
    seen: dict[tuple[str, int], int] = {}
    out = []
    for i, p in enumerate(prompts):
        k = seen[p.task, p.length] = seen.get((p.task, p.length), 0) + 1
        if k <= cell_size(p.task, samples, depths):
            out.append(i)
    return out


WEIGHTS = os.environ.get("LONGCTX_EVAL_WEIGHTS", "bf16")
"""A checkpoint's weights at eval on a GPU: bf16 (cast once) or fp32 (under bf16 autocast)."""


def inference_weights(model: Transformer) -> Transformer:
    """On a GPU, the model's floating-point parameters cast to bf16 once (buffers, ALiBi's slopes,
    stay fp32): the residual stream, norms and rotary tables then compute in bf16, as training's
    bf16 compute weights had them (train/precision.py). fp32 weights under autocast kept them in
    fp32: such elementwise kernels took >= 15% of a 64K prefill's GPU time, 44% at 4K
    (bench/results/eval-throughput/eval-throughput-nvidia-h200-2026-12-03). LONGCTX_EVAL_WEIGHTS=fp32 keeps
    those. In place; returns the model."""
    if WEIGHTS not in ("bf16", "fp32"):
        raise ConfigError(f"LONGCTX_EVAL_WEIGHTS={WEIGHTS!r}: give bf16 or fp32")
    if WEIGHTS == "bf16" and next(model.parameters()).is_cuda:
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(torch.bfloat16)
    return model


def pruned(model: Transformer, eps: float | None, name: str) -> Transformer:
    """The model with ACP at `eps` (eval.acp_eps; None: as it is): a FoX checkpoint through the
    'fox' kernel, else a ConfigError naming the checkpoint. In place; returns the model."""
    if eps is None:
        return model
    if model.cfg.fox is None:
        raise ConfigError(f"eval.acp_eps: checkpoint {name} is not a FoX model (ACP prunes FoX attention)")
    device = next(model.parameters()).device
    backend = attention.resolve(model.attention_backend, device, True)
    if backend != "fox":
        raise ConfigError(f"eval.acp_eps: checkpoint {name} attends with {backend!r} on {device.type}; ACP "
                          "needs the 'fox' kernel (CUDA, or Triton's interpreter)")
    model.acp = Acp(eps)
    return model


Answerer = Callable[[list[list[int]], list[int]], list[list[int]]]
"""Prompts' token ids and each one's new-token budget -> each one's new tokens."""


def our_answerer(model: Transformer, eos: int | None) -> Answerer:
    """Our KV cache, the prompts of one call decoded together."""
    device = next(model.parameters()).device

    def answer(batch: list[list[int]], max_new: list[int]) -> list[list[int]]:
        prompts = [torch.tensor(ids, device=device) for ids in batch]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = generate_batch(model, prompts, max_new, eos)
        return [o[len(ids):].tolist() for o, ids in zip(out, batch, strict=True)]

    return answer


def hf_answerer(folder, eos: int | None, dtype: torch.dtype = torch.float32) -> Answerer:
    """Greedy decoding with transformers on an HF export of the checkpoint."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    if torch.cuda.is_available():
        hf = hf.cuda()

    @torch.no_grad()
    def answer(batch: list[list[int]], max_new: list[int]) -> list[list[int]]:
        outs = []
        for ids, n in zip(batch, max_new, strict=True):  # one at a time: no padding to reason about
            x = torch.tensor([ids], device=hf.device)
            out = hf.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos or 0)
            outs.append(out[0, len(ids):].tolist())
        return outs

    return answer


Part = tuple[list[tasks.Prompt], list[list[int]], list[int]]
"""Prompts, their token ids, and the order to batch them in."""


def part(prompts: list[tasks.Prompt], encoded: list[list[int]]) -> Part:
    """Prompts batched longest first (a batch of about one length)."""
    return prompts, encoded, sorted(range(len(prompts)), key=lambda i: -len(encoded[i]))


def alike_first(encoded: list[list[int]]) -> list[int]:
    """Prompts (of one length) in the order of their ids: those that begin alike side by side, so
    that a batch holds them together and prefills their common prefix once."""
    return sorted(range(len(encoded)), key=encoded.__getitem__)


def run_tasks(answer: Answerer, enc: Encoder, parts: Iterable[Part], desc: str, batch_tokens: int = 65536,
              total: int | None = None) -> tuple[list[dict], dict]:
    """Score every prompt of each part, in the part's order up to `batch_tokens` prompt tokens a
    call of `answer`; returns rows in the parts' and their prompts' order, and throughput. Parts
    may come as they are made (`total`: their prompts, for the progress bar)."""
    if total is None:
        parts = list(parts)
        total = sum(len(p) for p, *_ in parts)
    rows: list[dict] = []
    tokens, start = 0, time.perf_counter()
    eos = enc.eos()
    with progress(total=total, desc=desc, unit="prompt") as bar:
        for prompts, encoded, order in parts:
            scored: list[dict | None] = [None] * len(prompts)
            for run in needle.groups([len(encoded[i]) for i in order], batch_tokens):
                batch = [order[j] for j in run]
                outs = answer([encoded[i] for i in batch], [prompts[i].max_new_tokens for i in batch])
                for i, out in zip(batch, outs, strict=True):
                    p, ids = prompts[i], encoded[i]
                    if eos is not None and eos in out:
                        out = out[:out.index(eos)]
                    text = enc.tok.tok.decode(out)
                    tokens += len(ids) + len(out)
                    scored[i] = {"task": p.task, "length": p.length, "depth": p.meta.get("depth"),
                                 "score": tasks.score(p, text), "output": text[:200], "gold": p.gold,
                                 "prompt_tokens": len(ids)}
                bar.update(len(batch))
            rows += scored
    seconds = time.perf_counter() - start
    return rows, {"prompts_per_s": len(rows) / max(seconds, 1e-9), "tokens_per_s": tokens / max(seconds, 1e-9),
                  "seconds": seconds}


def smooth(values: np.ndarray, points: int = 64) -> tuple[list[int], list[float]]:
    """Per-position losses averaged over equal windows (a readable curve)."""
    edges = np.unique(np.linspace(0, len(values), points + 1).astype(int))
    return ([int(b) for b in edges[1:]],
            [float(values[a:b].mean()) for a, b in zip(edges[:-1], edges[1:], strict=True)])


@torch.no_grad()
def mean_loss(model: Transformer, docs: list[np.ndarray], masks: list[np.ndarray | None] | None = None) -> float:
    """Token-averaged next-token loss over documents (masks: 1 where the target counts)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i, d in enumerate(docs):
        ids = torch.from_numpy(np.asarray(d, dtype=np.int64)).to(device)
        labels = torch.full_like(ids, IGNORE)
        labels[:-1] = ids[1:]
        if masks is not None and masks[i] is not None:
            labels[:-1][torch.from_numpy(np.asarray(masks[i][1:]) == 0).to(device)] = IGNORE
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            total += float(model(ids, labels=labels))
        count += int((labels != IGNORE).sum())
    return total / max(count, 1)


class Window(NamedTuple):
    """A checkpoint's context window: the length it was trained to (None: no limit of its own:
    no RoPE and no learned table) and whether it cannot run past it at all (`hard`: a learned
    table that stops at its end). Beyond a soft window the checkpoint is evaluated and marked."""

    length: int | None
    hard: bool = False


def windows(folders: dict[str, Path], tok: TextTokenizer, tok_folder: Path,
            lengths: list[int]) -> dict[str, Window]:
    """Each checkpoint's Window, read from its config so that a checkpoint the tokenizer does not
    fit, or eval lengths beyond every checkpoint's window, stop the evaluation before any
    checkpoint is evaluated."""
    out = {}
    for name, folder in folders.items():
        mcfg = native_config(folder)
        if tok.vocab_size > mcfg.vocab_size:
            raise DataError(f"{tok_folder}: {tok.vocab_size} tokens but checkpoint {folder} has a "
                            f"vocabulary of {mcfg.vocab_size}: the tokenizer does not match the checkpoint")
        hard = mcfg.learned_positions is not None and mcfg.learned_positions.beyond == "error"
        out[name] = Window(mcfg.max_position_embeddings if mcfg.rope is not None or hard else None, hard)
    longest = max(w.length or 10**9 for w in out.values())
    too_long = [n for n in lengths if n > longest]
    if too_long:
        raise ConfigError(f"eval.lengths: {too_long} exceed every checkpoint's window (the longest is {longest})")
    return out


def perplexities(results: dict, name: str, model: Transformer, data: PackedDataset, tok: TextTokenizer,
                 ec: EvalParams) -> list[dict]:
    """Per-position loss at the longest length documents reach (its mean in each band between the
    eval lengths, too), perplexity and needle perplexity at every eval length documents reach
    (inside and beyond the training window), into `results` under `name`; returns the smoothed
    per-position loss as rows (a CSV and a plot)."""
    reach = [n for n in sorted(set(ec.lengths) | {data.seq_len}) if n <= data.seq_len]
    docs_at = {n: needle.long_documents(data, n)[:ec.position_sequences] for n in reach}
    reach = [n for n in reach if docs_at[n]]
    if not reach:
        results["skipped"].append({"checkpoint": name, "task": "perplexity", "reason": "no long validation documents"})
        return []
    top = reach[-1]
    losses = needle.position_loss(model, [data[i].input_ids[:top] for i in docs_at[top]])
    curve = [{"checkpoint": name, "position": pos, "loss": value} for pos, value in zip(*smooth(losses), strict=True)]
    edges = [0, *reach]  # the loss by position in bands between the eval lengths: what longer training changed
    results["position_loss"][name] = {"positions": top, "mean": float(losses.mean()), "documents": len(docs_at[top]),
                                      "bands": {f"{a}-{b}": float(losses[a:b].mean())
                                                for a, b in zip(edges[:-1], edges[1:], strict=True)}}
    results["ppl_by_length"][name] = {
        n: needle.perplexity(mean_loss(model, [data[i].input_ids[:n] for i in docs_at[n]])) for n in reach}
    results["needle_ppl"][name] = {}
    for n in reach:
        try:
            seqs = needle.sequences(data, tok, n, min(ec.needle_sequences, len(docs_at[n])), 0.05, ec.seed)
        except DataError as e:
            results["skipped"].append({"checkpoint": name, "task": "needle_ppl", "length": n, "reason": str(e)})
            continue
        results["needle_ppl"][name][n] = needle.perplexity(needle.needle_nll(model, seqs))
    return curve


def evaluate(results: dict, name: str, model: Transformer, folder: Path, enc: Encoder, ec: EvalParams,
             data: PackedDataset, window: Window, short: PackedDataset | None,
             bank: PromptBank) -> tuple[list[dict], list[dict]]:
    """Everything measured on one checkpoint, into `results` under `name`: the task prompts of
    `bank` at every eval length, also beyond its window (the comparison that shows what
    long-context training did; `results["windows"]` marks them), except past a hard window
    (skipped, with the reason); perplexities on the long documents of `data`; lm-eval tasks;
    perplexity on the short sequences of `short`. Returns the scored prompt rows and the
    per-position loss rows."""
    results["windows"][name] = window.length
    lengths = [n for n in sorted(set(ec.lengths)) if not (window.hard and n > window.length)]
    for n in sorted(set(ec.lengths) - set(lengths)):
        results["skipped"].append({"checkpoint": name, "length": n, "reason": f"beyond the checkpoint's window "
                                   f"{window.length} (its learned position table stops there)"})
    samples = ec.samples_by_checkpoint.get(name, ec.samples)
    extra = helmet.prompts(results, name, enc.count, ec, lengths)

    def parts() -> Iterable[Part]:
        """Each length's chosen prompts as the bank makes them, shortest first, then HELMET's."""
        for n in lengths:
            chosen = first_of_cells(bank.prompts(n), samples, len(ec.depths))
            at = {i: j for j, i in enumerate(chosen)}
            yield ([bank.prompts(n)[i] for i in chosen], [bank.ids(enc, n)[i] for i in chosen],
                   [at[i] for i in bank.order(enc, n) if i in at])
        if extra:
            yield part(extra, enc.prompts(extra))

    total = len(lengths) * sum(cell_size(t, samples, len(ec.depths)) for t in ec.tasks) + len(extra)
    answer = (hf_answerer(folder / "hf", enc.eos()) if ec.backend == "transformers"
              else our_answerer(model, enc.eos()))
    rows, speed = run_tasks(answer, enc, parts(), f"eval {name}", ec.batch_tokens, total)
    for r in rows:
        r["checkpoint"] = name
    results["tasks"][name] = mean_scores(rows)
    results["cells"][name] = cells(rows)
    results["means"][name] = length_cells(rows)
    if model.acp is not None and (skipped := model.acp.stats.pruned_fraction()) is not None:
        speed["acp_pruned"] = skipped  # the share of causal tiles the prompts' prefill skipped
    results["throughput"][name] = speed
    curve = perplexities(results, name, model, data, enc.tok, ec)
    if ec.lm_eval_tasks:
        from . import lm_harness  # lm-eval only when its tasks are asked for (GPU images lack it)

        lm_harness.retention(results, name, model, enc.tok, ec)
    if short is not None:
        seqs = [short[i] for i in range(min(ec.retention_sequences, len(short)))]
        results["retention_ppl"][name] = needle.perplexity(mean_loss(model, [s.input_ids for s in seqs]))
    return rows, curve
