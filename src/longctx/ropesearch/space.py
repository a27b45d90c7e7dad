"""LongRoPE2's search space: per-frequency rescale factors lambda_i (theta_i' = theta_i / lambda_i)
for the i = 0 .. d/2-1 frequencies of a head, and the baselines expressed as such factors.

Frequency i has period 2*pi*theta^(2i/d). Frequencies whose period exceeds the original window
L_train never complete a turn in training (from the theoretical critical index i_tcd on) and
need lambda_i >= s = L / L_train. Higher frequencies than i_tcd are often under-trained too, so
the real critical index r is searched among the indices from the one with 10 periods in L_train
up to i_tcd. An individual is (r, values, attention): for i >= r, lambda_i = values,
non-decreasing in [s, factor_max * s]; for i < r, lambda_i = lambda_r^(i/r) (NTK-style);
attention is the logit temperature, LongRoPE2's sqrt(1 + ln s / ln L_train) unless the search
may also try 1.0. (Indices here count frequencies; the paper's dimension numbers are twice these.)

Two options widen the paper's space for models whose critical frequencies sit above the theory
(small or briefly trained ones, as the tiny profile's): `critical_max = "all"` lets r go up to
the last frequency (r = d/2 - 1 with lambda = s there is exactly NTK), and `search_attention`
adds temperature 1.0 as a choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..model.config import RopeConfig
from ..model.rope import inverse_frequencies


def critical_index(head_dim: int, theta: float, window: int) -> int:
    """i_tcd: the first frequency whose period is at least the window."""
    half = head_dim // 2
    return min(half - 1, max(0, math.ceil(half * math.log(window / (2 * math.pi)) / math.log(theta))))


def periods_index(head_dim: int, theta: float, window: int, periods: float = 10.0) -> int:
    """The first frequency that turns at most `periods` times inside the window."""
    half = head_dim // 2
    return min(half - 1, max(1, math.ceil(half * math.log(window / (2 * math.pi * periods)) / math.log(theta))))


@dataclass(frozen=True)
class Individual:
    r: int
    """The real critical index."""
    values: tuple[float, ...]
    """lambda_i for i = lo .. d/2-1 (only i >= r are used); non-decreasing."""
    attention: float
    """The attention factor (cos/sin scale) used past the original window."""


@dataclass(frozen=True)
class Space:
    head_dim: int
    theta: float
    original: int
    target: int
    factor_max: float = 2.0
    critical_max: str = "theory"
    """Highest candidate for r: "theory" (i_tcd, the paper) or "all" (the last frequency)."""
    search_attention: bool = False

    @property
    def half(self) -> int:
        return self.head_dim // 2

    @property
    def scale(self) -> float:
        return self.target / self.original

    @property
    def lo(self) -> int:
        return min(periods_index(self.head_dim, self.theta, self.original), self.tcd)

    @property
    def tcd(self) -> int:
        return critical_index(self.head_dim, self.theta, self.original)

    @property
    def r_max(self) -> int:
        return self.tcd if self.critical_max == "theory" else self.half - 1

    @property
    def paper_attention(self) -> float:
        return round(math.sqrt(1 + math.log(self.scale) / math.log(self.original)), 6)

    @property
    def attentions(self) -> tuple[float, ...]:
        return (self.paper_attention, 1.0) if self.search_attention else (self.paper_attention,)

    @property
    def bounds(self) -> tuple[float, float]:
        return self.scale, self.factor_max * self.scale

    def factors(self, ind: Individual) -> np.ndarray:
        """lambda for every frequency of the head."""
        out = np.empty(self.half)
        out[self.lo:] = ind.values
        at_r = out[ind.r]
        i = np.arange(ind.r)
        out[:ind.r] = at_r ** (i / ind.r)
        return out

    def project(self, factors: np.ndarray, r: int, attention: float) -> Individual:
        """The nearest individual to a full factor vector: clipped into bounds, made monotone."""
        lo, hi = self.bounds
        values = np.maximum.accumulate(np.clip(np.asarray(factors, dtype=float)[self.lo:], lo, hi))
        return Individual(r, _rounded(values), attention)

    def random(self, rng: np.random.Generator) -> Individual:
        lo, hi = self.bounds
        values = np.sort(rng.uniform(lo, hi, self.half - self.lo))
        attention = self.attentions[int(rng.integers(len(self.attentions)))]
        return Individual(int(rng.integers(self.lo, self.r_max + 1)), _rounded(values), attention)

    def mutate(self, ind: Individual, rng: np.random.Generator, p: float) -> Individual:
        """Each value with probability p is redrawn between its neighbours (keeping the order);
        r moves one step with probability p."""
        lo, hi = self.bounds
        v = list(ind.values)
        for j in range(len(v)):
            if rng.random() < p:
                left = v[j - 1] if j > 0 else lo
                right = v[j + 1] if j + 1 < len(v) else hi
                v[j] = float(rng.uniform(left, right))
        r, attention = ind.r, ind.attention
        if rng.random() < p:
            r = int(np.clip(r + rng.choice([-1, 1]), self.lo, self.r_max))
        if len(self.attentions) > 1 and rng.random() < p:
            attention = self.attentions[int(rng.integers(len(self.attentions)))]
        return Individual(r, _rounded(np.asarray(v)), attention)

    def crossover(self, a: Individual, b: Individual, rng: np.random.Generator, p: float) -> Individual:
        """Each value (and r, and the attention factor) from the other parent with probability p,
        then made monotone."""
        take = rng.random(len(a.values)) < p
        values = np.where(take, b.values, a.values)
        r = b.r if rng.random() < p else a.r
        attention = b.attention if rng.random() < p else a.attention
        return Individual(r, _rounded(np.maximum.accumulate(values)), attention)


def _rounded(values: np.ndarray) -> tuple[float, ...]:
    """Values rounded to 1e-6, so that repeated individuals hit the fitness cache."""
    return tuple(round(float(x), 6) for x in values)


# ---------------------------------------------------------------- methods as RoPE configs


def method_ropes(space: Space, base_change_theta: float | None) -> dict[str, RopeConfig]:
    """The baselines, as the RoPE settings a model runs with at the target length."""
    s, d, theta = space.scale, space.head_dim, space.theta
    ropes = {
        "original": RopeConfig(theta=theta),
        "pi": RopeConfig(type="linear", theta=theta, factor=s),
        "ntk": RopeConfig(theta=theta * s ** (d / (d - 2))),
        "yarn": RopeConfig(type="yarn", theta=theta, factor=s, original_max_position_embeddings=space.original),
    }
    if base_change_theta is not None:
        ropes["base_change"] = RopeConfig(theta=base_change_theta)
    return ropes


def longrope(space: Space, factors: np.ndarray, attention: float | None = None) -> RopeConfig:
    """Factors in HF's longrope form: short factors 1 (inside the original window), long factors
    given; attention factor given, else LongRoPE2's sqrt(1 + ln s / ln L_train); the scale s."""
    return RopeConfig(type="longrope", theta=space.theta, short_factor=[1.0] * space.half,
                      long_factor=[float(x) for x in factors], original_max_position_embeddings=space.original,
                      factor=space.scale, attention_factor=attention or space.paper_attention)


def rope_of(space: Space, ind: Individual) -> RopeConfig:
    return longrope(space, space.factors(ind), ind.attention)


def factors_of(rope: RopeConfig, space: Space) -> np.ndarray:
    """lambda_i = theta_i / theta_i' of any RoPE setting at the target length."""
    plain, _ = inverse_frequencies(RopeConfig(theta=space.theta), space.head_dim, space.target)
    scaled, _ = inverse_frequencies(rope, space.head_dim, space.target, space.target)
    return (plain / scaled).double().numpy()


def seeds(space: Space, ropes: dict[str, RopeConfig]) -> list[Individual]:
    """The initial population's anchors: every baseline's factors projected into the space at
    every candidate critical index (and attention factor), interleaved so that the first few
    cover every baseline: round k holds each baseline at the k-th index of (r_max, i_tcd, lo,
    the rest)."""
    order = list(dict.fromkeys([space.r_max, space.tcd, space.lo, *range(space.lo, space.r_max + 1)]))
    projected = {name: factors_of(rope, space) for name, rope in ropes.items()}
    out = [space.project(f, r, a) for r in order for f in projected.values() for a in space.attentions]
    return list(dict.fromkeys(out))
