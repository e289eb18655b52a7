"""Training: Medusa, EAGLE, EAGLE-3, DFlash and MLP speculator heads and MTP layers distilled
from the target's own continuations, and their checkpoints. `train_head(model, "eagle3",
TrainingOptions(...))` runs the whole pipeline of `specjax train-*` (specjax.train.pipeline).
`load_head` / `save_head` live in specjax.models.heads (re-exported here)."""

from specjax.models.heads import load_head, save_head
from specjax.train.data import DistillationData, distill_data, target_features
from specjax.train.dflash import dflash_loss, evaluate_dflash, train_dflash
from specjax.train.eagle import eagle_loss, evaluate_eagle, train_eagle
from specjax.train.eagle3 import eagle3_loss, evaluate_eagle3, train_eagle3
from specjax.train.medusa import evaluate_medusa, medusa_loss, train_medusa
from specjax.train.mlp_speculator import mlp_speculator_loss, train_mlp_speculator
from specjax.train.mtp import mtp_loss, train_mtp
from specjax.train.pipeline import (
    HEAD_TRAINERS,
    HeadTrainer,
    OptionError,
    TrainingOptions,
    continuations,
    distillation_set,
    draft_vocab_size,
    prompt_sources,
    read_prompts,
    train_head,
    training_prompts,
)
from specjax.train.prompts import self_instruct_prompts

__all__ = [
    "HEAD_TRAINERS",
    "DistillationData",
    "HeadTrainer",
    "OptionError",
    "TrainingOptions",
    "continuations",
    "distillation_set",
    "draft_vocab_size",
    "distill_data",
    "dflash_loss",
    "eagle3_loss",
    "eagle_loss",
    "evaluate_dflash",
    "evaluate_eagle",
    "evaluate_eagle3",
    "evaluate_medusa",
    "load_head",
    "medusa_loss",
    "mlp_speculator_loss",
    "mtp_loss",
    "prompt_sources",
    "read_prompts",
    "save_head",
    "self_instruct_prompts",
    "target_features",
    "train_dflash",
    "train_eagle",
    "train_eagle3",
    "train_head",
    "train_medusa",
    "train_mlp_speculator",
    "train_mtp",
    "training_prompts",
]
