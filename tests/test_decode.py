"""KV-cache greedy decoding equals the argmax of full forward passes, for RoPE (including the
LongRoPE switch across the original window) and FoX."""

from __future__ import annotations

import importlib.util

import numpy as np
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


@pytest.mark.parametrize("name", ["llama", "fox_pro"])
def test_a_decode_steps_ops_do_not_grow_with_the_documents_decoded_together(name):
    """A step of 3 documents and one of 12 run the same ops (on a GPU, the same launches): no
    per-document loop in the step. FoX's gates looped over the documents, ~4 ops a document and
    layer, and a 64K eval batch of 16 ran 2.2x a step's ops for it."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = Transformer(CONFIGS[name].model_copy(update={"max_position_embeddings": 64}), "sdpa").eval()

    def ops(docs: int, new: int) -> int:
        prompts = [torch.randint(0, 61, (20 + i,)) for i in range(docs)]
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            generate_batch(model, prompts, new, draft=0)
        return sum(e.count for e in prof.key_averages())

    steps = {docs: ops(docs, 6) - ops(docs, 2) for docs in (3, 12)}  # the ops of 4 decode steps
    assert steps[3] == steps[12] > 0, steps


def test_lookup_draft_guesses_what_followed_the_latest_copy_of_the_last_tokens():
    from longctx.model.decode import lookup_draft

    seq = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 4, 8, 2, 3])
    assert lookup_draft(seq, 3).tolist() == [7, 4, 8]  # "1 2 3" is not the end: "2 3" last stood at 7-8
    assert lookup_draft(seq, 10).tolist() == [7, 4, 8, 2, 3]  # (up to the end)
    assert lookup_draft(np.array([4, 8, 6, 1, 6, 4]), 2).tolist() == [8, 6]  # a 1-gram where no 2-gram recurs
    assert lookup_draft(np.array([4, 8, 6]), 2).size == 0 and lookup_draft(seq, 0).size == 0
    assert lookup_draft(np.array([3, 3, 3, 3]), 4).tolist() == [3]  # a loop: its next token


@pytest.mark.parametrize("name", ["llama", "longrope", "dynamic", "fox_pro", "fox_llama"])
def test_guessed_tokens_take_fewer_forwards_for_the_same_tokens(name):
    """Decode steps that score the prompt-lookup guesses: each prompt the tokens of one token a
    step (the random models fall into loops that the lookup guesses, so steps keep several
    tokens), in fewer forwards; LongRoPE's switch and dynamic NTK's growth never inside a step.
    FoX's refused guesses leave no gate behind, and KV-shift goes on from the last kept row."""
    torch.manual_seed(2)
    model = Transformer(CONFIGS[name]).double().eval()
    prompts = [torch.randint(0, 61, (n,)) for n in (7, 3, 11, 5, 1)]
    steps = [20, 12, 16, 1, 6] if name != "dynamic" else [12, 6, 9, 3, 4]
    forwards = []
    hidden = model.hidden

    def counted(*args, **kwargs):
        forwards[-1] += 1
        return hidden(*args, **kwargs)

    model.hidden = counted
    runs = []
    for draft in (0, 8):
        forwards.append(0)
        runs.append([t.tolist() for t in generate_batch(model, prompts, steps, draft=draft)])
    assert runs[0] == runs[1]
    assert forwards[0] == max(steps) and forwards[1] <= forwards[0] - (3 if name == "dynamic" else 7), forwards


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
    past each length): each gets what it gets alone, with and without the decay. Then queries
    that name their document (three of the third, each over its keys up to its own row, as a
    step's guesses): each what it gets alone."""
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
    docs, ends = [2, 1, 2, 2], [300, 130, 17, 299]
    qs = torch.randn(len(docs), h, d, generator=gen).to(dev, dtype)
    lam_qs = torch.stack([lam[i, n - 1] for i, n in zip(docs, ends, strict=True)])
    for decay in (False, True):
        extra = (lam_qs, lam) if decay else ()
        got = decode_attention(qs, k, v, *extra, lengths=torch.tensor(ends, device=dev),
                               docs=torch.tensor(docs, device=dev))
        for j, (i, n) in enumerate(zip(docs, ends, strict=True)):
            alone = decode_attention(qs[j], k[i, :n], v[i, :n], *((lam_qs[j], lam[i, :n]) if decay else ()))
            assert torch.allclose(got[j].float(), alone.float(), atol=1e-2 if dev == "cuda" else 1e-5), (decay, j)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama", "fox_pro"])
def test_a_decode_step_queues_without_waiting_for_the_gpu(name):
    """A decode step's forward, every layer, copies nothing from pageable host memory (CUDA
    would drain the stream at each copy, and the GPU wait for the host's next launches): under
    PyTorch's sync debug mode, a synchronising call raises. Only the step's read of its argmax
    waits (generate_batch's one sync a step)."""
    from longctx.model.decode import Cache

    torch.manual_seed(3)
    cfg = CONFIGS[name].model_copy(update={"vocab_size": 512, "d_model": 128, "max_position_embeddings": 4096})
    model = Transformer(cfg, "sdpa" if name == "llama" else "fox").cuda().eval()
    prompts = [torch.randint(0, 512, (n,), device="cuda") for n in (300, 37, 900)]
    cache = Cache(cfg.n_layers, len(prompts), reserve=4)
    with torch.no_grad():
        model.hidden(torch.cat(prompts), np.cumsum([0] + [p.numel() for p in prompts]).tolist(), cache=cache)
        step = torch.randint(0, 512, (len(prompts),), device="cuda")
        model.lm_head(model.hidden(step, cache=cache))  # (kernels compiled, allocator warm)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = model.lm_head(model.hidden(step, cache=cache))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (len(prompts), 512) and cache.lengths == [302, 39, 902]


def test_share_plan_forks_each_prompt_from_the_one_it_shares_most_with():
    """Four prompts of one haystack, needles at depths 0.9, 0.5, 0.9 and 0.1, one of another
    haystack, one a copy of the first: the first is computed whole and the others that share
    enough of themselves fork from it (the copy keeps its last token); a pair with other
    frequencies never shares."""
    from longctx.model.decode import common_prefixes, share_plan

    gen = torch.Generator().manual_seed(0)
    hay, other = torch.randint(0, 50, (100,), generator=gen), torch.randint(0, 50, (100,), generator=gen)

    def needle(h: torch.Tensor, at: int, key: int) -> torch.Tensor:
        return torch.cat((h[:at], torch.tensor([60, key]), h[at:]))

    prompts = [needle(hay, 90, 51), needle(hay, 50, 52), needle(hay, 90, 53), needle(hay, 10, 54),
               needle(other, 90, 55), needle(hay, 90, 51)]
    agree = common_prefixes(prompts)
    assert agree[0, 1] == 50 and agree[0, 2] == 91 and agree[0, 5] == 102 and agree[3, 4] < 10
    assert (agree == agree.T).all()
    lengths = [p.numel() for p in prompts]
    plan = share_plan(agree, lengths, None, min_tokens=8, min_fraction=0.4)
    assert plan == [(-1, 0), (0, 50), (0, 91), (-1, 0), (-1, 0), (0, 101)]
    assert share_plan(agree, lengths, None, min_tokens=60, min_fraction=0.4)[1] == (-1, 0)
    apart = np.ones((6, 6), dtype=bool)
    apart[0, 2] = apart[2, 0] = False  # (as where their rotary frequencies differ)
    assert share_plan(agree, lengths, apart, min_tokens=8, min_fraction=0.4)[2] == (5, 91)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompts_with_a_common_prefix_get_what_each_gets_alone(name, monkeypatch):
    """Prompts of one haystack forked from the one prefilled whole: each the tokens of its own
    full-forward argmax; plain attention forks (LongRoPE only where both sides of a pair are
    past its window or both inside), FoX never does (its gates carry state past each row). The
    first and fourth prompts agree on 15 tokens, the second on 9, the third on 6, the last on 2."""
    from longctx.model import decode

    monkeypatch.setattr(decode, "SHARE_MIN_TOKENS", 4)
    monkeypatch.setattr(decode, "SHARE_MIN_FRACTION", 0.3)
    torch.manual_seed(4)
    model = Transformer(CONFIGS[name]).double().eval()
    hay = torch.randint(0, 61, (16,))
    prompts = [torch.cat((hay[:at], torch.tensor([7, key]), hay[at:at + 2 + at % 3])) for at, key in
               ((14, 1), (9, 2), (6, 3), (14, 4), (2, 5))]  # 18-22 tokens, LongRoPE's window 12
    steps = [6, 4, 8, 5, 3] if name != "dynamic" else [3, 2, 4, 3, 2]
    alone = [full_forward_greedy(model, p, s) for p, s in zip(prompts, steps, strict=True)]
    together = generate_batch(model, prompts, steps)
    assert [torch.equal(a, b) for a, b in zip(together, alone, strict=True)] == [True] * 5
    freqs = [decode._frequencies(model, p.numel()) for p in prompts]
    cache, _, order = decode._prefill(model, prompts, 8, True, freqs)
    assert cache.lengths == [prompts[i].numel() for i in order]
    want = {"longrope": [0, 2, 4, 1, 3]}.get(name, [0, 4, 1, 2, 3] if CONFIGS[name].fox is None else [0, 1, 2, 3, 4])
    assert order == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_queries_after_a_cached_part_attend_in_one_flash_call_on_cuda():
    """Three cached documents (300, 40 and 1,000 rows of grouped keys), new tokens for two of
    them (none for the second): FlashAttention-2's bottom-right causal call gives what the
    float64 softmax gives, a document's new rows seeing its cached rows and its earlier new ones."""
    from longctx.model.decode import attend_cached

    gen = torch.Generator().manual_seed(5)
    h, hk, d, cached, new = 8, 2, 64, [300, 40, 1000], [77, 0, 500]
    cache = LayerCache(docs=3)
    rows = sum(cached)
    k, v = (torch.randn(rows, hk, d, generator=gen).cuda().bfloat16() for _ in range(2))
    cache.attend(torch.randn(rows, h, d, generator=gen).cuda().bfloat16(), k, v, None,
                 np.cumsum([0] + cached).tolist())
    q = torch.randn(sum(new), h, d, generator=gen).cuda().bfloat16()
    k_new, v_new = (torch.randn(sum(new), hk, d, generator=gen).cuda().bfloat16() for _ in range(2))
    bounds = np.cumsum([0] + new).tolist()
    got = cache.attend(q, k_new, v_new, None, bounds)
    assert cache.lengths == [a + b for a, b in zip(cached, new, strict=True)]
    for i in (0, 2):
        a, b = bounds[i], bounds[i + 1]
        end = cached[i] + new[i]
        want = attend_cached(q[None, a:b].cpu().double(), cache.k[i:i + 1, :end].cpu().double(),
                             cache.v[i:i + 1, :end].cpu().double(), None, None,
                             torch.arange(cached[i], end)[None], d**-0.5)[0]
        assert ((got[a:b].cpu().double() - want).norm() / want.norm()) < 1e-2, i


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_prefill_for_the_last_rows_gives_their_full_forward_hidden_states(name):
    """`hidden(..., last=True)` over a cache: the final block for each document's last token
    alone, the same states as the whole forward there; every row's keys still cached."""
    from longctx.model.decode import Cache

    torch.manual_seed(6)
    model = Transformer(CONFIGS[name]).double().eval()
    prompts = [torch.randint(0, 61, (n,)) for n in (9, 4, 13)]
    cache = Cache(model.cfg.n_layers, 3)
    bounds = np.cumsum([0] + [p.numel() for p in prompts]).tolist()
    with torch.no_grad():
        got = model.hidden(torch.cat(prompts), bounds, cache=cache, last=True)
        want = torch.stack([model.hidden(p)[-1] for p in prompts])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # (FoX's gates are fp32)
    assert cache.lengths == [9, 4, 13] and all(layer.lengths == [9, 4, 13] for layer in cache)
    with pytest.raises(ValueError, match="decoding with a cache"):
        model.hidden(prompts[0], last=True)


def test_eval_weights_stay_fp32_on_a_cpu_and_an_unknown_choice_is_refused(monkeypatch):
    """On a CPU the eval computes in fp32 (exact); LONGCTX_EVAL_WEIGHTS admits bf16 or fp32."""
    from longctx.errors import ConfigError
    from longctx.eval import suite

    model = Transformer(CONFIGS["llama"]).eval()
    assert suite.inference_weights(model) is model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    monkeypatch.setattr(suite, "WEIGHTS", "fp16")
    with pytest.raises(ConfigError, match="LONGCTX_EVAL_WEIGHTS='fp16'"):
        suite.inference_weights(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama", "fox_pro", "alibi"])
def test_bf16_eval_weights_on_cuda_give_the_fp32_weights_logits_within_bf16_rounding(name):
    """suite.inference_weights: parameters in bf16, ALiBi's slopes still fp32; a packed prefill's
    last-row logits (cuDNN or the FoX kernel) within 3% of fp32 weights under autocast, and
    decoding runs on them."""
    import copy

    from longctx.eval import suite

    torch.manual_seed(5)
    cfg = CONFIGS["llama" if name == "alibi" else name].model_copy(update={
        "vocab_size": 512, "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "max_position_embeddings": 8192,
        **({"rope": None, "alibi": True} if name == "alibi" else {})})
    fp32 = Transformer(cfg, "auto").cuda().eval()
    model = suite.inference_weights(copy.deepcopy(fp32))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    if name == "alibi":
        assert model.layers[0].self_attn.alibi.dtype == torch.float32
    ids = torch.randint(0, 512, (6000,), device="cuda")
    bounds = [0, 5000, 6000]
    ends = torch.tensor(bounds[1:], device="cuda") - 1
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = fp32.lm_head(fp32.hidden(ids, bounds)[ends]).float()
        got = model.lm_head(model.hidden(ids, bounds)[ends]).float()
        out = generate_batch(model, [ids[:5000], ids[5000:]], [4, 6])
    assert ((got - want).norm() / want.norm()) < 0.03
    assert [o.numel() for o in out] == [5004, 1006]
