"""Tiny random models shared by the tests (real weights are not the point there)."""

import jax

from specjax.models import LlamaConfig, Model, init_params


def tiny_config(**overrides) -> LlamaConfig:
    # An untied head gives logits of unit scale: distributions with some spread, unlike a tied
    # random model, which mostly predicts the token it was just fed.
    fields = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        eos_token_ids=(),
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> Model:
    config = tiny_config(**overrides)
    return Model(config, init_params(config, jax.random.key(seed)), name=f"tiny-{seed}")
