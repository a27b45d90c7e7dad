"""The inference forward's fused kernels (model/fused_triton.py) against the eager ops they replace:
each kernel alone (in Triton's interpreter on a CPU, compiled on CUDA), and a whole model's logits
and greedy answers with them and without."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from longctx.model import fused
from longctx.model.config import FoxConfig, ModelConfig
from longctx.model.decode import generate_batch
from longctx.model.norm import RMSNorm
from longctx.model.rope import cos_sin, rotate
from longctx.model.transformer import Transformer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernels():
    from longctx.model import fused_triton

    return fused_triton


def ulps(got: torch.Tensor, want: torch.Tensor, rounded: torch.dtype | None = None) -> float:
    """The largest difference in units of a rounding at each value's size: the wanted dtype's, or
    the coarser one of a step on the way (`rounded`)."""
    eps = torch.finfo(rounded or want.dtype).eps
    return ((got.double() - want.double()).abs() / (want.double().abs() * eps + 1e-30)).max().item()


@pytest.mark.parametrize(("dtype", "weight_dtype", "width"), [(torch.float32, torch.float32, 48),
                                                              (torch.bfloat16, torch.bfloat16, 768),
                                                              (torch.bfloat16, torch.float32, 64)])
def test_rms_norm_is_eagers(dtype, weight_dtype, width):
    torch.manual_seed(0)
    norm = RMSNorm(width, 1e-5).to(DEVICE, weight_dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(37, 3, width, device=DEVICE) * 3).to(dtype)
    with torch.no_grad(), fused_off():
        want = norm(x)
    got = kernels().rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == want.dtype == torch.promote_types(dtype, weight_dtype) and got.shape == want.shape
    # the same roundings in the same places; the sum of squares adds in another order, rsqrt may
    # differ by an ulp or two
    assert ulps(got, want, dtype) <= 4, (dtype, weight_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_is_eagers_on_packed_heads(dtype):
    torch.manual_seed(0)
    n, heads, d = 45, 3, 16
    proj = torch.randn(n, heads * d, device=DEVICE).to(dtype)
    x = proj.view(n, heads, d)
    positions = torch.cat([torch.arange(20), torch.arange(25)]).to(DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos, sin = cos_sin(inv, 1.3, positions, dtype)
    want = rotate(x.transpose(0, 1).double(), cos[None].double(), sin[None].double()).transpose(0, 1)
    got = kernels().rotate(x, cos[None], sin[None], torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (n, heads, d) and got.is_contiguous()
    assert ulps(got, want.to(torch.bfloat16)) <= 1  # one rounding, of the exact result
    # a strided view (every other head) reads its own heads, into fp32
    strided = torch.randn(n, 2 * heads, d, device=DEVICE).to(dtype)[:, ::2]
    want = rotate(strided.transpose(0, 1).double(), cos[None].double(), sin[None].double()).transpose(0, 1)
    assert ulps(kernels().rotate(strided, cos, sin, torch.float32), want.float()) <= 64  # fp32 sums of two products


def test_silu_mul_is_eagers():
    torch.manual_seed(0)
    gate = (torch.randn(29, 100, device=DEVICE) * 4).to(torch.bfloat16)
    up = torch.randn(29, 100, device=DEVICE).to(torch.bfloat16)
    got = kernels().silu_mul(gate, up)
    want = F.silu(gate) * up
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ulps(got, want) <= 2  # two roundings (silu's, the product's), each may land an ulp apart
    assert kernels().silu_mul(gate[:0], up[:0]).shape == (0, 100)


class fused_off:
    """The eager ops, whatever the device."""

    def __enter__(self):
        self.saved, fused.FUSED = fused.FUSED, False

    def __exit__(self, *exc):
        fused.FUSED = self.saved


@pytest.mark.parametrize("fox", [False, True])
def test_a_model_answers_alike_with_the_kernels_and_without(fox, monkeypatch):
    """The whole inference path (prefill and decode steps through the cache) with the kernels:
    the same logits to fp32 rounding and the same greedy tokens; under autograd nothing changes."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_position_embeddings=64, **({"rope": None, "fox": FoxConfig()} if fox else {}))
    model = Transformer(cfg, "fox" if fox else "sdpa").to(DEVICE).eval()
    if DEVICE == "cpu":  # Triton's interpreter runs the kernels on CPU tensors
        monkeypatch.setattr(fused, "wanted", lambda x: fused.FUSED and not torch.is_grad_enabled())
    calls = {"n": 0}
    real = fused.kernels

    def counted():
        calls["n"] += 1
        return real()

    monkeypatch.setattr(fused, "kernels", counted)
    ids = torch.randint(0, 61, (40,), device=DEVICE)
    bounds = [0, 17, 40]
    with torch.no_grad():
        got = model(ids, bounds)
        # a block: its two norms, SwiGLU's gate, and the rotary on q and on k (FoX (Pro): q, k and
        # output norms); then the final norm
        assert calls["n"] == 2 * (6 if fox else 5) + 1
        with fused_off():
            want = model(ids, bounds)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    prompts = [ids[:17], ids[17:]]
    answers = [a.tolist() for a in generate_batch(model, prompts, [6, 6])]
    with fused_off():
        assert [a.tolist() for a in generate_batch(model, prompts, [6, 6])] == answers
    calls["n"] = 0
    model(ids, bounds).sum().backward()  # training: the eager ops
    assert calls["n"] == 0
