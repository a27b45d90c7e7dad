"""KV-cache greedy decoding equals the argmax of full forward passes, for RoPE (including the
LongRoPE switch across the original window) and FoX."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from longctx.model.config import FoxConfig, ModelConfig, RopeConfig
from longctx.model.decode import LayerCache, generate, generate_batch
from longctx.model.transformer import Transformer

BASE = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_position_embeddings=32)
CONFIGS = {
    "llama": ModelConfig(**BASE),
    "longrope": ModelConfig(**BASE, rope=RopeConfig(type="longrope", original_max_position_embeddings=12,
                                                    short_factor=[1.0] * 4, long_factor=[4.0, 3.0, 2.0, 1.5])),
    "dynamic": ModelConfig(**BASE, rope=RopeConfig(type="dynamic", factor=2.0)),
    "fox_pro": ModelConfig(**BASE, rope=None, fox=FoxConfig()),
    "fox_llama": ModelConfig(**BASE, rope=None, fox=FoxConfig(qk_norm=False, output_gate=False,
                                                              output_norm=False, kv_shift=False)),
}


def full_forward_greedy(model: Transformer, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    tokens = prompt.clone()
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.cat((tokens, model(tokens)[-1].argmax()[None]))
    return tokens


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_greedy_equals_full_forward_argmax(name):
    torch.manual_seed(1)
    model = Transformer(CONFIGS[name]).double().eval()
    prompt = torch.randint(0, 61, (7,))
    steps = 30 if name != "dynamic" else 12  # LongRoPE crosses its window of 12 at step 6
    cached = generate(model, prompt, steps)
    assert torch.equal(cached, full_forward_greedy(model, prompt, steps))
    assert cached.numel() == 7 + steps


def test_generation_stops_at_eos():
    torch.manual_seed(1)
    model = Transformer(CONFIGS["llama"]).double().eval()
    prompt = torch.randint(0, 61, (5,))
    free = generate(model, prompt, 10)
    eos = int(free[7])
    stopped = generate(model, prompt, 10, eos_id=eos)
    assert int(stopped[-1]) == eos and stopped.numel() <= 8


def test_the_cache_grows_in_place_and_keeps_every_row():
    cache = LayerCache(docs=2)
    k, v, log_f = torch.randn(600, 2, 8), torch.randn(600, 2, 8), torch.randn(600, 4).sigmoid().log()
    # document 0 takes rows [0, 300) of k, document 1 rows [300, 600): two prompts, one token each,
    # then both past the 256 rows first made
    docs = [[(0, 200), (200, 201), (201, 300)], [(300, 350), (350, 351), (351, 600)]]
    for (a0, b0), (a1, b1) in zip(*docs, strict=True):
        rows = torch.cat((torch.arange(a0, b0), torch.arange(a1, b1)))
        cache.attend(torch.randn(len(rows), 4, 8), k[rows], v[rows], log_f[rows], [0, b0 - a0, len(rows)])
    assert cache.lengths == [300, 300] and cache.k.shape[1] >= 300
    for i, rows in enumerate((slice(0, 300), slice(300, 600))):
        assert torch.equal(cache.k[i, :300], k[rows]) and torch.equal(cache.v[i, :300], v[rows])
        torch.testing.assert_close(cache.lam[i, :300], log_f[rows].cumsum(0))
    cache.keep([1])
    assert cache.lengths == [300] and torch.equal(cache.k[0, :300], k[300:])
    sized = LayerCache(docs=1, reserve=7)  # a prompt and its answer's rows: no doubling for the answer
    sized.attend(torch.randn(300, 4, 8), k[:300], v[:300], None, [0, 300])
    assert sized.k.shape[1] == 307


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompts_decoded_together_get_what_each_gets_alone(name):
    """Packed prefill and one token a document a step, prompts of different lengths finishing at
    different steps (by their budgets and by eos): each the tokens of its own full-forward argmax,
    also where LongRoPE's switch or dynamic NTK rebuilds the cache mid-batch."""
    torch.manual_seed(2)
    model = Transformer(CONFIGS[name]).double().eval()
    prompts = [torch.randint(0, 61, (n,)) for n in (7, 3, 11, 5, 1)]
    steps = [20, 12, 16, 1, 6] if name != "dynamic" else [12, 6, 9, 3, 4]
    alone = [full_forward_greedy(model, p, s) for p, s in zip(prompts, steps, strict=True)]
    assert [torch.equal(a, b) for a, b in zip(generate_batch(model, prompts, steps), alone, strict=True)] == [True] * 5
    eos = int(alone[0][9])  # the first prompt stops by its third new token, the others where it comes up
    stopped = generate_batch(model, prompts, steps, eos_id=eos)
    for got, want, p in zip(stopped, alone, prompts, strict=True):
        new = want[len(p):].tolist()
        end = len(p) + (new.index(eos) + 1 if eos in new else len(new))
        assert torch.equal(got, want[:end])
    assert int(stopped[0][-1]) == eos and stopped[0].numel() <= 10


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("t,h,hk,d", [(1, 4, 4, 64), (700, 6, 2, 40), (3000, 4, 1, 128)])
def test_decode_kernel_matches_float64(t, h, hk, d):
    """One query per head over a cache that is a view of a larger buffer, with and without the
    FoX decay (interpreted on a CPU, bf16 on CUDA)."""
    from longctx.model.fox.decode import decode_attention

    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(h, d, generator=gen)
    buf_k, buf_v = (torch.randn(t + 40, hk, d, generator=gen) for _ in range(2))
    lam = (torch.randn(t + 40, h, generator=gen).sigmoid().log()).cumsum(0)
    keys = buf_k[:t].repeat_interleave(h // hk, 1).double()
    values = buf_v[:t].repeat_interleave(h // hk, 1).double()
    for decay in (False, True):
        logits = torch.einsum("hd,thd->ht", q.double(), keys) * d**-0.5
        if decay:
            logits = logits + (lam[t].double()[:, None] - lam[:t].double().T)
        want = torch.einsum("ht,thd->hd", logits.softmax(-1), values)
        k, v = (b.to(dev, dtype) for b in (buf_k, buf_v))
        got = decode_attention(q.to(dev, dtype), k[:t], v[:t], lam[t].to(dev) if decay else None,
                               lam[:t].to(dev) if decay else None)
        assert got.shape == (h, d) and got.dtype == dtype
        assert ((got.double().cpu() - want).norm() / want.norm()) <= (1e-2 if dev == "cuda" else 1e-5), decay


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_decode_kernel_batched_reads_each_documents_own_length():
    """One launch for three documents of a padded cache (lengths 1, 130, 300 of 320 rows; garbage
    past each length): each gets what it gets alone, with and without the decay."""
    from longctx.model.fox.decode import decode_attention

    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    b, h, hk, d, cap = 3, 4, 2, 32, 320
    lengths = [1, 130, 300]
    q = torch.randn(b, h, d, generator=gen).to(dev, dtype)
    k, v = (torch.randn(b, cap, hk, d, generator=gen).to(dev, dtype) * 3 for _ in range(2))
    lam = torch.randn(b, cap, h, generator=gen).sigmoid().log().cumsum(1).to(dev)
    lam_q = torch.stack([lam[i, n - 1] for i, n in enumerate(lengths)])
    for decay in (False, True):
        extra = (lam_q, lam) if decay else ()
        got = decode_attention(q, k, v, *extra, lengths=torch.tensor(lengths, device=dev))
        for i, n in enumerate(lengths):
            alone = decode_attention(q[i], k[i, :n], v[i, :n], *((lam_q[i], lam[i, :n]) if decay else ()))
            assert torch.allclose(got[i].float(), alone.float(), atol=1e-2 if dev == "cuda" else 1e-5), (decay, n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama", "fox_pro"])
def test_prompts_decoded_together_on_cuda_get_what_each_gets_alone(name):
    """On CUDA: the packed prefill through a backend (PyTorch's SDPA, the FoX kernel) and the
    decode kernel for all documents at once, fp32 weights: the tokens of one prompt at a time."""
    torch.manual_seed(3)
    cfg = CONFIGS[name].model_copy(update={"vocab_size": 512, "d_model": 128, "n_heads": 4, "n_kv_heads": 2,
                                           "max_position_embeddings": 4096})
    model = Transformer(cfg, "sdpa" if name == "llama" else "fox").cuda().eval()  # (cuDNN takes bf16 only)
    prompts = [torch.randint(0, 512, (n,), device="cuda") for n in (1500, 37, 900, 2048)]
    steps = [8, 5, 1, 12]
    alone = [generate(model, p, s) for p, s in zip(prompts, steps, strict=True)]
    together = generate_batch(model, prompts, steps)
    assert [torch.equal(a, b) for a, b in zip(together, alone, strict=True)] == [True] * 4
