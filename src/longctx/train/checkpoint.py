"""Atomic, resumable checkpoints with no pickles: weights, optimizer state and RNG states in
safetensors, everything else (step, data position, hyperparameters) in JSON.

<dir>/step-00000100/ is written as a temp directory and renamed when complete, so a run killed
mid-save leaves the previous checkpoint as the latest. Weights and optimizer state are stored
whole and keyed by parameter name, so a run sharded over 8 ranks resumes on 2, or on one.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..errors import DataError
from ..io import atomic_dir, safetensors_file

NAME = re.compile(r"^step-(\d{8})$")


def _dcp():
    """torch.distributed.checkpoint's state-dict functions, imported at a save or a resume: the
    import takes ~0.6 s (DTensor, sympy), which a process that only reads models (eval) skips."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _full():
    return _dcp().StateDictOptions(full_state_dict=True, cpu_offload=True)


def _tied(model: torch.nn.Module) -> bool:
    return getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings


def _optimizer_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state keyed by parameter name (the same for a sharded and a plain model)."""
    sd = _dcp().get_optimizer_state_dict(model, opt, options=_full())
    tensors = {}
    for fqn, state in sd.get("state", {}).items():
        for name, value in state.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state.{fqn}.{name}"] = t.detach().cpu().contiguous()
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd.get("param_groups", [])]
    return tensors, {"param_groups": groups}


def save(root: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any],
         keep_last: int = 2, main: bool = True) -> Path:
    """Every rank calls it (gathering a sharded model is collective); the main rank writes."""
    final = root / f"step-{step:08d}"
    weights = _dcp().get_model_state_dict(model, options=_full())
    tensors, meta = _optimizer_tensors(model, opt)
    if not main:
        return final
    with atomic_dir(final) as tmp:
        weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
        if _tied(model):
            weights.pop("lm_head.weight", None)
        safetensors_file(weights, str(tmp / "model.safetensors"))
        safetensors_file(tensors, str(tmp / "optimizer.safetensors"))
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng |= {f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        safetensors_file(rng, str(tmp / "rng.safetensors"))
        py_state = random.getstate()
        doc = {"step": step, "state": state, "optimizer": meta,
               "python_random": [py_state[0], list(py_state[1]), py_state[2]]}
        (tmp / "trainer_state.json").write_text(json.dumps(doc, indent=1))
    for old in sorted(checkpoints(root))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if NAME.match(p.name) and (p / "trainer_state.json").is_file())


def latest(root: Path) -> Path | None:
    found = checkpoints(root)
    return found[-1] if found else None


def load(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    """Restore weights, optimizer and RNG states (every rank reads the files and keeps its shard);
    return the trainer state (step, data position...)."""
    try:
        doc = json.loads((folder / "trainer_state.json").read_text())
        weights = load_file(str(folder / "model.safetensors"))
    except Exception as e:  # a missing file, bad JSON, or safetensors' own error types
        raise DataError(f"{folder}: unreadable checkpoint: {e}") from None
    if _tied(model):
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    own = {k: v.shape for k, v in model.state_dict().items()}
    bad = sorted(k for k in own if k not in weights or weights[k].shape != own[k])
    if bad or set(weights) - set(own):
        raise DataError(f"{folder}: checkpoint does not fit the model (first mismatches: {bad[:3]})")
    dcp = _dcp()
    dcp.set_model_state_dict(model, weights, options=dcp.StateDictOptions(full_state_dict=True))
    if opt is not None:
        tensors = load_file(str(folder / "optimizer.safetensors"))
        state: dict[str, dict] = {}
        for key, t in tensors.items():
            fqn, name = key.removeprefix("state.").rsplit(".", 1)
            state.setdefault(fqn, {})[name] = t
        groups = doc["optimizer"]["param_groups"]
        for g in groups:
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
        dcp.set_optimizer_state_dict(model, opt, {"state": state, "param_groups": groups},
                                     options=dcp.StateDictOptions(full_state_dict=True))
    rng = load_file(str(folder / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    v, s, g = doc["python_random"]
    random.setstate((v, tuple(s), g))
    return {"step": doc["step"], **doc["state"]}
