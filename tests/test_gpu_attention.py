"""Every CUDA attention backend against the fp64 reference, forward and backward (the forget
gate's gradient included), on random inputs and random document splits. Skipped without CUDA;
`scripts/gpu/tests.sh` runs it on the GPU machine."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from longctx.model import attention, cudnn_attention

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DEV = torch.device("cuda")
REPO = Path(__file__).resolve().parents[1]


def inputs(n: int, h: int, hk: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(n, x, d, generator=gen, device=DEV) for x in (h, hk, hk))
    # one head per decay rate, f ~ 0.6 .. 0.999, as trained FoX models have them (issue 31)
    log_f = F.logsigmoid(torch.linspace(0.5, 7.0, h, device=DEV) + 0.7 * torch.randn(n, h, generator=gen, device=DEV))
    cuts = torch.randperm(n - 1, generator=gen, device=DEV)[:5] + 1
    cu = torch.cat([torch.zeros(1, device=DEV), cuts.sort().values, torch.full((1,), n, device=DEV)]).to(torch.int32)
    return [t.to(dtype) for t in (q, k, v)] + [log_f], cu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


BACKENDS = [b for b in attention.available(DEV) if b != "reference"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fox", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_reference(backend, fox, d, dtype):
    if fox and backend in attention.PLAIN_ONLY:
        pytest.skip("no forget gate in this backend")
    if dtype == torch.float32 and backend in attention.PLAIN_ONLY:
        pytest.skip("flash kernels take half precision only")
    (q, k, v, log_f), cu = inputs(1024, 4, 2, d, dtype, seed=d + fox)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, log_f)]
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, log_f)]
    fn = attention.BACKENDS[backend]
    out = fn(*leaves[:3], cu, leaves[3] if fox else None)
    ref = attention.reference(*ref_leaves[:3], cu, ref_leaves[3] if fox else None)
    g = torch.randn_like(ref)
    n_grads = 4 if fox else 3
    grads = torch.autograd.grad(out, leaves[:n_grads], g.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, ref_leaves[:n_grads], g)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel(out, ref) <= tol
    for name, a, b in zip("q k v log_f".split(), grads, ref_grads, strict=False):
        assert rel(a, b) <= tol, (name, rel(a, b))


@pytest.mark.parametrize("lengths", [[17, 300, 129, 578], [1024], [1000], [40, 1000, 3], [256, 1, 767]])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("long_doc", [128, None])
def test_cudnn_routes_long_and_short_documents(lengths, heads, d, long_doc, monkeypatch):
    """Documents long enough (here 128 tokens; None: the rule, which sends none of these) take cuDNN
    (padded to a plan size by the rows after them, or, where the batch ends first, cut at the size
    below, their last rows FlashAttention-2's over all their keys: 578, 1000 and 767 here; grouped
    k/v with their own heads), the rest FlashAttention-2 (all of them in place, without a gather,
    when every document is short): both against the fp64 reference, with and without a host plan."""
    if "cudnn" not in attention.available(DEV):
        pytest.skip("no cuDNN attention here")
    monkeypatch.setattr(cudnn_attention, "LONG_DOC", long_doc)
    n = sum(lengths)
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(n + d)
    h, hk = heads
    leaves = [torch.randn(n, x, d, generator=gen, device=DEV, dtype=torch.bfloat16).requires_grad_(True)
              for x in (h, hk, hk)]
    for plan in (attention.plan("cudnn", bounds, DEV, h * d), None):
        check_qkv(lambda *t, plan=plan: attention.cudnn(*t, cu, plan=plan), leaves, cu, 1e-2, 1e-2)


def test_auto_takes_cudnn_on_hopper_and_the_fox_kernel_for_fox():
    if torch.cuda.get_device_capability(DEV) < (9, 0) or "cudnn" not in attention.available(DEV):
        pytest.skip("not a Hopper GPU with cuDNN's attention")
    assert attention.resolve("auto", DEV, False) == "cudnn" == attention.resolve("cudnn", DEV, False)
    assert attention.resolve("auto", DEV, True) == "fox"
    with pytest.raises(ValueError, match="no decay"):
        attention.resolve("cudnn", DEV, True)


@pytest.mark.parametrize("first", ["sdpa", "cudnn"])
def test_cudnn_is_right_beside_pytorchs_own_cudnn_path(first, monkeypatch):
    """PyTorch's cuDNN path (the sdpa backend under sdpa_kernel(CUDNN_ATTENTION), what it picks on
    Hopper) and our wrapper one after the other in one process, on documents of plan sizes (no
    padding: cuDNN gets the same q/k/v shapes and row strides from both): each right, in either
    order. PyTorch keys its cached cuDNN graphs by q/k/v alone; before the wrapper's tensors had a
    stride of their own, the second caller ran the first's graph and got wrong gradients (issue
    32's backend_grads ran sdpa first)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if "cudnn" not in attention.available(DEV):
        pytest.skip("no cuDNN attention here")
    monkeypatch.setattr(cudnn_attention, "LONG_DOC", 128)
    lengths = [1536, 640, 1536] if first == "sdpa" else [1280, 768, 1280]  # shapes of this test alone
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(len(first))
    leaves = [(2.0 * torch.randn(sum(lengths), 4, 64, generator=gen, device=DEV)).to(torch.bfloat16)
              .requires_grad_(True) for _ in range(3)]

    def torch_cudnn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return attention.sdpa(q, k, v, cu)

    pair = (torch_cudnn, lambda q, k, v: attention.cudnn(q, k, v, cu))
    for fn in pair if first == "sdpa" else pair[::-1]:
        check_qkv(fn, leaves, cu, 1e-2, 2e-2)


def test_cudnn_gives_a_trained_models_gradients(monkeypatch):
    """Issue 32 at the model level: one bf16-autocast step of checkpoints/tiny-base (trained) on
    this repository's source files packed 6 to a sequence, every document past 128 tokens through
    our cuDNN wrapper, run after the sdpa backend's step on PyTorch's cuDNN path (the order in
    which backend_grads found cosines of -0.17): each parameter's gradient as close to the fp32
    one as FlashAttention-2's is."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from longctx.data.tokenizer import TextTokenizer
    from longctx.train.loop import autocast
    from longctx.train.models import load_model

    if "cudnn" not in attention.available(DEV) or "varlen" not in attention.available(DEV):
        pytest.skip("no cuDNN attention or FlashAttention-2 varlen here")
    base = REPO / "checkpoints" / "tiny-base"
    texts = [p.read_text() for p in sorted((REPO / "src" / "longctx").rglob("*.py"))]
    docs = [d for d in TextTokenizer.load(base).encode_texts(texts, add_bos=True, add_eos=False) if len(d) >= 512]
    lengths = [512, 37, 300, 512, 90, 450]  # 512: a plan size, so both paths give cuDNN the same q/k/v
    ids = torch.cat([torch.as_tensor(docs[i][:n]) for i, n in enumerate(lengths)]).long().to(DEV)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    labels = torch.cat((ids[1:], ids.new_full((1,), -100)))
    labels[torch.tensor(bounds[1:-1]) - 1] = -100
    monkeypatch.setattr(cudnn_attention, "LONG_DOC", 128)

    def grads(backend: str, bf16: bool) -> dict[str, torch.Tensor]:
        model = load_model(base, backend).to(DEV)
        with autocast(model, DEV) if bf16 else contextlib.nullcontext():
            model(ids, bounds, labels=labels).backward()
        return {n: p.grad.double().flatten() for n, p in model.named_parameters()}

    def worst(g: dict[str, torch.Tensor]) -> float:
        return min(F.cosine_similarity(g[n], want[n], dim=0).item() for n in want)

    want = grads("sdpa", bf16=False)  # fp32: FlashAttention-2 and cuDNN take half precision only
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION], set_priority=True):
        torch_path = worst(grads("sdpa", bf16=True))
    flash = worst(grads("varlen", bf16=True))
    ours = worst(grads("cudnn", bf16=True))
    assert flash > 0.9 and ours >= flash - 0.01 and torch_path >= flash - 0.01, (ours, torch_path, flash)


def check_qkv(fn, leaves: list[torch.Tensor], cu: torch.Tensor, out_tol: float, grad_tol: float) -> None:
    """fn(q, k, v) and its q/k/v gradients against the fp64 reference on the same documents."""
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    ref = attention.reference(*ref_leaves, cu)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, g.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, ref_leaves, g)
    assert rel(out, ref) <= out_tol
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert rel(a, b) <= grad_tol, (name, rel(a, b))



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", [[2600, 37, 1400, 59], [59, 1400, 37, 2600]])
def test_peaked_attention_over_long_documents(backend, lengths):
    """The regime a trained model is in, which random unit inputs are not: sharp attention (logits
    of std ~8, as induction heads have them) over long documents beside short ones, bf16. cuDNN
    takes those past 1,024 tokens here (the rule would send none of these), padded to plan sizes
    with the next documents' rows (2,600 -> 2,816, 1,400 -> 1,408: sharp rows there must send
    nothing back), or, 2,600 last, cut at 2,560 with its last 40 rows FlashAttention-2's."""
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(32)
    q, k, v = (torch.randn(n, h, 64, generator=gen, device=DEV) for h in (4, 4, 4))
    q, k = 2.8 * q, 2.8 * k  # q.k / 8 has std ~8 at D 64
    leaves = [t.to(torch.bfloat16).requires_grad_(True) for t in (q, k, v)]
    with cudnn_attention.fixed_long_doc(1024):
        check_qkv(lambda *t: attention.BACKENDS[backend](*t, cu), leaves, cu, 2e-2, 3e-2)
