"""Training: Medusa heads distilled from the target's own continuations, and their checkpoints."""

from specjax.train.checkpoint import load_head, save_head
from specjax.train.medusa import (
    MedusaData,
    distill_medusa_data,
    evaluate_medusa,
    medusa_loss,
    train_medusa,
)

__all__ = [
    "MedusaData",
    "distill_medusa_data",
    "evaluate_medusa",
    "load_head",
    "medusa_loss",
    "save_head",
    "train_medusa",
]
