"""The evolutionary search (LongRoPE2 defaults: population 64, 40 generations, mutation 0.3 per
value, crossover 0.5, the top half kept). Lower fitness is better (needle NLL).

Deterministic for a seed: all randomness comes from one generator whose state is saved with the
population, the fitness cache and the history after every generation (atomically), so a killed
search resumes where it stopped and ends exactly as an uninterrupted one. Budgets (evaluations,
seconds) end it early at a generation boundary; the time budget makes the result depend on speed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..progress import progress
from .space import Individual, Space


@dataclass(frozen=True)
class Settings:
    population: int = 64
    generations: int = 40
    mutation: float = 0.3
    crossover: float = 0.5
    keep: float = 0.5
    seed: int = 0
    max_evaluations: int | None = None
    max_seconds: float | None = None


@dataclass
class State:
    generation: int
    population: list[Individual]
    cache: dict[Individual, float]
    rng: np.random.Generator
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    stopped: str | None = None

    def to_json(self) -> dict:
        enc = [[i.r, list(i.values), i.attention] for i in self.population]
        cache = [[i.r, list(i.values), i.attention, f] for i, f in self.cache.items()]
        return {"generation": self.generation, "population": enc, "cache": cache, "history": self.history,
                "rng": self.rng.bit_generator.state, "seconds": self.seconds, "stopped": self.stopped}

    @classmethod
    def from_json(cls, doc: dict) -> State:
        rng = np.random.default_rng()
        rng.bit_generator.state = doc["rng"]
        pop = [Individual(r, tuple(v), a) for r, v, a in doc["population"]]
        cache = {Individual(r, tuple(v), a): f for r, v, a, f in doc["cache"]}
        return cls(doc["generation"], pop, cache, rng, doc["history"], doc["seconds"], doc["stopped"])


def _save(state: State, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state.to_json()))
    os.replace(tmp, path)


def _load(path: Path) -> State | None:
    if not path.is_file():
        return None
    try:
        return State.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path}: unreadable search state ({e}); delete it to start the search over") from None


def search(space: Space, fitness: Callable[[Individual], float], settings: Settings, anchors: list[Individual],
           state_path: Path) -> State:
    """Run (or resume) the search; returns the final state, its population sorted best first."""
    state = _load(state_path)
    start = time.perf_counter()
    spent = state.seconds if state else 0.0

    def evaluate(pop: list[Individual]) -> None:
        for ind in pop:
            if ind not in state.cache:
                state.cache[ind] = float(fitness(ind))

    if state is None:
        rng = np.random.default_rng(settings.seed)
        pop = list(anchors[:settings.population])
        while len(pop) < settings.population:
            ind = space.random(rng)
            if ind not in pop:
                pop.append(ind)
        state = State(0, pop, {}, rng)
        evaluate(pop)
        state.population.sort(key=lambda i: state.cache[i])
        _record(state, settings)
        state.seconds = spent + time.perf_counter() - start
        _save(state, state_path)
    bar = progress(total=settings.generations, initial=state.generation, desc="rope_search", unit="gen")
    while state.generation < settings.generations and state.stopped is None:
        if settings.max_evaluations is not None and len(state.cache) >= settings.max_evaluations:
            state.stopped = f"max_evaluations {settings.max_evaluations} reached"
        elif settings.max_seconds is not None and state.seconds >= settings.max_seconds:
            state.stopped = f"max_seconds {settings.max_seconds} reached"
        else:
            _generation(state, space, settings)
            evaluate(state.population)
            state.population.sort(key=lambda i: state.cache[i])
            state.generation += 1
            _record(state, settings)
            bar.set_postfix(best=f"{state.history[-1]['best']:.4f}", evals=len(state.cache))
            bar.update(1)
        state.seconds = spent + time.perf_counter() - start
        _save(state, state_path)
    bar.close()
    return state


def _generation(state: State, space: Space, settings: Settings) -> None:
    """Keep the top fraction; fill up with mutated crossovers of kept parents, all distinct."""
    keep = max(2, int(round(settings.keep * settings.population)))
    parents = state.population[:keep]
    children: list[Individual] = []
    seen = set(parents)
    tries = 0
    while len(parents) + len(children) < settings.population and tries < 50 * settings.population:
        tries += 1
        a, b = (parents[int(i)] for i in state.rng.choice(len(parents), size=2, replace=False))
        child = space.mutate(space.crossover(a, b, state.rng, settings.crossover), state.rng, settings.mutation)
        if child not in seen:
            seen.add(child)
            children.append(child)
    state.population = parents + children


def _record(state: State, settings: Settings) -> None:
    fits = [state.cache[i] for i in state.population]
    best = state.population[0]
    state.history.append({"generation": state.generation, "best": fits[0], "mean": float(np.mean(fits)),
                          "evaluations": len(state.cache), "best_r": best.r, "best_values": list(best.values),
                          "best_attention": best.attention})
