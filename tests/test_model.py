"""The model core on CPU: attention backends against the reference, document masking, packing
invariance for Llama and FoX blocks, and the chunked loss against the plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longctx.model import attention
from longctx.model.config import FoxConfig, ModelConfig, RopeConfig
from longctx.model.fox import doc_cumsum
from longctx.model.loss import IGNORE, chunked_cross_entropy, shift_labels
from longctx.model.transformer import Transformer


def random_docs(n: int, pieces: int, gen: torch.Generator) -> torch.Tensor:
    cuts = torch.randperm(n - 1, generator=gen)[: pieces - 1] + 1
    return torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([n])]).to(torch.int32)


def qkv(n=70, h=4, hk=2, d=16, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, x, d, generator=gen, dtype=dtype) for x in (h, hk, hk))
    log_f = F.logsigmoid(torch.randn(n, h, generator=gen, dtype=torch.float64) * 2 + 2)
    return q, k, v, log_f, random_docs(n, 4, gen)


def test_reference_is_the_formula():
    q, k, v, log_f, cu = qkv()
    out = attention.reference(q, k, v, cu, log_f)
    # one row by hand: query 40 attends to keys of its document up to itself, logits + D_ij
    i = 40
    doc = int(torch.searchsorted(cu, torch.tensor(i), right=True)) - 1
    a = int(cu[doc])
    lam = log_f[a:i + 1].cumsum(0)  # within the document
    for head in range(4):
        kv_head = head // 2
        logits = (k[a:i + 1, kv_head] @ q[i, head]) / 16**0.5 + (lam[-1, head] - lam[:, head])
        expect = logits.softmax(0) @ v[a:i + 1, kv_head]
        torch.testing.assert_close(out[i, head], expect)


@pytest.mark.parametrize("fox", [False, True])
@pytest.mark.parametrize("group", [16, 2048])  # documents attended in several runs, or in one
def test_sdpa_matches_reference_with_gradients(fox, group, monkeypatch):
    monkeypatch.setattr(attention, "GROUP_TOKENS", group)
    q, k, v, log_f, cu = qkv(dtype=torch.float64)
    for t in (q, k, v, log_f):
        t.requires_grad_(True)
    lf = log_f if fox else None
    ref = attention.reference(q, k, v, cu, lf)
    out = attention.sdpa(q, k, v, cu, lf)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    grads_ref = torch.autograd.grad(ref, (q, k, v, log_f) if fox else (q, k, v), g)
    grads = torch.autograd.grad(out, (q, k, v, log_f) if fox else (q, k, v), g)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_documents_do_not_see_each_other():
    q, k, v, log_f, cu = qkv()
    out = attention.reference(q, k, v, cu, log_f)
    a, b = int(cu[1]), int(cu[2])
    k2, v2 = k.clone(), v.clone()
    k2[:a] += 5.0
    v2[:a] -= 3.0
    out2 = attention.reference(q, k2, v2, cu, log_f)
    torch.testing.assert_close(out2[a:], out[a:])
    assert not torch.allclose(out2[:a], out[:a])
    assert b > a


def small(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, **kw)


CONFIGS = {
    "llama": small(rope=RopeConfig(theta=10000.0)),
    "fox_pro": small(rope=None, fox=FoxConfig()),
    "fox_llama": small(rope=None, fox=FoxConfig(qk_norm=False, output_gate=False, output_norm=False, kv_shift=False)),
    "longrope": small(rope=RopeConfig(type="longrope", original_max_position_embeddings=8,
                                      short_factor=[1.0] * 4, long_factor=[2.0] * 4), max_position_embeddings=32),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_a_packed_document_computes_as_if_alone(name, backend):
    torch.manual_seed(0)
    model = Transformer(CONFIGS[name], attention_backend=backend).double()
    ids = torch.randint(0, 97, (30,))
    cu = torch.tensor([0, 7, 19, 30], dtype=torch.int32)
    packed = model(ids, cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = model(ids[a:b], torch.tensor([0, b - a], dtype=torch.int32))
        torch.testing.assert_close(packed[a:b], alone)


def test_backends_agree_on_the_whole_model():
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (2, 24))
    for cfg in CONFIGS.values():
        ref = Transformer(cfg, attention_backend="reference").double()
        fast = Transformer(cfg, attention_backend="sdpa").double()
        fast.load_state_dict(ref.state_dict())
        torch.testing.assert_close(fast(ids), ref(ids))


@pytest.mark.parametrize("name", ["llama", "fox_pro"])
def test_kernels_get_one_dtype_under_autocast(name, monkeypatch):
    seen = []
    original = attention.BACKENDS["sdpa"]

    def spy(q, k, v, cu, log_f=None, scale=None):
        seen.append((q.dtype, k.dtype, v.dtype))
        return original(q, k, v, cu, log_f, scale)

    monkeypatch.setitem(attention.BACKENDS, "sdpa", spy)
    model = Transformer(CONFIGS[name], attention_backend="sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 97, (2, 16)))
    assert seen and all(d == (torch.bfloat16,) * 3 for d in seen)


def test_chunked_loss_equals_the_plain_loss_and_its_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    labels[[0, 5, 36]] = IGNORE
    plain = F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE, reduction="sum")
    gp = torch.autograd.grad(plain * 0.5, (hidden, weight))
    chunked = chunked_cross_entropy(hidden, weight, labels, chunk=8)
    gc = torch.autograd.grad(chunked * 0.5, (hidden, weight))
    torch.testing.assert_close(chunked, plain)
    for a, b in zip(gc, gp, strict=True):
        torch.testing.assert_close(a, b)


def test_labels_never_cross_documents_and_follow_the_mask():
    ids = torch.arange(10, 20)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    assert shift_labels(ids, cu).tolist() == [11, 12, 13, IGNORE, 15, 16, 17, 18, 19, IGNORE]
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 0, 1, 1, 0])
    assert shift_labels(ids, cu, mask).tolist() == [IGNORE, 12, 13, IGNORE, IGNORE, IGNORE, 17, 18, IGNORE, IGNORE]


def test_backends_say_what_they_cannot_do():
    q, k, v, log_f, cu = qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match="'varlen' has no forget-gate decay; for FoX use 'fox' or 'flex'"):
        attention.varlen(q, k, v, cu, log_f)
    with pytest.raises(ValueError, match="'flash_attn' takes float16/bfloat16, got torch.float32; use 'sdpa'"):
        attention.flash_attn(q, k, v, cu)
    q, k, v, _, cu = qkv(d=12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8, got 12"):
        attention.varlen(q, k, v, cu)
    with pytest.raises(ValueError, match="'flex' cannot run on cpu here; use one of"):
        attention.select("flex", torch.device("cpu"), fox=True)
    assert attention.select("auto", torch.device("cpu"), fox=True) is attention.sdpa


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig(vocab_size=10, d_model=32, n_layers=1, n_heads=4, n_kv_heads=3, ffn_dim=8)
    with pytest.raises(ValueError, match="unknown"):
        Transformer(small(), attention_backend="nope")


def test_cudnn_plan_routes_documents_by_length():
    from longctx.model import cudnn_attention as ca

    wide = 2**34 // 1024**2  # heads x head dim for which the rule's threshold is 1,024 tokens
    plan = ca.plan([0, 17, 317, 1500, 1502, 3000], torch.device("cpu"), wide)
    assert plan.long_docs.tolist() == [[317, 1183, 1280], [1502, 1498, 1408]]  # start, length, plan size
    assert plan.short_index.tolist() == [*range(0, 317), 1500, 1501]
    assert plan.short_cu.tolist() == [0, 17, 317, 319] and plan.long_doc == 1024
    # batches of one length get plans of one shape, whatever their documents (no recompiles)
    batches = ([0, 4096], [0, 100, 4096], [0, 3196, *range(3296, 4097, 100)], [0, 1024, 2048, 3072, 4096])
    shapes = {ca.plan(b, torch.device("cpu"), wide).long_docs.shape for b in batches}
    assert shapes == {(4, 3)}
    long_docs = ca.plan([0, 100, 4096], torch.device("cpu"), wide).long_docs
    assert long_docs.tolist() == [[100, 3996, 3840]] + [[0, 0, 0]] * 3  # (the batch ends: the size below)
    sizes = {ca.padded_length(n) for n in range(1024, 65537)}
    assert len(sizes) <= 7 * 8  # a few cuDNN plans per octave
    assert all(n <= ca.padded_length(n) < 1.13 * n for n in range(1024, 65537))


def test_cudnn_takes_documents_whose_work_pays_for_a_call():
    """The threshold falls with heads x head dim (length^2 x width >= CALL_WORK): the gpu-64k
    Llama's 4K documents (12 x 64) stay with FlashAttention-2, where cuDNN was 1.10x slower on an
    H200; the 8B's at 2,048 tokens (32 x 128) and 2,897 (16 x 128 a rank under SP 2) take cuDNN."""
    from longctx.model import cudnn_attention as ca

    assert [ca.long_doc(h * d) for h, d in ((12, 64), (16, 128), (32, 128), (2, 32))] == [4730, 2897, 2048, 16384]
    for width in (768, 2048, 4096, 3000):
        t = ca.long_doc(width)
        assert t**2 * width >= ca.CALL_WORK > (t - 1) ** 2 * width
    assert ca.long_doc(10**9) == 128  # (cuDNN's shortest plan)
    plan = ca.plan([0, 4096, 8192, 12922, 17652], torch.device("cpu"), 12 * 64)
    assert plan.long_docs.tolist() == [[8192, 4730, 5120], [12922, 4730, 4608], [0, 0, 0]]
    assert plan.short_index.tolist() == list(range(8192)) and plan.short_cu.tolist() == [0, 4096, 8192]
    assert ca.plan([0, 4096, 8192], torch.device("cpu"), 12 * 64).long_docs[:, 1].tolist() == [0, 0]
    with pytest.raises(RuntimeError), ca.fixed_long_doc(100):  # (the override benches use; restored after)
        assert ca.long_doc(768) == 100 and ca.plan([0, 100, 199], torch.device("cpu"), 768).long_docs[0].tolist() == [
            0, 100, 128]
        raise RuntimeError
    assert ca.LONG_DOC is None and ca.long_doc(768) == 4730


def test_cudnn_plan_sizes_stay_within_the_batch():
    """A long document's cuDNN call takes its padded length where the batch has the rows after it
    (they pad it: no copy), else the plan size below its length (its last rows: FlashAttention-2);
    either way one of a few sizes per octave, and never a row past the batch."""
    from longctx.model import cudnn_attention as ca

    sizes = {ca.padded_length(n) for n in range(128, 70000)}
    for start, length, end in [(0, 1000, 1024), (24, 1000, 1024), (0, 1000, 1000), (100, 3996, 4096),
                               (5, 960280, 1048576), (88296, 960280, 1048576), (27729, 622855, 1048576)]:
        size = ca.plan_size(start, length, end)
        assert start + size <= end and (size >= length) == (start + ca.padded_length(length) <= end)
        assert size == ca.padded_length(length) or (size <= length and size % ca._step(length) == 0)
        assert length > 70000 or size in sizes
    assert ca.plan_size(88296, 960280, 1048576) == 917504 and ca.plan_size(27729, 622855, 1048576) == 655360


@pytest.mark.parametrize("start, size", [(300, 640), (200, 800), (0, 1000)])
def test_cudnn_documents_are_views_with_a_batch_stride_no_other_caller_has(start, size):
    """A document's dense [1, H, L, D] tensor is a view of the packed rows from its start (the rows
    after it pad it). Its batch stride is none that a contiguous tensor or a view of packed rows
    has: PyTorch's cuDNN graph cache keys on q/k/v strides alone, so that stride keeps our graphs
    apart from F.scaled_dot_product_attention's, whose gradient layout differs (issue 32)."""
    from longctx.model import cudnn_attention as ca

    t = torch.randn(1000, 4, 16)
    dense = ca._dense(t, start, size)
    want = t[start:start + size].transpose(0, 1)[None]
    assert torch.equal(dense, want) and dense.data_ptr() == t[start].data_ptr()
    natural = {want.contiguous().stride(0), want.stride(0), t.stride(0) * t.shape[0], 4 * 16}
    assert dense.stride(0) not in natural and dense.stride()[1:] == want.stride()[1:]
    assert dense.stride(0) % 8 == 0  # 16-byte aligned in bf16, as cuDNN's tensor maps need


def test_doc_cumsum_restarts_at_every_document_with_its_gradient():
    torch.manual_seed(0)
    log_f = F.logsigmoid(torch.randn(40, 3, dtype=torch.float64)).requires_grad_(True)
    cu = torch.tensor([0, 7, 8, 30, 40], dtype=torch.int32)
    lam = doc_cumsum(log_f, cu)
    want = torch.cat([log_f[a:b].cumsum(0) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)])
    torch.testing.assert_close(lam, want)
    g = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(lam, log_f, g)[0], torch.autograd.grad(want, log_f, g)[0])
