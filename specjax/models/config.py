"""The static description of a Llama-family model.

A config is frozen and hashable: it is passed to jitted functions as a static argument, so two
models with equal configs share compiled programs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# HF `model_type`s whose checkpoints this forward reproduces exactly.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling, as in HF's `rope_scaling` (types "linear" and "llama3")."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2-style biases on the q, k and v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"LlamaConfig.hidden_size ({self.hidden_size}) must divide by num_heads "
                    f"({self.num_heads}) when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"LlamaConfig.model_type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Build a config from an HF `config.json` dict, refusing what the forward cannot run."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act {hf['hidden_act']!r} is not supported; only 'silu' is")
        if model_type == "mistral" and hf.get("sliding_window"):
            # Sliding-window attention would change the logits once a sequence outgrows the window.
            raise ValueError(
                f"config.json sliding_window={hf['sliding_window']} is not supported; "
                "only full attention (sliding_window null) is"
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rope_theta=float(_rope_parameters(hf).get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling_from_hf(_rope_parameters(hf)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
        )


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 nests rope settings in `rope_parameters`; older configs keep them flat."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    if "rope_theta" in hf:
        params.setdefault("rope_theta", hf["rope_theta"])
    return params


def rope_scaling_from_hf(params: dict[str, Any]) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"config.json rope_scaling type {rope_type!r} is not supported; supported: default, linear, llama3"
    )
