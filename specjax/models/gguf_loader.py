"""Read a llama.cpp `.gguf` file: config, float32 weights and tokenizer, without torch.

The architectures (`general.architecture`) read are those llama.cpp's converter
(convert_hf_to_gguf.py) writes for the families specjax runs:

- llama: Llama, Mistral (whose GGUF architecture is llama) and Mixtral (each layer's experts
  stacked in `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, its router in `ffn_gate_inp`);
- qwen2 (q/k/v biases), qwen3 (q/k norms; `attention.key_length` apart from hidden / heads) and
  qwen3moe (experts as Mixtral's, each `expert_feed_forward_length` wide);
- gemma3 (four norms a layer, q/k norms, local and global layers);
- glm4moe (GLM-4.5) and deepseek2 (DeepSeek-V3): a dense MLP in the first
  `leading_dense_block_count` layers, then sigmoid-routed experts with their choice's correction
  bias (`exp_probs_b`), expert groups, routed scaling and shared experts (`ffn_*_shexp`);
  deepseek2's latent attention (`attn_q_a`, `attn_kv_a_mqa`, ...; models/mla.py);
- gpt-oss: attention sinks (`attn_sinks`), biases on the output, the router and the experts,
  local and global layers alternating.

What differs from an HF checkpoint:

- Weights may be quantized (Q4_1, Q8_0, ...); `gguf.quants.dequantize` turns each into float32,
  or with `keep_blocks` (`load(..., quantization="gguf")`) the projections and the head in the
  formats of models/quantized.py (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) stay as their integers and scales.
- llama only: the converter reorders the rows of the q and k projections within each head, for
  llama.cpp's rotary kernel that rotates adjacent pairs (x[2i], x[2i+1]). Our forward, like HF,
  rotates the halves (x[i], x[i + E/2]), so the reorder is undone here (`unpermute_rotary_rows`).
  llama.cpp runs the other architectures with its NEOX kernel, which rotates halves: their rows are
  stored as HF's.
- gemma3: the converter stores every norm weight as 1 + w (llama.cpp's RMSNorm multiplies by the
  stored weight); our "gemma" norm multiplies by 1 + w, so 1 is subtracted here.
- There is no `tokenizer.json`: the vocabulary, merges or scores and special ids are metadata
  (`tokenizer.ggml.*`), from which models/gguf_tokenizer.py rebuilds the family's tokenizer.
- deepseek2: newer converters split kv_b_proj per head into `attn_k_b` (its key rows, transposed)
  and `attn_v_b`, joined back here; it is one kv head of kv_lora_rank + rotary dims in the
  metadata (`key_length`), the heads' own sizes in `key_length_mla` / `value_length_mla`.
- gpt-oss: the converter splits the interleaved gate_up_proj into gate and up (as hf_loader does)
  and stores the experts in GGML's MXFP4, dequantized by gguf-py like any other type.
- Any mixture: the converter's --fuse-gate-up-exps writes the experts' gate and up as one
  `ffn_gate_up_exps` (gate's rows, then up's), split here (dequantized, even with keep_blocks).
- glm4moe: the MTP layers are the last `nextn_predict_layers` blocks (their own tensors under
  `nextn.`), read as hf_loader reads an HF folder's (`mtp.{j}.*`, models/mtp.py).

What the format does not say, and what is assumed instead (llama.cpp's own choices):

- llama: the converter writes no sliding window for Mistral or Mixtral, and llama.cpp runs them
  with full attention; a file that does carry `llama.attention.sliding_window` gets that window.
- gemma3: query_pre_attn_scalar is not stored; llama.cpp scales scores by head_dim ** -0.5, or by
  (hidden / heads) ** -0.5 for the 62-layer 27B, which is what Gemma 3's own configs say. Which
  layers are local: `attention.sliding_window_pattern` (a bool per layer, or n: every n-th layer
  global), which the converter does not write, else every sixth layer global. Local layers rotate
  with `rope.freq_base_swa` (default 10000) and no scaling.
- qwen3moe: norm_topk_prob is not stored; llama.cpp renormalizes the chosen experts' weights, as
  every released Qwen3-MoE does. Dense layers among the experts (mlp_only_layers) cannot be written.
- glm4moe, deepseek2: the routing must be sigmoid (`expert_gating_func` 2; a deepseek2 file
  without it is DeepSeek-V2's softmax routing, refused); `expert_weights_norm` absent is false.
  deepseek2's rotary dims are interleaved pairs (llama.cpp's rotation for it), and YaRN's mscale
  is taken equal to mscale_all_dim (`_yarn`).
- gpt-oss: swiglu_alpha and swiglu_limit are llama.cpp's constants (LlamaConfig's defaults);
  YaRN's truncate is false; every second layer global (llama.cpp's pattern for it).

Anything else a file carries that the forward does not compute (another rope scaling, attention
logit soft-capping, shared experts, ...) is a ValueError naming the key or tensor.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from specjax.models.checkpoint import PROJECTIONS, check_tensors, params_from_tensors
from specjax.models.config import LlamaConfig, RopeScaling
from specjax.models.gguf_tokenizer import tokenizer_from_gguf
from specjax.models.params import LlamaParams, checkpoint_shapes
from specjax.models.quantized import GGUF_FORMATS, from_gguf
from specjax.models.tensors import LazyTensor

# general.architecture -> (the HF model_type it comes from, the LlamaConfig fields it fixes).
_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(qk_norm=True)),
    "qwen3moe": ("qwen3_moe", dict(qk_norm=True)),
    "gemma3": (
        "gemma3_text",
        dict(norm="gemma", qk_norm=True, sandwich_norms=True, embed_scale=True, hidden_act="gelu_tanh"),
    ),
    "glm4moe": ("glm4_moe", dict(router_scoring="sigmoid", router_score_bias=True)),
    # llama.cpp rotates DeepSeek's rotary dims in adjacent pairs, as its released weights are laid out.
    "deepseek2": (
        "deepseek_v3",
        dict(router_scoring="sigmoid", router_score_bias=True, rope_interleave=True),
    ),
    # swiglu_alpha and swiglu_limit are not stored: llama.cpp's constants are LlamaConfig's defaults.
    "gpt-oss": (
        "gpt_oss",
        dict(norm="rms_float32", hidden_act="clamped_swiglu", attention_sinks=True, moe_bias=True),
    ),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)
# The architectures llama.cpp rotates in adjacent pairs, whose q/k rows its converter reorders.
_PERMUTED_ARCHITECTURES = ("llama",)
# llama.cpp's default for Gemma 3 files without a sliding_window_pattern: every sixth layer global.
_DEFAULT_WINDOW_PATTERN = {"gemma3": 6, "gpt-oss": 2}
# The mixtures of GLM-4.5 and DeepSeek-V3 (models/families.py `_sigmoid_experts`).
_SIGMOID_EXPERTS = ("glm4moe", "deepseek2")

# GGUF tensor name -> our checkpoint name: global tensors, and per layer (after "blk.{i}.").
_GLOBAL_TENSORS = {
    "token_embd.weight": "embed",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "o",
    "post_attention_norm.weight": "attn_out_norm",  # Gemma 3: the norm of the attention's output
    "ffn_norm.weight": "mlp_norm",  # the MLP's input norm (Gemma 3's pre_feedforward_layernorm)
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
    "ffn_gate_inp.weight": "router",
    "ffn_gate_exps.weight": "expert_gate",  # [X, out, in] as stored: all experts of the layer
    "ffn_up_exps.weight": "expert_up",
    "ffn_down_exps.weight": "expert_down",
    "post_ffw_norm.weight": "mlp_out_norm",
    # GLM-4.5 and DeepSeek-V3: the expert choice's correction bias and the shared experts
    "exp_probs_b.bias": "router_score_bias",
    "ffn_gate_shexp.weight": "shared_gate",
    "ffn_up_shexp.weight": "shared_up",
    "ffn_down_shexp.weight": "shared_down",
    # DeepSeek-V3's latent attention (models/mla.py); attn_kv_b may come as attn_k_b and attn_v_b
    "attn_q_a.weight": "q_a",
    "attn_q_a_norm.weight": "q_a_norm",
    "attn_q_b.weight": "q_b",
    "attn_kv_a_mqa.weight": "kv_a",
    "attn_kv_a_norm.weight": "kv_a_norm",
    "attn_kv_b.weight": "kv_b",
    # gpt-oss: sinks, the output's bias, the router's and experts' biases ([X, F] as ours)
    "attn_sinks.weight": "sinks",
    "attn_output.bias": "o_bias",
    "ffn_gate_inp.bias": "router_bias",
    "ffn_gate_exps.bias": "expert_gate_bias",
    "ffn_up_exps.bias": "expert_up_bias",
    "ffn_down_exps.bias": "expert_down_bias",
}
# Where an architecture's name means another of our weights: post_attention_norm is the MLP's input
# norm for GLM-4.5 and gpt-oss (Gemma 3's norm of the attention output).
_ARCH_LAYER_TENSORS = {
    "glm4moe": {"post_attention_norm.weight": "mlp_norm"},
    "gpt-oss": {"post_attention_norm.weight": "mlp_norm"},
}
# GLM-4.5's MTP layers' own tensors (after "blk.{L + j}.nextn.") -> models/mtp.py's names; the
# copies of the embedding and the head it writes beside them ("") are the target's, not read.
_MTP_TENSORS = {
    "eh_proj.weight": "eh_proj",
    "enorm.weight": "enorm",
    "hnorm.weight": "hnorm",
    "shared_head_norm.weight": "head_norm",
    "embed_tokens.weight": "",
    "shared_head_head.weight": "",
}
# The experts' gate and up projections as the converter's --fuse-gate-up-exps writes them: one
# tensor [X, 2F, D] (biases [X, 2F]), gate's rows then up's.
_FUSED_GATE_UP = {
    "ffn_gate_up_exps.weight": ("expert_gate", "expert_up"),
    "ffn_gate_up_exps.bias": ("expert_gate_bias", "expert_up_bias"),
}
# DeepSeek's kv_b_proj as newer converters split it, per head: the key part [H, R, nope]
# (transposed), the value part [H, v, R].
_SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
_ROTARY_ROWS = ("q", "k", "q_bias", "k_bias")
# Keys an architecture reads (not refused by _NEUTRAL_KEYS).
_READ_KEYS = dict.fromkeys(
    _SIGMOID_EXPERTS,
    (
        "expert_shared_count",
        "expert_weights_scale",
        "expert_gating_func",
        "expert_group_count",
        "leading_dense_block_count",
    ),
)

# Keys (after "{arch}.") that some writers set and that change what the model computes in ways the
# forward does not: each must be absent or hold its neutral value.
_NEUTRAL_KEYS: dict[str, Callable[[Any], bool]] = {
    "attention.causal": bool,
    "attn_logit_softcapping": lambda v: not v,
    "attention.clamp_kqv": lambda v: not v,
    "attention.max_alibi_bias": lambda v: not v,
    "attention.temperature_scale": lambda v: not v,  # Llama 4 scaling (Mistral Large 3 as deepseek2)
    "logit_scale": lambda v: v in (0, 1),
    "embedding_scale": lambda v: v in (0, 1),
    "residual_scale": lambda v: v in (0, 1),
    "rope.dimension_sections": lambda v: not any(v),
    "expert_shared_count": lambda v: not v,
    "expert_shared_feed_forward_length": lambda v: not v,
    "expert_weights_scale": lambda v: v in (0, 1),
    "expert_gating_func": lambda v: v in (0, 1),  # llama.cpp: 0 the architecture's own, 1 softmax
    "expert_group_count": lambda v: v in (0, 1),
    "leading_dense_block_count": lambda v: not v,
    "interleave_moe_layer_step": lambda v: v in (0, 1),
    "moe_every_n_layers": lambda v: v in (0, 1),
}


def load_gguf(path: str | Path, dtype: Any = "float32") -> tuple[LlamaConfig, LlamaParams, Any]:
    """(config, params of `dtype`, tokenizer or None) from a `.gguf` file."""
    config, tensors, tokenizer = read_gguf(path)
    return config, params_from_tensors(config, tensors, str(path), dtype), tokenizer


def read_gguf(
    path: str | Path, keep_blocks: bool = False, with_tokenizer: bool = True
) -> tuple[LlamaConfig, dict[str, LazyTensor], Any]:
    """(config, unread tensors by our flat names, dequantized to float32 when read, tokenizer or
    None) from a `.gguf` file. A tensor the model does not use, or one it needs that the file
    lacks, is a ValueError naming it; so is a tokenizer gguf_tokenizer.py does not rebuild
    (`UnsupportedTokenizer`), unless `with_tokenizer` is False (the tokenizer is then not read:
    None).

    `keep_blocks`: the projections and the LM head stored in one of GGUF_FORMATS read as their
    blocks (a QuantizedWeight, `LazyTensor.quantized`); those in another quantized type are
    dequantized to float32 with a warning naming them; float ones (F32, F16, BF16) stay float. A
    tied head stored in one of GGUF_FORMATS gets a copy of its blocks as "lm_head", for the
    head's product, beside the float embedding the lookups read."""
    import gguf  # deferred: only GGUF sources need it

    reader = gguf.GGUFReader(str(path))
    metadata = _Metadata(reader, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = config_from_gguf(metadata, tensors)
    arrays = _convert_tensors(config, tensors, path, metadata.require("general.architecture"), keep_blocks)
    return config, arrays, tokenizer_from_gguf(metadata) if with_tokenizer else None


def read_tokenizer(path: str | Path):
    """The tokenizer of a `.gguf` file alone, or None when it has none (see `read_gguf`)."""
    import gguf

    return tokenizer_from_gguf(_Metadata(gguf.GGUFReader(str(path)), path))


class _Metadata:
    """Typed access to a GGUF's key/value metadata, with errors that name the file."""

    def __init__(self, reader, path):
        self._fields = reader.fields
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ValueError(f"GGUF file {self.path} lacks the metadata key {key!r}")
        return self.get(key)

    def get_int(self, key: str, default: int | None = None, required: bool = False) -> int | None:
        """One integer for the whole model: per-layer arrays (which some architectures use for
        head counts and ffw sizes) are a ValueError naming the key."""
        value = self.require(key) if required else self.get(key, default)
        if isinstance(value, list):
            raise ValueError(
                f"GGUF file {self.path} gives {key} per layer ({value[:4]} ...); only one value "
                "for all layers is supported"
            )
        return None if value is None else int(value)

    def get_float(self, key: str, default: float | None = None) -> float | None:
        """A float32 value as the shortest decimal that rounds to it: the converter stored the
        config's decimal (rms_norm_eps 1e-06) as float32, and this gives back that decimal rather
        than its float32 neighbour (9.99999997e-07), so configs compare equal to HF's."""
        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        if len(field.types) == 1 and field.types[0].name == "FLOAT32":
            value = str(np.float32(value))
        return float(value)


def config_from_gguf(metadata: _Metadata, tensors: dict[str, Any]) -> LlamaConfig:
    arch = metadata.require("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF file {metadata.path} has architecture {arch!r}, which is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style scaling stored as per-frequency factors; its parameters are not recoverable.
        raise ValueError(
            f"GGUF file {metadata.path} carries a rope_freqs tensor (Llama 3.1-style rope scaling), "
            "which is not supported; load the HF checkpoint folder instead"
        )
    _refuse_unsupported_keys(metadata, arch)
    model_type, family_fields = _ARCHITECTURES[arch]
    hidden = metadata.get_int(f"{arch}.embedding_length", required=True)
    num_heads = metadata.get_int(f"{arch}.attention.head_count", required=True)
    num_layers, num_mtp_layers = _block_counts(metadata, arch)
    latent = _latent_attention(metadata, arch) if arch == "deepseek2" else {}
    head_dim = latent.get("head_dim") or metadata.get_int(f"{arch}.attention.key_length", hidden // num_heads)
    rotary_dim = _rotary_dim(metadata, arch, head_dim)
    experts = _experts(metadata, arch)
    if arch == "llama" and experts:
        model_type = "mixtral"
    fields = dict(family_fields, **experts, **_windows(metadata, arch, num_layers), **latent)
    if arch in _SIGMOID_EXPERTS:
        fields.update(_sigmoid_experts(metadata, arch, num_layers), num_mtp_layers=num_mtp_layers)
    if arch == "glm4moe":
        fields["qk_norm"] = "blk.0.attn_q_norm.weight" in tensors  # GLM-4.5's use_qk_norm
    if arch == "gemma3":
        # llama.cpp's scale (after gemma_pytorch's configs): head_dim, except the 62-layer 27B's
        # hidden / heads (168, where its head_dim is 128).
        fields["query_pre_attn_scalar"] = float(hidden // num_heads if num_layers == 62 else head_dim)
    if arch == "gemma3" or f"{arch}.rope.freq_base_swa" in metadata:
        fields["local_rope_theta"] = metadata.get_float(f"{arch}.rope.freq_base_swa", 10000.0)

    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        vocab_size = int(tensors["token_embd.weight"].shape[-1])  # ggml shape: [D, V]
    eos_ids = [
        int(metadata.get(key))
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if key in metadata
    ]
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    common = dict(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=metadata.get_int(f"{arch}.feed_forward_length", required=True),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=metadata.get_int(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=metadata.get_float(f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(metadata, arch),
        rms_norm_eps=metadata.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        max_position_embeddings=metadata.get_int(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        final_logit_softcapping=metadata.get_float(f"{arch}.final_logit_softcapping") or None,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        model_type=model_type,
    )
    config = LlamaConfig(**(common | fields))
    _check_attention_scale(metadata, arch, config)
    return config


def _refuse_unsupported_keys(metadata: _Metadata, arch: str) -> None:
    for suffix, neutral in _NEUTRAL_KEYS.items():
        key = f"{arch}.{suffix}"
        if suffix in _READ_KEYS.get(arch, ()):
            continue
        if key in metadata and not neutral(metadata.get(key)):
            raise ValueError(
                f"GGUF file {metadata.path} has {key} = {metadata.get(key)!r}, which specjax does "
                "not compute; only the family's default attention and MLP are supported"
            )


def _block_counts(metadata: _Metadata, arch: str) -> tuple[int, int]:
    """(decoder layers, MTP layers): GLM-4.5's converter counts its MTP layers in block_count (they
    are the last blocks, `nextn_predict_layers` of them)."""
    blocks = metadata.get_int(f"{arch}.block_count", required=True)
    mtp_layers = metadata.get_int(f"{arch}.nextn_predict_layers", 0)
    if not 0 <= mtp_layers < blocks:
        raise ValueError(
            f"GGUF file {metadata.path} has {arch}.nextn_predict_layers = {mtp_layers} for {blocks} blocks"
        )
    return blocks - mtp_layers, mtp_layers


def _latent_attention(metadata: _Metadata, arch: str) -> dict[str, Any]:
    """DeepSeek's latent attention. llama.cpp's converter writes it as one kv head (key_length
    kv_lora_rank + rotary dims, value_length kv_lora_rank) and the query and value heads' sizes
    apart (key_length_mla, value_length_mla); older converters wrote the heads' sizes as
    key_length and value_length."""
    suffix = "_mla" if f"{arch}.attention.key_length_mla" in metadata else ""
    head_dim = metadata.get_int(f"{arch}.attention.key_length{suffix}", required=True)
    return dict(
        num_kv_heads=1,  # the cache's one entry per token (models/mla.py)
        head_dim=head_dim,
        v_head_dim=metadata.get_int(f"{arch}.attention.value_length{suffix}", head_dim),
        kv_lora_rank=metadata.get_int(f"{arch}.attention.kv_lora_rank", required=True),
        q_lora_rank=metadata.get_int(f"{arch}.attention.q_lora_rank") or None,
    )


def _sigmoid_experts(metadata: _Metadata, arch: str, num_layers: int) -> dict[str, Any]:
    """GLM-4.5's and DeepSeek-V3's mixture (models/families.py `_sigmoid_experts`) from llama.cpp's
    keys. Without expert_gating_func llama.cpp routes a deepseek2 file by softmax (DeepSeek-V2),
    which is refused; expert_weights_norm absent is false, as llama.cpp reads it (the converter
    writes it only where norm_topk_prob is set, or true)."""
    gating = metadata.get_int(f"{arch}.expert_gating_func", 2 if arch == "glm4moe" else 0)
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ValueError(
            f"GGUF file {metadata.path} routes experts with {arch}.expert_gating_func = {gating} "
            "(absent or 1: softmax, DeepSeek-V2's); only sigmoid scores (2) are supported"
        )
    moe_size = metadata.get_int(f"{arch}.expert_feed_forward_length", required=True)
    shared = metadata.get_int(f"{arch}.expert_shared_feed_forward_length") or moe_size * (
        metadata.get_int(f"{arch}.expert_shared_count", 0) or 0
    )
    return dict(
        norm_topk_prob=bool(metadata.get(f"{arch}.expert_weights_norm", False)),
        dense_layers=tuple(range(min(metadata.get_int(f"{arch}.leading_dense_block_count", 0), num_layers))),
        num_expert_groups=metadata.get_int(f"{arch}.expert_group_count", 0) or 1,
        topk_expert_groups=metadata.get_int(f"{arch}.expert_group_used_count", 0) or 1,
        routed_scaling_factor=metadata.get_float(f"{arch}.expert_weights_scale") or 1.0,
        shared_expert_size=shared,
    )


def _rotary_dim(metadata: _Metadata, arch: str, head_dim: int) -> int:
    """The rotated dims of each head, after checking that values, and local layers' heads, have
    the keys' size (the forward has one head size; latent attention's sizes: `_latent_attention`)."""
    rotary_dim = metadata.get_int(f"{arch}.rope.dimension_count", head_dim)
    if arch == "deepseek2":
        return rotary_dim
    for key, same_as in (
        ("attention.value_length", head_dim),
        ("attention.key_length_swa", head_dim),
        ("attention.value_length_swa", head_dim),
        ("rope.dimension_count_swa", rotary_dim),
    ):
        value = metadata.get(f"{arch}.{key}")
        if value is not None and value != same_as:
            raise ValueError(
                f"GGUF file {metadata.path} has {arch}.{key} = {value!r}, not {same_as!r}; heads "
                "of one size on every layer, for keys and values alike, are supported"
            )
    # The NEOX kernel rotates the halves of the first rotary_dim dims, as our partial rotary does;
    # llama.cpp refuses partial rotation for llama, whose rows are stored reordered.
    if rotary_dim != head_dim and arch in _PERMUTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {metadata.path} rotates {rotary_dim} of {head_dim} head dims "
            f"({arch}.rope.dimension_count); a {arch} model rotates them all"
        )
    return rotary_dim


def _experts(metadata: _Metadata, arch: str) -> dict[str, Any]:
    """The mixture's fields, or none for a dense model: every layer has the experts."""
    count = metadata.get_int(f"{arch}.expert_count", 0)
    if not count:
        return {}
    return dict(
        num_experts=count,
        num_experts_per_tok=metadata.get_int(f"{arch}.expert_used_count", required=True),
        # Mixtral's experts are feed_forward_length wide (llama.cpp reads no other key for llama).
        moe_intermediate_size=metadata.get_int(f"{arch}.expert_feed_forward_length"),
        # Not written for llama or qwen3moe, whose llama.cpp graphs always renormalize.
        norm_topk_prob=bool(metadata.get(f"{arch}.expert_weights_norm", True)),
    )


def _windows(metadata: _Metadata, arch: str, num_layers: int) -> dict[str, Any]:
    """sliding_window and layer_types: no window, one on every layer, or local and global layers
    as llama.cpp's sliding_window_pattern reads (a bool per layer, or n: every n-th global)."""
    window = metadata.get_int(f"{arch}.attention.sliding_window", 0)
    if not window:
        return {}
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = metadata.get(key, _DEFAULT_WINDOW_PATTERN.get(arch))
    if pattern is None:
        return dict(sliding_window=window)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(
                f"GGUF file {metadata.path} has {key} of {len(pattern)} entries for {num_layers} layers"
            )
        sliding = [bool(x) for x in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(num_layers)]  # llama.cpp's set_swa_pattern
    types = tuple("sliding_attention" if s else "full_attention" for s in sliding)
    return dict(sliding_window=window, layer_types=types)


def _rope_scaling(metadata: _Metadata, arch: str) -> RopeScaling | None:
    # llama.cpp's defaults: type linear, the factor from rope.scaling.factor or the older
    # rope.scale_linear, 0 or absent meaning 1 (no scaling).
    kind = metadata.get(f"{arch}.rope.scaling.type", "linear")
    factor = metadata.get_float(f"{arch}.rope.scaling.factor") or metadata.get_float(
        f"{arch}.rope.scale_linear"
    )
    if kind == "none" or (kind == "linear" and factor in (None, 0.0, 1.0)):
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    if kind == "yarn":
        return _yarn(metadata, arch, factor)
    raise ValueError(
        f"GGUF file {metadata.path} {arch}.rope.scaling.type {kind!r} is not supported; "
        "supported: none, linear, yarn"
    )


def _yarn(metadata: _Metadata, arch: str, factor: float | None) -> RopeScaling:
    """YaRN from the converter's keys. Not stored, and assumed as the released configs have them:
    truncate (false for gpt-oss, as OpenAI's reference and transformers compute it; true
    elsewhere) and DeepSeek's mscale (equal to mscale_all_dim, which deepseek2 files carry as
    yarn_log_multiplier = 0.1 * mscale_all_dim: the rotation is then unscaled, as llama.cpp
    computes it)."""
    prefix = f"{arch}.rope.scaling"
    original = metadata.get_int(f"{prefix}.original_context_length")
    if not factor or original is None:
        raise ValueError(
            f"GGUF file {metadata.path}: yarn rope scaling needs {prefix}.factor and "
            f"{prefix}.original_context_length"
        )
    ext_factor = metadata.get_float(f"{prefix}.yarn_ext_factor")
    log_mul = metadata.get_float(f"{prefix}.yarn_log_multiplier") or 0.0
    if ext_factor not in (None, -1.0, 1.0) or (log_mul and arch != "deepseek2"):
        raise ValueError(
            f"GGUF file {metadata.path} has yarn_ext_factor {ext_factor} / yarn_log_multiplier "
            f"{log_mul} under {prefix}; transformers' yarn (ext_factor 1, a log multiplier for "
            "deepseek2 only) is supported"
        )
    mscale_all_dim = round(log_mul / 0.1, 6)  # the config's decimal back (log_mul: get_float's)
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=metadata.get_float(f"{prefix}.yarn_beta_fast") or 32.0,
        beta_slow=metadata.get_float(f"{prefix}.yarn_beta_slow") or 1.0,
        truncate=arch != "gpt-oss",
        mscale=mscale_all_dim,
        mscale_all_dim=mscale_all_dim,
        attention_factor=metadata.get_float(f"{prefix}.yarn_attn_factor"),
    )


def _check_attention_scale(metadata: _Metadata, arch: str, config: LlamaConfig) -> None:
    """A stored score scale must be the one the config implies (no architecture here reads one)."""
    key = f"{arch}.attention.scale"
    scale = metadata.get_float(key)
    if scale is not None and not math.isclose(scale, config.attention_scale, rel_tol=1e-6):
        raise ValueError(
            f"GGUF file {metadata.path} has {key} = {scale}, but a {arch} model scales attention "
            f"scores by {config.attention_scale:.6g}; other scales are not supported"
        )


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row reorder of a q/k projection (HF `[out, in]` layout) or bias.

    Within each head of E rows, llama.cpp stores row i of the first half and row i of the second
    half next to each other: [a0, b0, a1, b1, ...]. This returns [a0, a1, ..., b0, b1, ...].
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    interleaved = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return interleaved.swapaxes(1, 2).reshape(weight.shape)


def _convert_tensors(
    config: LlamaConfig, tensors: dict[str, Any], path, arch: str, keep_blocks: bool = False
) -> dict[str, LazyTensor]:
    """Every tensor under our flat name, in our layout, dequantized to float32 when read (with
    `keep_blocks`, see `read_gguf`). Unknown tensors, and tensors the config needs that the file
    lacks, are errors naming them. GLM-4.5's MTP layers (the blocks after the decoder's) are named
    as hf_loader names them (`mtp.{j}.*`, read by models/mtp.py)."""
    permuted = arch in _PERMUTED_ARCHITECTURES
    layer_tensors = _LAYER_TENSORS | _layer_overrides(config, arch)
    arrays: dict[str, LazyTensor] = {}
    unknown = []
    for name, tensor in tensors.items():
        match = _LAYER_NAME.fullmatch(name)
        mtp_layer = int(match.group(1)) - config.num_layers if match and config.num_mtp_layers else -1
        if mtp_layer >= 0:  # never kept as blocks: models/mtp.py reads them as floats
            ours = _mtp_name(match.group(2), mtp_layer, layer_tensors)
            if ours is None:
                unknown.append(name)
            elif ours:
                arrays[ours] = _in_our_layout(_dequantized(tensor, name), ours, config, permuted)
            continue
        if name in _GLOBAL_TENSORS:
            ours = _GLOBAL_TENSORS[name]
        elif match and match.group(2) in layer_tensors:
            ours = f"layers.{match.group(1)}.{layer_tensors[match.group(2)]}"
        elif match and match.group(2) in _FUSED_GATE_UP:  # dequantized, even with keep_blocks
            for half, short in enumerate(_FUSED_GATE_UP[match.group(2)]):
                ours = f"layers.{match.group(1)}.{short}"
                arrays[ours] = _in_our_layout(
                    _half_rows(_dequantized(tensor, name), half), ours, config, permuted
                )
            continue
        elif match and match.group(2) in _SPLIT_KV_B:
            if match.group(2) == _SPLIT_KV_B[0]:
                arrays[f"layers.{match.group(1)}.kv_b"] = _joined_kv_b(tensors, match.group(1), path)
            continue
        else:
            unknown.append(name)
            continue
        if keep_blocks and _keeps_blocks(tensor, name, ours, path):
            arrays[ours] = _blocks(tensor, name, ours, config, permuted)
        else:
            arrays[ours] = _in_our_layout(_dequantized(tensor, name), ours, config, permuted)
        if keep_blocks and ours == "embed" and config.tie_word_embeddings and _is_block_type(tensor):
            arrays["lm_head"] = _blocks(tensor, name, "lm_head", config, permuted)
    if unknown:
        more = " ..." if len(unknown) > 8 else ""
        raise ValueError(
            f"GGUF file {path} has tensors a {config.model_type} model does not use: "
            f"{sorted(unknown)[:8]}{more}"
        )
    decoder = {name: tensor for name, tensor in arrays.items() if not name.startswith("mtp.")}
    missing = [_gguf_name(name, config, arch) for name in checkpoint_shapes(config) if name not in decoder]
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ValueError(
            f"GGUF file {path} lacks tensors a {config.model_type} model needs: {missing[:8]}{more}"
        )
    # Shapes too, here rather than only when params are built: the loader caches what this
    # returns, and the cache's tensors no longer carry their GGUF names for the message.
    check_tensors(config, decoder, str(path))
    return arrays


def _mtp_name(short: str, layer: int, layer_tensors: dict[str, str]) -> str | None:
    """Our name (hf_loader's, `mtp.{layer}.*`) of MTP layer `layer`'s tensor `short` (its name after
    "blk.{i}."): its own under "nextn.", else its decoder block's; "" for those not read, None for
    a name it cannot have."""
    if short.startswith("nextn."):
        own = _MTP_TENSORS.get(short.removeprefix("nextn."))
        return own and f"mtp.{layer}.{own}"
    return f"mtp.{layer}.{layer_tensors[short]}" if short in layer_tensors else None


def _layer_overrides(config: LlamaConfig, arch: str) -> dict[str, str]:
    """The architecture's own meanings of layer tensor names (`_ARCH_LAYER_TENSORS`); without
    q_lora_rank, DeepSeek's query projection is attn_q."""
    if arch == "deepseek2" and not config.q_lora_rank:
        return {"attn_q.weight": "q_b"}
    return _ARCH_LAYER_TENSORS.get(arch, {})


def _gguf_name(ours: str, config: LlamaConfig, arch: str) -> str:
    """The GGUF name of one of our flat names ("layers.3.q" -> "blk.3.attn_q.weight")."""
    names = {ours: theirs for theirs, ours in _LAYER_TENSORS.items()}
    names |= {ours: theirs for theirs, ours in _layer_overrides(config, arch).items()}
    if ours.startswith("layers."):
        _, layer, short = ours.split(".", 2)
        return f"blk.{layer}.{names[short]}"
    return {ours: theirs for theirs, ours in _GLOBAL_TENSORS.items()}[ours]


def _half_rows(value: LazyTensor, half: int) -> LazyTensor:
    """The first (0) or second (1) half of a stacked tensor's rows (axis 1: [X, 2F, ...])."""
    X, rows, *rest = value.shape
    return value.mapped(lambda w: np.ascontiguousarray(np.split(w, 2, axis=1)[half]), (X, rows // 2, *rest))


def _joined_kv_b(tensors: dict[str, Any], layer: str, path) -> LazyTensor:
    """DeepSeek's kv_b_proj in HF's rows from the converter's halves, transposed to ours
    [R, H * (nope + v)]: per head, the key part k_b [H, R, nope] (stored transposed) then the
    value part v_b [H, v, R]."""
    k_name, v_name = (f"blk.{layer}.{part}" for part in _SPLIT_KV_B)
    if k_name not in tensors or v_name not in tensors:
        raise ValueError(f"GGUF file {path} has one of {k_name} and {v_name} without the other")
    k_b, v_b = _dequantized(tensors[k_name], k_name), _dequantized(tensors[v_name], v_name)
    (H, R, nope), v = k_b.shape, v_b.shape[1]

    def read():
        rows = np.concatenate([k_b.read().swapaxes(1, 2), v_b.read()], axis=1)  # [H, nope + v, R]
        return np.ascontiguousarray(rows.reshape(H * (nope + v), R).T)

    return LazyTensor((R, H * (nope + v)), np.dtype(np.float32), read, f"{k_name} + {v_name}")


def _in_our_layout(value: LazyTensor, ours: str, config: LlamaConfig, permuted: bool) -> LazyTensor:
    """A tensor as stored (HF's layout: [out, in], experts [X, out, in]) -> ours ([in, out])."""
    short = ours.rsplit(".", 1)[-1]
    if permuted and short in _ROTARY_ROWS:
        heads = config.num_heads if short.startswith("q") else config.num_kv_heads
        value = value.mapped(lambda w: unpermute_rotary_rows(w, heads))
    if config.norm == "gemma" and short.endswith("norm"):
        value = value.mapped(lambda w: w - np.float32(1))  # stored as 1 + w (see the module docstring)
    if short == "embed" or (short.startswith("expert_") and short.endswith("_bias")):
        return value  # [V, D] in both; gpt-oss's expert biases [X, F] too
    if len(value.shape) == 3:
        X, n_out, n_in = value.shape
        return value.mapped(lambda w: np.ascontiguousarray(w.swapaxes(1, 2)), (X, n_in, n_out))
    return value.transposed()  # matrices [out, in] -> [in, out] (output.weight: [V, D] -> [D, V])


# Our names (after the layer prefix) of the weights kept as blocks: the projections and the head.
_BLOCK_WEIGHTS = (*PROJECTIONS, "lm_head")
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _is_block_type(tensor) -> bool:
    return tensor.tensor_type.name in GGUF_FORMATS


def _keeps_blocks(tensor, name: str, ours: str, path) -> bool:
    """Whether a tensor is read as its blocks (`read_gguf`'s keep_blocks); warns for a quantized
    projection in a type that is dequantized instead."""
    if ours.rsplit(".", 1)[-1] not in _BLOCK_WEIGHTS:
        return False
    kind = tensor.tensor_type.name
    if kind in GGUF_FORMATS:
        return True
    if kind not in _FLOAT_TYPES:
        warnings.warn(
            f"GGUF file {path}: tensor {name} is {kind}, which specjax does not keep as blocks "
            f"(kept: {', '.join(GGUF_FORMATS)}); it is dequantized to float",
            stacklevel=4,
        )
    return False


def _blocks(tensor, name: str, ours: str, config: LlamaConfig, permuted: bool) -> LazyTensor:
    """A quantized GGUF tensor read as a QuantizedWeight in our layout ([..., in, out]; the
    token embedding [V, D] as a head [D, V]), q and k's columns put back in HF's rotary order."""
    stored = tuple(int(n) for n in reversed(tensor.shape))  # HF's layout: [..., out, in]
    short = ours.rsplit(".", 1)[-1]
    order = None
    if permuted and short in ("q", "k"):
        heads = config.num_heads if short == "q" else config.num_kv_heads
        order = unpermute_rotary_rows(np.arange(stored[-2]), heads)  # the rows' new order

    def read():
        weight = from_gguf(tensor.data, tensor.tensor_type.name, stored)
        if order is None:
            return weight
        return weight.replace(
            values=weight.values[..., order],
            scales=weight.scales[..., order],
            offsets=None if weight.offsets is None else weight.offsets[..., order],
        )

    shape = (*stored[:-2], stored[-1], stored[-2])
    return LazyTensor(shape, np.dtype(np.float32), read, name, quantized=tensor.tensor_type.name)


def _dequantized(tensor, name: str) -> LazyTensor:
    """A GGUF tensor in HF's layout (ggml lists dimensions innermost first: reversed), dequantized
    to float32 when read."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))

    def read():
        values = dequantize(tensor.data, tensor.tensor_type)
        return np.array(values, np.float32).reshape(shape)  # a copy: F32 data is a view of the mmap

    return LazyTensor(shape, np.dtype(np.float32), read, name)
