"""Training: Medusa and EAGLE heads distilled from the target's own continuations, and their
checkpoints."""

from specjax.train.checkpoint import load_head, save_head
from specjax.train.data import DistillationData, distill_data
from specjax.train.eagle import eagle_loss, evaluate_eagle, train_eagle
from specjax.train.medusa import evaluate_medusa, medusa_loss, train_medusa
from specjax.train.prompts import self_instruct_prompts

__all__ = [
    "DistillationData",
    "distill_data",
    "eagle_loss",
    "evaluate_eagle",
    "evaluate_medusa",
    "load_head",
    "medusa_loss",
    "save_head",
    "self_instruct_prompts",
    "train_eagle",
    "train_medusa",
]
