"""Building the model each training stage starts from: a fresh base model from params, a saved
checkpoint (ours or HF), and the same weights under new position settings (a RoPE base change
or LongRoPE factors) for long-context training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

import torch
from pydantic import ValidationError

from ..config import ModelParams
from ..errors import DataError
from ..model.config import PRESETS, FoxConfig, ModelConfig, RopeConfig
from ..model.hf import load_hf, load_native, save_hf, save_native
from ..model.rope import HF_KEYS, from_hf
from ..model.transformer import Transformer


def build(cfg: ModelConfig, attention_backend: str = "auto", seed: int = 0,
          device: torch.device | str = "cpu") -> Transformer:
    """A freshly initialised model, made on `device` (an 8B model never sits in host memory;
    "meta" makes shapes only)."""
    torch.manual_seed(seed)
    with torch.device(device):
        return Transformer(cfg, attention_backend)


def preset(shape: str, arch: Literal["llama", "fox"] = "llama", window: int | None = None) -> ModelConfig:
    """A named shape of `PRESETS` as a Llama-style model (the preset's RoPE, else theta 5e5) or
    as FoX (Pro) (no RoPE): what the benchmarks train."""
    if shape not in PRESETS:
        raise ValueError(f"model shape {shape!r} is unknown (known: {sorted(PRESETS)})")
    dims = dict(PRESETS[shape])
    if window is not None:
        dims["max_position_embeddings"] = window
    if arch == "fox":
        dims.update(rope=None, fox=FoxConfig())
    else:
        dims.setdefault("rope", RopeConfig(theta=5e5))
    return ModelConfig(**dims)


def base_model(params: ModelParams, vocab_size: int, seed: int, device: torch.device | str = "cpu") -> Transformer:
    return build(params.as_model_config(vocab_size), params.attention_backend, seed, device)


def load_model(path: str | Path, attention_backend: str = "auto") -> Transformer:
    """Our checkpoint directory (longctx_config.json) or an HF one (config.json), or a hub id."""
    folder = Path(path)
    if (folder / "longctx_config.json").is_file():
        return load_native(folder, attention_backend=attention_backend)
    if not folder.is_dir() and not str(path).startswith((".", "/")) and str(path).count("/") == 1:
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(repo_id=str(path), allow_patterns=["*.json", "*.safetensors"]))
        except Exception as e:
            raise DataError(f"{path}: not a local checkpoint and could not be downloaded: {e}") from None
    return load_hf(folder, attention_backend=attention_backend)


def with_positions(model: Transformer, rope: RopeConfig | None, window: int) -> Transformer:
    """The same weights with another RoPE setting and context window. A learned position table
    grows to the new window by repeating its last row (what `beyond: clamp` would read there),
    rows that the longer training then learns."""
    cfg = model.cfg.model_copy(update={"rope": rope if model.cfg.rope is not None else None,
                                       "max_position_embeddings": window})
    if cfg.seqpe is not None:
        cfg = ModelConfig.model_validate(cfg.model_dump())  # SeqPE's digits must still cover the window
    state = model.state_dict()
    table = state.get("positions.weight")
    if table is not None and table.shape[0] != window:
        if window < table.shape[0]:
            raise ValueError(f"a learned position table of {table.shape[0]} rows does not shrink to {window}")
        state["positions.weight"] = torch.cat((table, table[-1:].expand(window - table.shape[0], -1)))
    new = build(cfg, model.attention_backend, device="meta")  # shapes only: the weights are taken, not copied
    new.load_state_dict(state, assign=True)
    new.tie_weights()
    return new


def longrope_factors(path: str | Path, model: Transformer) -> RopeConfig:
    """LongRoPE factors from a JSON file in HF's longrope form (rope_search's factors.json),
    checked against the model, at the model's own RoPE base."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: LongRoPE factors file not found (run the rope_search stage)")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: corrupt JSON: {e}") from None
    if model.cfg.rope is None:
        raise DataError(f"{path}: the model has no RoPE (FoX); LongRoPE factors do not apply")
    half = model.cfg.dim_head // 2
    params = {k: doc[k] for k in HF_KEYS["longrope"] if k in doc}
    params.setdefault("short_factor", [1.0] * half)
    params.setdefault("original_max_position_embeddings", model.cfg.max_position_embeddings)
    for key in ("short_factor", "long_factor"):
        if not isinstance(params.get(key), list) or len(params[key]) != half:
            raise DataError(f"{path}: {key} must be a list of {half} numbers (head_dim {model.cfg.dim_head})")
    try:
        rope = from_hf({"rope_type": "longrope", **params}, model.cfg.rope.theta)
    except ValidationError as e:
        err = e.errors()[0]
        raise DataError(f"{path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    long = rope.long_factor
    drop = next((i for i in range(1, len(long)) if long[i] < long[i - 1]), None)
    if drop is not None:  # LongRoPE's factors grow with the dimension: a drop is a file in the wrong order or form
        raise DataError(f"{path}: long_factor[{drop}] = {long[drop]} is below long_factor[{drop - 1}] = "
                        f"{long[drop - 1]}: LongRoPE factors are non-decreasing")
    return rope


def save_model(model: Transformer, folder: Path, tokenizer_dir: Path | None) -> None:
    """Our format always; an HF export beside it (folder/hf) for RoPE models."""
    save_native(model, folder)
    if model.cfg.fox is None and model.cfg.rope is not None:
        save_hf(model, folder / "hf", tokenizer_dir)
    elif (folder / "hf").is_dir():  # an earlier model's export, which this one has no counterpart of
        shutil.rmtree(folder / "hf")
