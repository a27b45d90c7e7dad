"""Our checkpoints as an lm-eval-harness model, for the short-context retention tasks (HellaSwag,
ARC-c, WinoGrande, MMLU, GSM8K): log-likelihoods from one forward per request, greedy
generation with our KV cache."""

from __future__ import annotations

import torch
from lm_eval.api.model import LM
from tqdm import tqdm

from ..config import EvalParams
from ..data.tokenizer import TextTokenizer
from ..model.decode import generate
from ..model.transformer import Transformer


class LongctxLM(LM):
    def __init__(self, model: Transformer, tok: TextTokenizer, max_length: int | None = None):
        super().__init__()
        self.model = model.eval()
        self.tok = tok
        self._device = next(model.parameters()).device
        self.max_length = max_length or model.cfg.max_position_embeddings
        self.bos = tok.token_id(tok.bos_token, "bos") if tok.bos_token else None
        self.eos = tok.token_id(tok.eos_token, "eos") if tok.eos_token else None

    def _encode(self, text: str) -> list[int]:
        return self.tok.tok.encode(text, add_special_tokens=False).ids

    @torch.no_grad()
    def _logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) and whether every token is the greedy choice."""
        ids = ([self.bos] if self.bos is not None else []) + context + continuation
        ids = ids[-(self.max_length + 1):]
        x = torch.tensor(ids[:-1], device=self._device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self._device.type == "cuda"):
            logits = self.model(x).float()
        tail = logits[-len(continuation):].log_softmax(-1)
        target = torch.tensor(continuation, device=self._device)
        total = float(tail.gather(1, target[:, None]).sum())
        return total, bool((tail.argmax(-1) == target).all())

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in tqdm(requests, desc="lm-eval loglikelihood", disable=disable_tqdm):
            context, continuation = req.args
            # split at the whitespace boundary the way harness models do: spaces go with the continuation
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, ctx = self._encode(context + continuation), self._encode(context)
            cont = whole[len(ctx):] if whole[:len(ctx)] == ctx and len(whole) > len(ctx) else self._encode(continuation)
            out.append(self._logprob(ctx, cont))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, desc="lm-eval rolling", disable=disable_tqdm):
            ids = self._encode(req.args[0])
            total, start = 0.0, 0
            while start < len(ids):  # non-overlapping windows of the model's length
                chunk = ids[start:start + self.max_length]
                total += self._logprob(ids[max(0, start - 1):start] if start else [], chunk)[0]
                start += self.max_length
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in tqdm(requests, desc="lm-eval generate", disable=disable_tqdm):
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else until
            ids = ([self.bos] if self.bos is not None else []) + self._encode(context)
            prompt = torch.tensor(ids[-self.max_length:], device=self._device)
            new = generate(self.model, prompt, int(kwargs.get("max_gen_toks", 256)), self.eos)[len(prompt):]
            text = self.tok.tok.decode(new.tolist())
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def evaluate(model: Transformer, tok: TextTokenizer, task_names: list[str], include_path: str | None = None,
             limit: int | None = None) -> dict[str, dict]:
    """Run lm-eval tasks (registry names, or YAML tasks under include_path) on our model; returns
    each task's metrics."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    result = simple_evaluate(model=LongctxLM(model, tok), tasks=task_names, task_manager=manager, limit=limit,
                             log_samples=False)
    return {name: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            for name, metrics in result["results"].items()}


def retention(results: dict, name: str, model: Transformer, tok: TextTokenizer, ec: EvalParams) -> None:
    """Short-context retention of checkpoint `name` through lm-eval-harness; a task whose data
    cannot be had is reported as skipped with the reason, never as a score."""
    results.setdefault("lm_eval", {})[name] = {}
    for task in ec.lm_eval_tasks:
        try:
            results["lm_eval"][name] |= evaluate(model, tok, [task], limit=ec.lm_eval_limit)
        except Exception as e:  # lm-eval raises many kinds (missing dataset, no network, bad task name)
            results["skipped"].append({"checkpoint": name, "task": f"lm_eval:{task}",
                                       "reason": f"{type(e).__name__}: {e}"[:300]})
