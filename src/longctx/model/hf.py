"""Hugging Face checkpoints in and out: Llama, Mistral and Qwen2 style (config.json +
safetensors, sharded or not), and our own versioned format for FoX models, which HF has no
architecture for. Our parameter names are HF Llama's with the `model.` prefix dropped."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import DataError
from ..io import atomic_dir, read_json, safetensors_file
from .config import ModelConfig
from .rope import from_hf, hf_rope_parameters
from .transformer import Transformer

SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
FORMAT_VERSION = 1
SHARD_BYTES = 5 << 30


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    arch = (hf.get("architectures") or [None])[0]
    if arch not in SUPPORTED:
        raise DataError(f"{where}: architectures: {arch!r} is not supported (supported: {sorted(SUPPORTED)})")
    window = hf.get("sliding_window")
    if window is not None and hf.get("use_sliding_window", arch != "Qwen2ForCausalLM") and \
            window < hf.get("max_position_embeddings", 0):
        raise DataError(f"{where}: sliding_window: {window} (sliding-window attention is not supported)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling")
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads"),
            head_dim=hf.get("head_dim"),
            ffn_dim=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM",
            hf_architecture=arch,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope=from_hf(rope, hf.get("rope_theta")),
            reset_position_ids=True,
        )
    except KeyError as e:
        raise DataError(f"{where}: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json of the model's own HF architecture (Llama, Mistral or Qwen2: the same layers,
    Qwen2's with q/k/v biases), so transformers loads every tensor and makes none up."""
    if cfg.fox is not None or cfg.rope is None:
        raise ValueError("FoX models have no HF architecture; use save_native")
    rope = hf_rope_parameters(cfg.rope)
    arch = cfg.hf_architecture
    own = {"LlamaForCausalLM": {"attention_bias": False, "mlp_bias": False},
           "MistralForCausalLM": {"sliding_window": None},
           "Qwen2ForCausalLM": {"use_sliding_window": False, "sliding_window": None}}[arch]
    out = {
        "architectures": [arch],
        "model_type": SUPPORTED[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_head,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        **own,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "rope_theta": cfg.rope.theta,
        # both spellings: transformers 5 reads rope_parameters, 4.x rope_scaling
        "rope_parameters": rope,
        "rope_scaling": None if cfg.rope.type == "default" else rope,
    }
    return out


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise DataError(f"{folder}: no model.safetensors or model.safetensors.index.json (only safetensors "
                        "checkpoints are read: pickled .bin files can run code)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(folder / f)))
        except Exception as e:
            raise DataError(f"{folder / f}: unreadable safetensors file: {e}") from None
    return weights


def load_state(model: Transformer, weights: dict[str, torch.Tensor], where: str) -> None:
    """Copy weights into the model, checking every name and shape."""
    own = model.state_dict()
    if model.cfg.tie_embeddings:
        weights.setdefault("lm_head.weight", weights.get("embed_tokens.weight"))
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    if missing or unexpected:
        raise DataError(f"{where}: tensors missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                        f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, t in weights.items():
        if t.shape != own[name].shape:
            raise DataError(f"{where}: tensor {name} has shape {tuple(t.shape)}, the config needs "
                            f"{tuple(own[name].shape)}")
    model.load_state_dict(weights, strict=True)


def load_hf(folder: str | Path, dtype: torch.dtype = torch.float32, attention_backend: str = "auto") -> Transformer:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    cfg = config_from_hf(read_json(cfg_path, "the model's config"), str(cfg_path))
    weights = {k.removeprefix("model."): v.to(dtype) for k, v in _read_weights(folder).items()}
    model = Transformer(cfg, attention_backend).to(dtype)
    load_state(model, weights, str(folder))
    return model


def _save_weights(model: Transformer, folder: Path, prefix: str, shard_bytes: int) -> None:
    state = {}
    for name, t in model.state_dict().items():
        if model.cfg.tie_embeddings and name == "lm_head.weight":
            continue
        key = name if name.startswith("lm_head") or not prefix else prefix + name
        state[key] = t.detach().contiguous().cpu()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in state.items():
        if size and size + t.numel() * t.element_size() > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += t.numel() * t.element_size()
    if len(shards) == 1:
        safetensors_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        safetensors_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def save_hf(model: Transformer, folder: str | Path, tokenizer_dir: str | Path | None = None,
            shard_bytes: int = SHARD_BYTES) -> None:
    """An HF directory `AutoModelForCausalLM.from_pretrained` loads (the model's own architecture)."""
    def write(out: Path) -> None:
        (out / "config.json").write_text(json.dumps(config_to_hf(model.cfg), indent=2) + "\n")
        _save_weights(model, out, "model.", shard_bytes)
        if tokenizer_dir is not None:
            for f in Path(tokenizer_dir).iterdir():
                if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",
                                                                                  "chat_template.jinja")):
                    shutil.copy2(f, out / f.name)

    _swap_in(Path(folder), write)


def save_native(model: Transformer, folder: str | Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Our format (any model, FoX included): safetensors + longctx_config.json, which records each
    weights file's size and SHA-256 (checked on load: a flipped byte in a weights file still
    parses, and would be trained from)."""
    def write(out: Path) -> None:
        _save_weights(model, out, "", shard_bytes)
        files = sorted(f.name for f in out.iterdir() if WEIGHTS.fullmatch(f.name))
        meta = {"format_version": FORMAT_VERSION, "model": model.cfg.model_dump(mode="json"),
                "weights": dict(zip(files, _digests([out / f for f in files]), strict=True))}
        (out / "longctx_config.json").write_text(json.dumps(meta, indent=2) + "\n")

    _swap_in(Path(folder), write)


WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors")


def _digests(files: list[Path]) -> list[dict]:
    """{bytes, sha256} of each file, hashed side by side (hashlib releases the GIL: an 8B model's
    shards at the disk's speed, not one core's)."""
    def digest(f: Path) -> dict:
        with f.open("rb") as fh:
            return {"bytes": f.stat().st_size, "sha256": hashlib.file_digest(fh, "sha256").hexdigest()}

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        return list(pool.map(digest, files))


def check_weights(folder: Path, recorded: dict) -> None:
    """Each weights file as it was saved (`recorded`: longctx_config.json's `weights`)."""
    names = sorted(recorded)
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise DataError(f"{folder / missing[0]}: missing (the checkpoint was saved with {names})")
    for name, got in zip(names, _digests([folder / n for n in names]), strict=True):
        want = recorded[name]
        if got != want:
            what = (f"is {got['bytes']:,} bytes, {want['bytes']:,} were saved" if got["bytes"] != want["bytes"]
                    else f"its SHA-256 is {got['sha256'][:12]}..., {want['sha256'][:12]}... was saved")
            raise DataError(f"{folder / name}: {what}: the file is corrupt or was replaced since the checkpoint "
                            "was written; restore it or run the stage that made it again")


EXPORTED = re.compile(r"(longctx_config|config|generation_config|special_tokens_map)\.json|tokenizer.*|"
                      r"chat_template\.jinja|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json")
"""What an export (ours or HF's) consists of: what an earlier export in the folder leaves behind."""


def _swap_in(folder: Path, write: Callable[[Path], None]) -> None:
    """Write an export into a fresh folder and swap it in whole, so nothing of an earlier export
    there (a stale index, shards, a single-file model) mixes with it; whatever else the folder
    held (a user's notes, subfolders) comes along, hard-linked (nothing is lost if this fails)."""
    with atomic_dir(folder) as out:
        write(out)
        if folder.is_dir():
            for f in folder.iterdir():
                if EXPORTED.fullmatch(f.name) or (out / f.name).exists():
                    continue
                if f.is_dir():
                    shutil.copytree(f, out / f.name, symlinks=True, copy_function=_link)
                else:
                    _link(f, out / f.name)


def _link(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


def native_config(folder: str | Path) -> ModelConfig:
    """A checkpoint's model config, without reading its weights."""
    return _native_meta(Path(folder))[0]


def _native_meta(folder: Path) -> tuple[ModelConfig, dict | None]:
    """The config and the weights files' digests (None: a checkpoint saved before they were kept)."""
    path = folder / "longctx_config.json"
    if not path.is_file():
        raise DataError(f"{path}: not found (not a longctx checkpoint)")
    meta = read_json(path, "the checkpoint's config")
    if not isinstance(meta, dict):
        raise DataError(f"{path}: the checkpoint's config is corrupt: a JSON object expected")
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {meta.get('format_version')!r}, this longctx reads {FORMAT_VERSION}")
    weights = meta.get("weights")
    if weights is not None and not (isinstance(weights, dict) and all(
            isinstance(d, dict) and set(d) == {"bytes", "sha256"} for d in weights.values())):
        raise DataError(f"{path}: weights: the checkpoint's config is corrupt: each weights file's bytes and sha256 "
                        "expected")
    try:
        return ModelConfig.model_validate(meta["model"]), weights
    except ValueError as e:
        raise DataError(f"{path}: model: {e}") from None


def load_native(folder: str | Path, dtype: torch.dtype = torch.float32, attention_backend: str = "auto") -> Transformer:
    folder = Path(folder)
    cfg, weights = _native_meta(folder)
    if weights is not None:
        check_weights(folder, weights)
    model = Transformer(cfg, attention_backend).to(dtype)
    load_state(model, {k: v.to(dtype) for k, v in _read_weights(folder).items()}, str(folder))
    return model

