"""Models: configs, the pure-functional transformer, its KV cache and checkpoint loading."""

from specjax.models.cache import FreshEntries, KVCache, cache_bytes, init_cache
from specjax.models.config import LlamaConfig, RopeScaling
from specjax.models.dflash import DFlashConfig, DFlashHead, DFlashParams
from specjax.models.draft_vocab import frequent_tokens
from specjax.models.eagle import EagleConfig, EagleHead, EagleParams
from specjax.models.eagle3 import Eagle3Config, Eagle3Head, Eagle3Params
from specjax.models.heads import load_head, save_head
from specjax.models.llama import forward, forward_hidden, lm_head
from specjax.models.loading import BUILTIN_MODELS, load
from specjax.models.medusa import MedusaConfig, MedusaHead, MedusaParams
from specjax.models.mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorHead, MLPSpeculatorParams
from specjax.models.model import Model
from specjax.models.mtp import MTPLayers
from specjax.models.params import LayerParams, LlamaParams, init_params
from specjax.models.signature import target_signature

__all__ = [
    "BUILTIN_MODELS",
    "DFlashConfig",
    "DFlashHead",
    "DFlashParams",
    "Eagle3Config",
    "Eagle3Head",
    "Eagle3Params",
    "EagleConfig",
    "EagleHead",
    "EagleParams",
    "FreshEntries",
    "KVCache",
    "LayerParams",
    "LlamaConfig",
    "LlamaParams",
    "MedusaConfig",
    "MedusaHead",
    "MedusaParams",
    "MLPSpeculatorConfig",
    "MLPSpeculatorHead",
    "MLPSpeculatorParams",
    "Model",
    "MTPLayers",
    "RopeScaling",
    "cache_bytes",
    "forward",
    "frequent_tokens",
    "forward_hidden",
    "init_cache",
    "init_params",
    "lm_head",
    "load",
    "load_head",
    "save_head",
    "target_signature",
]
