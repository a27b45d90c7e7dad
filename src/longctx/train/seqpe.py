"""What training adds for SeqPE models ("Transformer with Sequential Position Encoding", 2025):
random position shifts and the contrastive and distillation regularisers, drawn per step from a
generator seeded by (seed, step) so a resumed run draws what an uninterrupted one would."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..config import RunParams
from ..config.train_params import SeqPETraining
from ..errors import ConfigError
from ..model.positions import contrastive_batch, contrastive_loss, distillation_batch, distillation_loss
from ..model.transformer import Transformer


@dataclass
class SeqPEStep:
    cfg: SeqPETraining
    rng: random.Random
    window: int
    """The model's training window: the distillation's teachers lie inside it."""

    @classmethod
    def of(cls, model: Transformer, run: RunParams, step: int) -> SeqPEStep | None:
        """This step's draws for a SeqPE model; None for any other."""
        seqpe = model.cfg.seqpe
        if seqpe is None:
            return None
        if run.seqpe.max_position > 10**seqpe.digits:
            raise ConfigError(f"seqpe.max_position {run.seqpe.max_position} is past what the model's "
                              f"{seqpe.digits} digits write ({10**seqpe.digits} positions)")
        if run.seqpe.max_position <= model.cfg.max_position_embeddings:
            raise ConfigError(f"seqpe.max_position {run.seqpe.max_position} must exceed the model's window "
                              f"{model.cfg.max_position_embeddings}: the regularisers teach positions beyond it")
        return cls(run.seqpe, random.Random(run.seed * 1_000_003 + step), model.cfg.max_position_embeddings)

    def offset(self, longest: int) -> int:
        """A random shift of every position of the step (rate shift_rate), else 0."""
        if self.rng.random() >= self.cfg.shift_rate:
            return 0
        return self.rng.randrange(1, max(2, self.cfg.max_position - longest))

    def regularise(self, model: Transformer, shifted: bool, ranks: int) -> dict[str, torch.Tensor]:
        """Backward of the weighted regularisers (over `ranks`, whose gradients are summed: each
        rank draws the same positions); their values, on the device. A shifted step skips the
        distillation, as the official trainer does."""
        terms: dict[str, tuple[float, torch.Tensor]] = {}
        if self.cfg.contrastive_weight:
            batch = contrastive_batch(self.rng, self.cfg.max_position)
            terms["seqpe_contrastive"] = (self.cfg.contrastive_weight, contrastive_loss(model.seqpe, *batch))
        if self.cfg.distill_weight and not shifted:
            batch = distillation_batch(self.rng, self.window, self.cfg.max_position)
            terms["seqpe_distill"] = (self.cfg.distill_weight,
                                      distillation_loss(model.seqpe, *batch, heads=model.cfg.seqpe.heads))
        if terms:
            (sum(w * loss for w, loss in terms.values()) / ranks).backward()
        return {name: loss.detach() for name, (_, loss) in terms.items()}
