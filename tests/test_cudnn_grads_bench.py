"""bench/cudnn_grads.py's parts that run on a CPU: the input regimes are what they say, the capture
takes the asked layer's q/k/v and upstream gradient from the trained tiny base, and the error table
tells a right attention from a wrong one (the GPU variants run on a CUDA machine only)."""

import sys

import pytest
import torch

from conftest import REPO
from longctx.model import attention

sys.path.insert(0, str(REPO / "bench"))
import cudnn_grads  # noqa: E402

CPU = torch.device("cpu")
LENGTHS = [700, 37, 400, 59, 400]
VARIANTS = {"sdpa": attention.sdpa,
            "heads_swapped": lambda q, k, v, cu: attention.sdpa(q, k.flip(1), v, cu)}


@pytest.fixture(scope="module")
def results():
    out = {r: cudnn_grads.errors(cudnn_grads.synthetic(r, LENGTHS, (4, 2), 64, CPU), VARIANTS, torch.float32)
           for r in ("unit", "peaked", "sinks")}
    out["tiny-base"] = cudnn_grads.errors(cudnn_grads.captured(cudnn_grads.BASE, [512, 37, 300, 512], CPU, 3),
                                          VARIANTS, torch.float32)
    return out


def test_regimes_are_what_they_say(results):
    unit, peaked, sinks = (results[r]["_inputs"] for r in ("unit", "peaked", "sinks"))
    assert unit["top_weight"] < 0.1 < 0.5 < peaked["top_weight"]
    assert sinks["first_token_weight"] > 0.4 > 100 * peaked["first_token_weight"]
    assert results["tiny-base"]["_inputs"] == {"tokens": 1361, "heads": [2, 2], "head_dim": 32,
                                               "top_weight": pytest.approx(0.18, abs=0.05),  # (the stdlib's text)
                                               "first_token_weight": pytest.approx(0.002, abs=0.01)}
    with pytest.raises(ValueError, match="regime 'trained'"):
        cudnn_grads.synthetic("trained", LENGTHS, (4, 2), 64, CPU)


def test_errors_tell_a_right_attention_from_a_wrong_one(results):
    for regime, rows in results.items():
        assert max(rows["sdpa"][k] for k in ("out", "dq", "dk", "dv")) < 1e-4, regime
        assert min(rows["sdpa"][f"cos_d{x}"] for x in "qkv") > 0.9999, regime
        assert min(rows["heads_swapped"][k] for k in ("out", "dq", "dk")) > 0.5, regime
        assert abs(rows["heads_swapped"]["cos_dq"]) < 0.1, regime
    text = cudnn_grads.table(results)
    assert text.count("heads_swapped") == 4 and "(top weight" in text


def test_a_variant_that_raises_is_reported_not_fatal():
    inputs = cudnn_grads.synthetic("unit", [64, 32], (2, 2), 16, CPU)

    def refuses(q, k, v, cu):
        raise RuntimeError("no kernel for this shape")

    rows = cudnn_grads.errors(inputs, {"refuses": refuses, **VARIANTS}, torch.float32)
    assert rows["refuses"] == {"error": "RuntimeError: no kernel for this shape"}
    assert rows["sdpa"]["dq"] < 1e-4
    assert "no kernel for this shape" in cudnn_grads.table({"unit": rows})


def test_capture_takes_the_asked_layer_and_refuses_a_missing_one():
    first = cudnn_grads.captured(cudnn_grads.BASE, [128, 64], CPU, 0)
    last = cudnn_grads.captured(cudnn_grads.BASE, [128, 64], CPU, 3)
    assert first[4].tolist() == [0, 128, 192]
    assert all(t.shape == (192, 2, 32) for t in first[:4]) and not torch.equal(first[0], last[0])
    assert torch.isfinite(first[3]).all() and first[3].abs().sum() > 0  # the loss's gradient reached layer 0
    with pytest.raises(ValueError, match="no layer 4 .the model has 4"):
        cudnn_grads.captured(cudnn_grads.BASE, [128, 64], CPU, 4)


def test_main_says_it_needs_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["cudnn_grads.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        cudnn_grads.main()
    assert not any(tmp_path.iterdir())


def test_torch_cudnn_routes_as_the_wrapper(monkeypatch):
    """PyTorch's path takes cuDNN for documents of LONG_DOC tokens or more, flash for the rest (GQA by
    repeated heads): on a CPU the flash documents compute right, and a cuDNN one finds no kernel."""
    from longctx.model import cudnn_attention

    inputs = cudnn_grads.synthetic("peaked", [300, 37, 120], (4, 2), 32, CPU)
    variant = {"torch_cudnn": cudnn_grads.torch_cudnn}
    monkeypatch.setattr(cudnn_attention, "LONG_DOC", 10**9)
    row = cudnn_grads.errors(inputs, variant, torch.float32)["torch_cudnn"]
    assert max(row[k] for k in ("out", "dq", "dk", "dv")) < 1e-4
    monkeypatch.setattr(cudnn_attention, "LONG_DOC", 200)
    assert "error" in cudnn_grads.errors(inputs, variant, torch.float32)["torch_cudnn"]


def test_the_per_document_reference_is_the_dense_one():
    """The fp64 reference goes one document and one KV head at a time (a dense [H, N, N] over the
    8B's heads and 16K tokens would be 69 GB): the same out and gradients as one dense call."""
    q, k, v, g, cu = cudnn_grads.synthetic("peaked", [90, 7, 130], (6, 2), 16, CPU)
    out, grads = cudnn_grads.fp64_reference(q, k, v, g, cu)
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    dense = attention.reference(*leaves, cu)
    torch.testing.assert_close(out, dense.detach(), rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(dense, leaves, g.double()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("args,field", [(["--heads", "6", "4"], "--heads"), (["--lengths", "0", "9"], "--lengths"),
                                        (["--regimes", "trained"], "--regimes"), (["--order", "cudnn"], "--order")])
def test_impossible_arguments_are_refused_by_name(args, field, tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, "bench/cudnn_grads.py", *args, "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 2 and field in done.stderr and not list(tmp_path.iterdir())


def test_the_order_runs_each_variant_as_named_and_labels_repeats():
    got = cudnn_grads.ordered(["torch_cudnn", "wrapper", "torch_cudnn", "wrapper", "wrapper"])
    assert list(got) == ["torch_cudnn", "wrapper", "torch_cudnn_2", "wrapper_2", "wrapper_3"]
    assert got["wrapper_3"] is cudnn_grads.VARIANTS["wrapper"] and got["torch_cudnn_2"] is cudnn_grads.torch_cudnn
