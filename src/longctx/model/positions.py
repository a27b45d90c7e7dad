"""Position encodings beside RoPE: a learned absolute table (APE), ALiBi's slopes, and SeqPE
("Transformer with Sequential Position Encoding", 2025: a learned encoder of each position's
decimal digits, regularised to extrapolate).

SeqPE follows the official text models (github ghrua/seqpe, GPT-2 on WikiText-103): the digits
are left-padded with zeros (the pad is the digit 0), a learned CLS vector is read last, the
encoder is pre-norm and causal, and one shared projection turns each position's embedding into
per-head query and key parts: the logits become (q.k + p_q(i).p_k(j)) / sqrt(d) in every layer.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch import nn

from .config import LearnedPositions, SeqPEConfig


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes m_h: a geometric sequence from 2^(-8/n) for n a power of two; other
    head counts take the closest power of two's slopes and every other one of twice that."""
    def geometric(n: int) -> list[float]:
        first = 2 ** (-8 / n)
        return [first ** (i + 1) for i in range(n)]

    n = 2 ** int(math.log2(heads))
    slopes = geometric(n) + geometric(2 * n)[0::2][: heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def _limit(positions: torch.Tensor, size: int, beyond: str, what: str, known_max: int | None) -> torch.Tensor:
    """Positions checked against a table of `size` (an error naming the setting, or clamped);
    `known_max` from the host spares a device read."""
    top = known_max if known_max is not None else int(positions.max()) if positions.numel() else 0
    if top < size:
        return positions
    if beyond == "error":
        raise ValueError(f"position {top} is past the {what} ({size} positions); set {what.split()[0]}.beyond: "
                         "clamp to reuse the last one, or train on longer sequences")
    return positions.clamp(max=size - 1)


class LearnedTable(nn.Module):
    """The APE table, added to the token embeddings."""

    def __init__(self, cfg: LearnedPositions, window: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(window, d_model))
        self.beyond = cfg.beyond

    def forward(self, positions: torch.Tensor, known_max: int | None = None) -> torch.Tensor:
        positions = _limit(positions, self.weight.shape[0], self.beyond, "learned_positions table", known_max)
        return F.embedding(positions, self.weight)


class _EncoderBlock(nn.Module):
    """Pre-norm, causal self-attention and a GELU MLP over one position's digits."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, t, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(p, t, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(p, t, dim))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class SeqPE(nn.Module):
    """Position -> embedding [dim] through its digits. Under no_grad (evaluation, decoding) the
    embeddings of positions [0, 2^k) are computed once and kept until a weight changes."""

    def __init__(self, cfg: SeqPEConfig):
        super().__init__()
        self.cfg = cfg
        self.digit = nn.Embedding(10, cfg.dim)
        self.place = nn.Embedding(cfg.digits, cfg.dim)
        self.cls = nn.Parameter(torch.empty(1, cfg.dim))
        self.blocks = nn.ModuleList(_EncoderBlock(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self._table: tuple[tuple, torch.Tensor] | None = None

    @property
    def size(self) -> int:
        """Positions the digits can write: 10^digits."""
        return 10**self.cfg.digits

    def digits(self, positions: torch.Tensor, known_max: int | None = None) -> torch.Tensor:
        """[P, digits] decimal digits, most significant first, left-padded with zeros."""
        positions = _limit(positions.long(), self.size, self.cfg.beyond, "seqpe digits", known_max)
        powers = 10 ** torch.arange(self.cfg.digits - 1, -1, -1, device=positions.device)
        return positions[:, None] // powers % 10

    def encode(self, positions: torch.Tensor, known_max: int | None = None) -> torch.Tensor:
        """Embeddings [P, dim] of positions [P], always computed (what training differentiates)."""
        d = self.digits(positions, known_max)
        x = self.digit(d) + self.place.weight[None]
        x = torch.cat((x, self.cls.expand(x.shape[0], 1, -1)), dim=1)  # the CLS token reads every digit
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x[:, -1])) / self.cfg.temperature

    def forward(self, positions: torch.Tensor, known_max: int | None = None) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.encode(positions, known_max)
        top = known_max if known_max is not None else int(positions.max()) if positions.numel() else 0
        if top >= self.size:
            return self.encode(positions, known_max)  # past the digits: error or clamp as configured
        return self._cached(top)[positions]

    def _cached(self, top: int) -> torch.Tensor:
        key = tuple((p.data_ptr(), p._version) for p in self.parameters())
        if self._table is None or self._table[0] != key or self._table[1].shape[0] <= top:
            span = min(self.size, 1 << max(top, 255).bit_length())
            self._table = (key, self.encode(torch.arange(span, device=self.cls.device)))
        return self._table[1]


# ---------------------------------------------------------------------------------------------
# SeqPE's regularisers (the official `SeqPeContrstiveDataSampler`, `SeqPeTransferDataSampler`
# and criteria, re-derived): positions are sampled on the host, seeded per step

def _digit_edits(n: int, top: int, rng: random.Random, count: int) -> list[int]:
    """Hard negatives: `n` with one to three digits added, swapped, changed or deleted, under top."""
    out: list[int] = []
    for _ in range(count * 4):
        s = list(str(n))
        for _ in range(rng.randint(1, 3)):
            op = rng.choice(("add", "swap", "edit", "delete"))
            i = rng.randrange(len(s))
            if op == "add":
                s.insert(i, str(rng.randrange(10)))
            elif op == "swap" and len(s) > 1:
                j = rng.randrange(len(s))
                s[i], s[j] = s[j], s[i]
            elif op == "edit":
                s[i] = str(rng.randrange(10))
            elif op == "delete" and len(s) > 1:
                del s[i]
        m = int("".join(s))
        if m != n and m < top and m not in out:
            out.append(m)
        if len(out) == count:
            break
    return out


def contrastive_batch(rng: random.Random, top: int, pivots: int = 16, candidates: int = 32,
                      hard_rate: float = 0.4, window: int = 256) -> tuple[list[int], list[list[int]], list[int]]:
    """(pivots, their candidates, the index of each pivot's nearest candidate by |n - m|). The
    candidates are random positions, led in 40% of pivots by digit-edited hard negatives (kept
    only when farther than every random one, as the official sampler does) and otherwise by a
    local window of positions."""
    piv, cands, labels = [], [], []
    for _ in range(pivots):
        n = rng.randrange(top)
        randoms = [m for m in rng.sample(range(top), min(top, candidates + 1)) if m != n][:candidates]
        nearest = min(abs(m - n) for m in randoms)
        if rng.random() < hard_rate:
            special = [m for m in _digit_edits(n, top, rng, candidates // 4) if abs(m - n) > nearest]
        else:
            start = rng.randrange(max(1, top - window))
            special = rng.sample(range(start, min(top, start + max(window, 5 * candidates))), candidates)
        merged = list(dict.fromkeys(m for m in special + randoms if m != n))[:candidates]
        piv.append(n)
        cands.append(merged)
        labels.append(min(range(len(merged)), key=lambda i: abs(merged[i] - n)))
    return piv, cands, labels


def contrastive_loss(pe: SeqPE, piv: list[int], cands: list[list[int]], labels: list[int]) -> torch.Tensor:
    """Cross-entropy of each pivot's dot products with its candidates, the nearest the target."""
    device = pe.cls.device
    width = min(len(c) for c in cands)
    cand = torch.tensor([c[:width] for c in cands], device=device)
    emb = pe.encode(torch.cat((torch.tensor(piv, device=device), cand.reshape(-1))))
    p, c = emb[: len(piv)], emb[len(piv):].view(len(piv), width, -1)
    logits = torch.einsum("pd,pcd->pc", p.float(), c.float())
    return F.cross_entropy(logits, torch.tensor(labels, device=device).clamp(max=width - 1))


def distillation_batch(rng: random.Random, window: int, top: int, starts: int = 16,
                       count: int = 32) -> tuple[list[int], list[int]]:
    """(offsets p, in-window positions idx): students are p + idx, teachers idx, p drawn from
    [window / 4, top - window)."""
    low, high = window // 4, max(window // 4 + 1, top - window)
    return [rng.randrange(low, high) for _ in range(starts)], rng.sample(range(window), min(count, window))


def distillation_loss(pe: SeqPE, offsets: list[int], idx: list[int], heads: int) -> torch.Tensor:
    """Symmetric KL between the per-head similarity distributions of out-of-window positions and
    of the in-window ones they shift (the teacher detached in both directions)."""
    device = pe.cls.device
    base = torch.tensor(idx, device=device)
    teacher = pe.encode(base).detach()
    student = pe.encode((torch.tensor(offsets, device=device)[:, None] + base).reshape(-1))

    def dist(x: torch.Tensor) -> torch.Tensor:
        x = x.float().view(*x.shape[:-1], heads, -1).transpose(-3, -2)  # [..., heads, count, d]
        return torch.log_softmax(x @ x.transpose(-1, -2), dim=-1)

    t = dist(teacher)[None]
    s = dist(student.view(len(offsets), len(idx), -1))
    # KL(t || s) + KL(s || t), each averaged over every entry (the official kl_div 'mean')
    return (t.exp() * (t - s)).mean() + (s.exp() * (s - t)).mean()
