"""Memory for length, checked on a CPU: the token-tiled MLP and the host offload of full
recomputation's block inputs compute exactly what the untiled, kept path computes (loss and
every gradient), under each recomputation mode and compiled; the tiled MLP keeps no
[tokens, ffn_dim] tensor for the backward; the offload takes back everything it moved, the
block saved last first, and starts each earlier one's copy as the later one is taken; `halves`
recomputation holds less at its peak than full's; all are params a training stage validates."""

from __future__ import annotations

import pytest
import torch
from test_training_speed import LAYOUTS, small, step, twins

from longctx.config import RunParams
from longctx.errors import ConfigError
from longctx.model.config import ModelConfig, RopeConfig
from longctx.model.offload import HostOffload
from longctx.train.compiled import compile_blocks
from longctx.train.loop import prepare
from longctx.train.models import build
from longctx.train.parallel import Parallel

TILE = 24  # divides none of the layouts' 128 tokens


def assert_same(a, b, atol=1e-6):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=0)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=atol)


def tiled(model, tile: int = TILE):
    for block in model.layers:
        block.mlp.tile = tile
    return model


@pytest.mark.parametrize("arch,mode", [("llama", "none"), ("llama", "full"), ("llama", "selective"),
                                       ("llama", "attention"), ("fox", "full")])  # (FoX: the kernel's interpreter)
def test_the_tiled_mlp_gives_the_same_loss_and_gradients(arch, mode):
    plain, other = twins(arch)
    plain.recompute = tiled(other).recompute = mode
    for i, cuts in enumerate(LAYOUTS):
        assert_same(step(plain, cuts, i), step(other, cuts, i))


@pytest.mark.parametrize("mode", ["full", "halves"])
def test_the_tiled_mlp_compiles_whole_and_matches_eager(mode):
    eager, compiled = twins("llama")
    tiled(eager)
    tiled(compiled).recompute = eager.recompute = mode
    torch._dynamo.reset()
    compile_blocks(compiled, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break is an error
    for i, cuts in enumerate(LAYOUTS):
        assert_same(step(eager, cuts, i), step(compiled, cuts, i), atol=1e-5)


def saved_shapes(model, cuts) -> list[tuple[int, ...]]:
    """Shapes of every tensor autograd keeps from a forward for the backward."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(model, cuts, 0)
    return shapes


def test_the_tiled_mlp_keeps_no_whole_sequence_intermediate():
    cfg = small("llama")
    plain, other = twins("llama")
    whole = [s for s in saved_shapes(plain, [0, 128]) if s == (128, cfg.ffn_dim)]
    assert len(whole) >= 2 * cfg.n_layers  # untiled: gate and up outputs of every block
    kept = saved_shapes(tiled(other), [0, 128])
    assert not [s for s in kept if cfg.ffn_dim in s], kept  # tiled: only tiles' inputs ([<= 24, d_model])
    assert max(s[0] for s in kept if s[-1] == cfg.d_model and len(s) == 2) == 128  # (the blocks' own inputs)


class Recorder(HostOffload):
    """The offload, recording which saved tensor (by its order of saving) was taken back and
    whose copy back was started, in order."""

    def __init__(self):
        super().__init__(torch.device("cpu"), min_bytes=0)
        self.order, self.events = {}, []

    def _pack(self, t):
        item = super()._pack(t)
        self.order[id(item)] = len(self.order)
        return item

    def _unpack(self, item):
        self.events.append(("take", self.order[id(item)]))
        return super()._unpack(item)

    def _start_back(self, item):
        if item.back is None:
            self.events.append(("copy", self.order[id(item)]))
        super()._start_back(item)


def test_offloaded_block_inputs_give_the_same_loss_and_gradients():
    arch = "llama"
    plain, other = twins(arch)
    plain.recompute = other.recompute = "full"
    offload = Recorder()
    for block in other.layers:
        block.offload = offload
    blocks = small(arch).n_layers
    for i, cuts in enumerate(LAYOUTS):
        offload.order.clear()
        offload.events.clear()
        assert_same(step(plain, cuts, i), step(other, cuts, i))
        assert len(offload.order) == blocks  # each block's input, nothing else
        assert offload.pending() == 0  # all taken back
        # the backward takes the last block's input first; taking block k starts block k-1's copy
        takes = [k for what, k in offload.events if what == "take"]
        assert takes == list(range(blocks - 1, -1, -1))
        for k in range(1, blocks):
            assert offload.events.index(("copy", k - 1)) < offload.events.index(("take", k - 1))
            assert offload.events.index(("copy", k - 1)) > offload.events.index(("take", k))


def test_host_copies_come_in_power_of_two_pieces_of_their_size():
    """The pinned allocator rounds each allocation up to a power of two: a 4.5 GiB block input in one
    piece took 8. In pieces it takes its size (rounded up to the smallest piece), and comes back
    whole, a non-contiguous one too."""
    from longctx.model.offload import PIECE, pieces

    gib = 1 << 30
    assert pieces(9 * gib // 2) == [4 * gib, gib // 2]
    assert pieces(4 * gib) == [4 * gib] and pieces(1) == [PIECE]
    assert pieces(3 * PIECE + 1) == [4 * PIECE]  # (rounded to the smallest piece, then split)
    for size in (5 * PIECE + 123, 7 * PIECE, PIECE // 2):
        parts = pieces(size)
        assert sum(parts) == -(-size // PIECE) * PIECE and all(p & (p - 1) == 0 for p in parts)
        assert parts == sorted(parts, reverse=True) and len(set(parts)) == len(parts)

    offload = HostOffload(torch.device("cpu"), min_bytes=0)
    gen = torch.Generator().manual_seed(0)
    for t in (torch.randn(5 * PIECE // 4 + 25, generator=gen),  # pieces of 4 and 2 x PIECE, the last part-filled
              torch.randn(PIECE // 8, 6, generator=gen).t()):  # non-contiguous, 2 and 1 x PIECE
        item = offload._pack(t)
        assert [p.numel() * 4 for p in item.host] == pieces(t.numel() * 4)
        assert len(item.host) == 2
        back = offload._unpack(item)
        assert back.shape == t.shape and torch.equal(back, t)
    assert offload.pending() == 0


def test_the_offload_takes_tensors_of_its_device_named_with_or_without_an_index():
    from longctx.model.offload import on

    cuda, first, second = torch.device("cuda"), torch.device("cuda:0"), torch.device("cuda:1")
    assert on(first, cuda) and on(first, first) and not on(second, first) and not on(torch.device("cpu"), cuda)


def peak_bytes(mode: str, tokens: int, d_model: int) -> int:
    """The largest sum of live tensors (weights included) over one forward and backward on the CPU
    under recomputation `mode` (torch's MemTracker), of a 3-block model with the MLP tiled."""
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = ModelConfig(vocab_size=97, d_model=d_model, n_layers=3, n_heads=4, n_kv_heads=1, ffn_dim=3 * d_model,
                      rope=RopeConfig())
    model = tiled(build(cfg, "sdpa"), tokens // 4)  # (sdpa: a flash kernel, no [tokens, tokens] scores)
    model.recompute = mode
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step(model, [0, tokens // 3, tokens], 0)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_halves_recomputation_holds_less_than_full_at_its_peak():
    """Full recomputation's backward runs the MLP half's beside every activation of the attention
    half; halves' beside the attention half's input and output alone (measured: 2.4 block inputs
    less here; on an H200 at 64K tokens of the 8B shape 3 (Transformer) and 7.5 (FoX (Pro)))."""
    tokens, d_model = 2048, 128
    block_input = tokens * d_model * 4
    full, halves = peak_bytes("full", tokens, d_model), peak_bytes("halves", tokens, d_model)
    assert halves <= full - 2 * block_input, (full / block_input, halves / block_input)
    assert peak_bytes("none", tokens, d_model) > full + 8 * block_input  # (the measure sees activations)


def test_offload_and_tiling_together_under_full_recomputation():
    plain, other = twins("llama")
    plain.recompute = tiled(other).recompute = "full"
    offload = HostOffload(torch.device("cpu"), min_bytes=0)
    for block in other.layers:
        block.offload = offload
    for i, cuts in enumerate(LAYOUTS):
        assert_same(step(plain, cuts, i), step(other, cuts, i))
    assert offload.pending() == 0


def test_offload_under_halves_recomputation_gives_the_same_loss_and_gradients():
    plain, other = twins("llama")
    plain.recompute, tiled(other).recompute = "full", "halves"
    offload = Recorder()
    for block in other.layers:
        block.offload = offload
    for i, cuts in enumerate(LAYOUTS):
        offload.order.clear()
        assert_same(step(plain, cuts, i), step(other, cuts, i))
        assert len(offload.order) == len(other.layers)  # the blocks' inputs alone, as under full
    assert offload.pending() == 0
    RunParams(steps=1, lr=1e-3, offload_activations=True, activation_checkpointing="halves")  # (valid)


def test_the_memory_params_are_validated():
    with pytest.raises(ValueError, match="offload_activations .* is .selective.: set it to full or halves"):
        RunParams(steps=1, lr=1e-3, offload_activations=True, activation_checkpointing="selective")
    with pytest.raises(ValueError, match="mlp_tile"):
        RunParams(steps=1, lr=1e-3, mlp_tile=0)
    model, _ = twins("llama")
    with pytest.raises(ConfigError, match="offload_activations: .* this run has no GPU"):
        prepare(model, RunParams(steps=1, lr=1e-3, offload_activations=True, activation_checkpointing="full"),
                Parallel(device=torch.device("cpu")))
    with pytest.raises(ValueError, match="offload_keep_last .* offload_activations moves, which is off"):
        RunParams(steps=1, lr=1e-3, offload_keep_last=1)
    with pytest.raises(ConfigError, match=f"offload_keep_last: {len(model.layers)} of the model's"):
        prepare(model, RunParams(steps=1, lr=1e-3, offload_activations=True, activation_checkpointing="full",
                                 offload_keep_last=len(model.layers)), Parallel(device=torch.device("cpu")))
    prepare(model, RunParams(steps=1, lr=1e-3, mlp_tile=64), Parallel(device=torch.device("cpu")))
    assert all(block.mlp.tile == 64 and block.offload is None for block in model.layers)
