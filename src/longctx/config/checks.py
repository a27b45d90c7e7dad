"""What ties the params' sections together (the mixes' domains and shares, chunk lengths against
sequence lengths, the splits stages train on, the search's window): checked once the sections
themselves are valid, each error naming the dotted key."""

from __future__ import annotations

import math
from typing import Any, Protocol

SUM_TOLERANCE = 1e-6


class Sections(Protocol):
    """What the checks read of schema.Params (which calls them as it validates: this module
    imports nothing of the schema)."""

    corpora: Any
    tokenize: Any
    pack: Any
    model: Any
    train: Any
    rope_search: Any
    eval: Any

    def flat_mix(self, split: str) -> dict[str, float]: ...

    def chunk_lengths(self, split: str, domain: str) -> dict[int, float]: ...


def consistent(params: Sections) -> None:
    """Raise ValueError naming the first key that does not fit the others."""
    domains = params.corpora.domains
    for g, sub in params.pack.groups.items():
        if g in domains:
            raise ValueError(f"pack.groups.{g}: name is also a corpora domain")
        _check_shares(f"pack.groups.{g}", sub)
        for d in sub:
            if d not in domains:
                raise ValueError(f"pack.groups.{g}.{d}: no such corpora domain")
    for name, split in params.pack.splits.items():
        where = f"pack.splits.{name}"
        _check_shares(f"{where}.mix", split.mix)
        base = split.base_len
        if base > split.seq_len or split.seq_len % base:
            raise ValueError(f"{where}.chunk_len: {base} must divide seq_len {split.seq_len}")
        mix = params.flat_mix(name)
        kinds = {domains[d].kind for d in mix}
        if "sft" in kinds and kinds - {"sft", "whole"}:
            raise ValueError(f"{where}.mix: sft domains mix with whole documents only (replayed with the loss on "
                             f"every token), not {sorted(kinds - {'sft', 'whole'})}")
        for d, shares in split.lengths.items():
            if d not in mix:
                raise ValueError(f"{where}.lengths.{d}: not in this split's mix")
            if domains[d].kind != "long":
                raise ValueError(f"{where}.lengths.{d}: only long domains take lengths")
            _check_shares(f"{where}.lengths.{d}", shares)
            for length in shares:
                if length <= 0 or length > split.seq_len or split.seq_len % length:
                    raise ValueError(
                        f"{where}.lengths.{d}.{length}: must be positive and divide "
                        f"seq_len {split.seq_len}"
                    )
        for d in mix:
            if domains[d].kind == "long":
                shortest = min(params.chunk_lengths(name, d))
                if params.tokenize.long_min_tokens > shortest:
                    raise ValueError(
                        f"tokenize.long_min_tokens: {params.tokenize.long_min_tokens} is above "
                        f"the chunk length {shortest} of long domain {d} in {where}"
                    )
    if params.train.base is None and params.train.pretrain.init == "base":
        raise ValueError("train.pretrain.init: 'base' needs a train.base section (or give a checkpoint dir)")
    stages = [("train.sft", params.train.sft)] + ([("train.base", params.train.base)] if params.train.base else [])
    stages += [(f"train.pretrain.stages.{i}", st) for i, st in enumerate(params.train.pretrain.stages)]
    for where, stage in stages:
        named = [(f"{where}.split", stage.split)]
        named += [(f"{where}.curriculum.{i}.split", p.split) for i, p in enumerate(stage.curriculum)]
        for field, split in named:
            if split not in params.pack.splits:
                raise ValueError(f"{field}: {split!r} is not a pack split ({sorted(params.pack.splits)})")
    base = params.train.base
    for split in [base.split, *(p.split for p in base.curriculum)] if base is not None else []:
        if (n := params.pack.splits[split].seq_len) > params.model.max_position_embeddings:
            raise ValueError(f"pack.splits.{split}.seq_len: {n} is beyond the base model's window "
                             f"(model.max_position_embeddings {params.model.max_position_embeddings}); training "
                             "past it is the long-context stages' work")
    if params.eval.retention_split is not None and params.eval.retention_split not in params.pack.splits:
        raise ValueError(f"eval.retention_split: {params.eval.retention_split!r} is not a pack split "
                         f"({sorted(params.pack.splits)})")
    rs = params.rope_search
    if rs.split is not None and rs.split not in params.pack.splits:
        raise ValueError(f"rope_search.split: {rs.split!r} is not a pack split ({sorted(params.pack.splits)})")
    if rs.target_length and rs.original_window and rs.target_length <= rs.original_window:
        raise ValueError(f"rope_search.target_length: {rs.target_length} must exceed the original window "
                         f"{rs.original_window}")


def _check_shares(where: str, shares: dict[Any, float]) -> None:
    if not shares:
        raise ValueError(f"{where}: empty")
    for k, v in shares.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{where}.{k}: share must be a positive number, got {v!r}")
    total = sum(shares.values())
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise ValueError(f"{where}: shares sum to {total:.6g}, must sum to 1")
