"""One rank of the distributed tests (run under torchrun, or alone as the single-process peer).

Writes, from the main rank: the gradients of one step's exact token-averaged loss (gathered
from the FSDP shards), and a 3-step training run (metrics.jsonl + the final checkpoint).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from longctx.data.loader import PackedDataset
from longctx.model import ulysses
from longctx.model.config import FoxConfig, ModelConfig, RopeConfig
from longctx.model.transformer import Transformer
from longctx.train import parallel
from longctx.train.batches import attention_cost, make_batch, schedule
from longctx.train.loop import RunParams, train


def build(arch: str) -> Transformer:
    torch.manual_seed(0)
    if arch == "fox":  # one KV head: sequence parallelism must repeat it per query head
        cfg = ModelConfig(vocab_size=1024, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=64,
                          max_position_embeddings=2048, rope=None, fox=FoxConfig())
    else:
        cfg = ModelConfig(vocab_size=1024, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                          max_position_embeddings=2048, rope=RopeConfig(theta=10000.0))
    return Transformer(cfg, attention_backend="sdpa")


def gradients(model: Transformer, data: PackedDataset, par: parallel.Parallel, out: Path) -> None:
    samples = [0, 1, 2, 3]
    mine = schedule(samples, [attention_cost(data[i].cu_seqlens) for i in samples], 1, par.dp)[par.dp_rank]
    batches = [make_batch(data, ids, par.device, par.sp) for ids in mine]
    lo_hi = [ulysses.bounds(b.labels.numel(), par.sp_group) for b in batches]
    valid = par.sum(sum(int((b.labels[lo:hi] != -100).sum()) for b, (lo, hi) in zip(batches, lo_hi, strict=True)))
    total = 0.0
    for b in batches:
        loss = model(b.ids, b.cu_seqlens, labels=b.labels) / valid
        loss.backward()
        total += loss.item()
    total = par.sum(total)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    if par.main:
        save_file(grads, str(out / "grads.safetensors"))
        (out / "loss.json").write_text(json.dumps(total))


def main(data_dir: str, out: str, arch: str, sp: int) -> None:
    torch.set_num_threads(1)
    out_dir = Path(out)
    data = PackedDataset(data_dir)
    par = parallel.with_sequence_parallel(parallel.init(), sp, 4)
    if par.main:
        out_dir.mkdir(parents=True, exist_ok=True)
    par.barrier()
    model = build(arch).to(par.device)
    parallel.sequence_parallel(model, par.sp_group)
    parallel.shard(model, par)
    gradients(model, data, par, out_dir)
    cfg = RunParams(steps=3, micro_batch=1, grad_accum=4, lr=3e-3, sequence_parallel=sp, checkpoint_every=3)
    train(build(arch).to(par.device), data, cfg, out_dir / "run", par=par)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
