"""`Model`: a config, its params and (optionally) a tokenizer, handed around as one value."""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.models.config import LlamaConfig
from specjax.models.params import LlamaParams


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A loaded or built model. `tokenizer` is an HF tokenizer, or None for token-id-only use."""

    config: LlamaConfig
    params: LlamaParams
    tokenizer: Any = None
    name: str = "custom"
    # The checkpoint's own MTP layers (models/mtp.py: MTPLayerParams each), read where it has them
    # (DeepSeek-V3, GLM-4.5); the forward does not run them, specjax.MTP drafts with them.
    mtp: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.config, LlamaConfig):
            raise ValueError(
                f"Model config must be a specjax.models.LlamaConfig, got {type(self.config).__name__}"
            )
        if not isinstance(self.params, LlamaParams):
            raise ValueError(
                f"Model params must be specjax.models.LlamaParams, got {type(self.params).__name__}"
            )

    def with_mtp(self, layers) -> Model:
        """This model with `layers` as its MTP layers (an `MTPLayers` trained for it by
        `specjax.train.train_mtp`, or read by `load_head`), which `specjax.MTP` drafts with in
        place of any it has."""
        from specjax.models.mtp import MTPLayers

        if not isinstance(layers, MTPLayers):
            raise ValueError(
                f"with_mtp: layers must be a specjax.models.MTPLayers, got {type(layers).__name__}"
            )
        layers.check_target(self)
        return dataclasses.replace(self, mtp=layers.layers)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Model({self.name!r}, layers={c.num_layers}, hidden={c.hidden_size}, "
            f"heads={c.num_heads}/{c.num_kv_heads}, vocab={c.vocab_size})"
        )
