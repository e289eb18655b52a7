"""Read a llama.cpp `.gguf` file: config, float32 weights and tokenizer, without torch.

Three things differ from an HF checkpoint:

- Weights may be quantized (Q4_1, Q8_0, ...); `gguf.quants.dequantize` turns each into float32.
- llama.cpp's converter reorders the rows of the q and k projections within each head, for its
  rotary kernel that rotates adjacent pairs (x[2i], x[2i+1]). Our forward, like HF, rotates the
  halves (x[i], x[i + E/2]), so the reorder is undone here (`unpermute_rotary_rows`).
- There is no `tokenizer.json`: the vocabulary, merges and special ids are metadata
  (`tokenizer.ggml.*`), from which `tokenizer_from_gguf` builds a byte-level BPE tokenizer with the
  `tokenizers` library. (transformers can read GGUF too, but its code imports torch.)
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from specjax.models.checkpoint import collect_layers, params_from_arrays
from specjax.models.config import LlamaConfig, RopeScaling
from specjax.models.llama import LlamaParams

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TOKENIZERS = ("gpt2",)  # tokenizer.ggml.model: byte-level BPE
# tokenizer.ggml.pre: how text is split before BPE. (llama.cpp's "default", used when the key is
# missing, is not GPT-2's split, so it is not claimed here.)
SUPPORTED_PRE_TOKENIZERS = ("gpt2", "smollm")

# GGUF per-layer tensor name -> (our checkpoint name, rows carry llama.cpp's rotary reorder).
_LAYER_TENSORS = {
    "attn_norm.weight": ("attn_norm", False),
    "attn_q.weight": ("q", True),
    "attn_k.weight": ("k", True),
    "attn_v.weight": ("v", False),
    "attn_output.weight": ("o", False),
    "ffn_norm.weight": ("mlp_norm", False),
    "ffn_gate.weight": ("gate", False),
    "ffn_up.weight": ("up", False),
    "ffn_down.weight": ("down", False),
    "attn_q.bias": ("q_bias", True),
    "attn_k.bias": ("k_bias", True),
    "attn_v.bias": ("v_bias", False),
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "embed",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4


def load_gguf(path: str | Path) -> tuple[LlamaConfig, LlamaParams, Any]:
    """(config, float32 params, tokenizer or None) from a `.gguf` file."""
    config, arrays, tokenizer = read_gguf(path)
    return config, params_from_arrays(config, arrays, source=str(path)), tokenizer


def read_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray], Any]:
    """(config, flat float32 numpy arrays in our layout, tokenizer or None) from a `.gguf` file."""
    import gguf  # deferred: only GGUF sources need it

    reader = gguf.GGUFReader(str(path))
    metadata = _Metadata(reader, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = config_from_gguf(metadata, tensors)
    arrays = _convert_tensors(config, tensors, path)
    return config, arrays, tokenizer_from_gguf(metadata)


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


def config_from_gguf(metadata: _Metadata, tensors: dict[str, Any]) -> LlamaConfig:
    arch = metadata.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
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
    hidden = int(metadata.require(f"{arch}.embedding_length"))
    num_heads = int(metadata.require(f"{arch}.attention.head_count"))
    num_kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // num_heads))
    rotary_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(
            f"GGUF file {metadata.path} rotates {rotary_dim} of {head_dim} head dims; "
            "only full rotary embeddings are supported"
        )
    ffw = metadata.require(f"{arch}.feed_forward_length")
    if isinstance(ffw, list):
        raise ValueError(f"GGUF file {metadata.path} has per-layer feed_forward_length; not supported")

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
    return LlamaConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(ffw),
        num_layers=int(metadata.require(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(metadata, arch),
        rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(metadata.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        model_type="llama",
    )


def _rope_scaling(metadata: _Metadata, arch: str) -> RopeScaling | None:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    raise ValueError(
        f"GGUF file {metadata.path} rope.scaling.type {kind!r} is not supported; supported: none, linear"
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


def _convert_tensors(config: LlamaConfig, tensors: dict[str, Any], path) -> dict[str, np.ndarray]:
    """Dequantize every tensor into our flat names and layout; unknown tensors are an error."""
    from gguf.quants import dequantize

    def as_float32(tensor) -> np.ndarray:
        values = dequantize(tensor.data, tensor.tensor_type)
        return np.array(values, np.float32).reshape(  # a copy: F32 data is a view of the mmap
            tuple(int(n) for n in reversed(tensor.shape))
        )

    heads = {
        "q": config.num_heads,
        "k": config.num_kv_heads,
        "q_bias": config.num_heads,
        "k_bias": config.num_kv_heads,
    }
    arrays: dict[str, np.ndarray] = {}
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    unknown = []
    for name, tensor in tensors.items():
        match = _LAYER_NAME.fullmatch(name)
        if name in _GLOBAL_TENSORS:
            ours = _GLOBAL_TENSORS[name]
            value = as_float32(tensor)
            arrays[ours] = value.T if ours == "lm_head" else value  # output.weight is HF's [V, D]
        elif match and match.group(2) in _LAYER_TENSORS:
            ours, permuted = _LAYER_TENSORS[match.group(2)]
            value = as_float32(tensor)  # HF layout: [out, in] or [out]
            if permuted:
                value = unpermute_rotary_rows(value, heads[ours])
            per_layer.setdefault(ours, {})[int(match.group(1))] = value.T  # -> [in, out]; no-op on 1-D
        else:
            unknown.append(name)
    arrays.update(collect_layers(per_layer, unknown, config.num_layers, f"GGUF file {path}"))
    return arrays


# ---------------------------------------------------------------------------------------------
# Tokenizer


def tokenizer_from_gguf(metadata: _Metadata):
    """A `transformers.PreTrainedTokenizerFast` from the file's `tokenizer.ggml.*` metadata.

    Returns None (with a warning) when the file has no tokenizer or one this builder does not
    reproduce exactly; the model then works on token ids only.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        return None
    pre = metadata.get("tokenizer.ggml.pre")
    if kind not in SUPPORTED_TOKENIZERS or pre not in SUPPORTED_PRE_TOKENIZERS:
        warnings.warn(
            f"GGUF file {metadata.path}: tokenizer (tokenizer.ggml.model {kind!r}, tokenizer.ggml.pre "
            f"{pre!r}) is not supported (supported: models {SUPPORTED_TOKENIZERS}, pre-tokenizers "
            f"{SUPPORTED_PRE_TOKENIZERS}); the model is loaded without a tokenizer",
            stacklevel=3,
        )
        return None

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = metadata.require("tokenizer.ggml.tokens")
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.require("tokenizer.ggml.merges")]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM's own tokenizer.json (and llama.cpp's "smollm" split) isolate every digit first.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) stay whole and count as special; user-defined ones stay
    # whole too (llama.cpp never splits them) but are plain text.
    kinds = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED]
    )

    def token(key):
        index = metadata.get(key)
        return None if index is None or index >= len(tokens) else tokens[index]

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:

        def template(segment, type_id):
            return (
                ([f"{bos}:{type_id}"] if add_bos else [])
                + [f"${segment}:{type_id}"]
                + ([f"{eos}:{type_id}"] if add_eos else [])
            )

        specials = [(t, tokens.index(t)) for t, used in ((bos, add_bos), (eos, add_eos)) if used]
        backend.post_processor = processors.TemplateProcessing(
            single=template("A", 0), pair=template("A", 0) + template("B", 1), special_tokens=specials
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
