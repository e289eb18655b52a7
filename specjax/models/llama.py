"""The decoder transformer of every supported family, as pure functions over a params pytree.

One forward serves Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, Mixtral, Qwen3-MoE, GLM-4.5,
DeepSeek-V3 and gpt-oss: the config (models/config.py) picks each piece, one small function per
concern: `rms_norm` (Llama's, Gemma's or gpt-oss's form), q/k norms, `apply_rope` (per-layer
bases, partial rotary, YaRN), `attention` (full or a sliding window, through `_layer_masks`;
attention sinks) or DeepSeek's latent attention (models/mla.py), `_gated_mlp` (SwiGLU, GeGLU,
gpt-oss's clamped SwiGLU) or `moe_mlp` (`route`: softmax or sigmoid scores; shared experts,
gpt-oss's biases). Weights and activations are in the params' dtype; norm statistics, softmax
and logits are float32.

Einsum letters, used throughout:
    B batch, T new tokens, S cache slots, D hidden, H query heads, K kv heads,
    G query heads per kv head (H = K * G), E head dim, F ffw hidden, V vocab, L layers.

Layers are a tuple, one `LayerParams` (and one cache buffer) per layer. On the CPU they run by a
Python loop, unrolled, not stacked on a leading axis and scanned. The reason is speed: XLA:CPU
copies a slice of a stacked weight (dynamic or static) before it multiplies, which made a
decoding step 1.8x slower for SmolLM2-135M (95 ms against 52 ms per token, measured here). The
price is compile time and program size that grow with depth. The same holds on a GPU (XLA:GPU
copies each layer's slice out of the stack too: an 8B model's bfloat16 step 11.9 ms scanned, 4.8
ms unrolled on an H200), so layers are unrolled on every platform by default. Asked for (the
backend's `scans_layers`, `scan_layers=True`), the program stacks each run of layers of one
shape once, before its loop (`stack_layers`, a `LayerStack`), and each pass runs a stack as
one `fori_loop` over it, the cache's buffer for that run stacked alike: the program holds one
copy of each kind of layer whatever the depth. Projection weights are stored `[in, out]` and
applied as `x @ W`. Checkpoints and the disk cache keep the stacked layout (see checkpoint.py),
which splits it per layer as it loads.

The query, key and value projections are one weight, `qkv`, so that a decoding step makes one
product for them, not three: XLA:CPU runs a [576, 576] product on one core at about 18 GB/s
and the two [576, 192] ones cost nearly as much again, while a [576, 960] product takes both
cores in about the time of the [576, 576] one (three products made a SmolLM2 step 1.5 to 2 ms
slower, 6-9% of it; docs/notes/benchmarks-history.md). Its columns go kv head by kv head: the G query heads
that share kv head j, then key j, then value j (`fuse_qkv`). A tensor-parallel split of the
columns into equal parts then hands each device whole groups, its query heads with their keys
and values. Checkpoints keep the three projections apart, as HF and GGUF files do
(`checkpoint_layer_shapes`); `layer_from_checkpoint` and `layer_to_checkpoint` convert.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import PANEL, PanelWeight, backend, pack
from specjax.kernels.quantized import (
    QuantizedPanelWeight,
    QuantizedWeight,
    is_fp8,
    pack_quantized,
)
from specjax.models import mla
from specjax.models.cache import FreshEntries, KVCache, layers_in
from specjax.models.config import LlamaConfig
from specjax.models.quantized import as_array


@flax.struct.dataclass
class LayerParams:
    """Weights of one decoder layer; a field the layer's family does not have is None."""

    attn_norm: jax.Array  # [D]
    qkv: jax.Array  # [D, K*(G+2)*E]: per kv head, its G query heads, its key, its value (fuse_qkv)
    o: jax.Array  # [H*E, D]
    mlp_norm: jax.Array  # [D]
    gate: jax.Array | None = None  # [D, F]; None in a mixture-of-experts layer
    up: jax.Array | None = None  # [D, F]
    down: jax.Array | None = None  # [F, D]
    qkv_bias: jax.Array | None = None  # [K*(G+2)*E], ordered as qkv's columns; only with config.qkv_bias
    q_norm: jax.Array | None = None  # [E]: config.qk_norm
    k_norm: jax.Array | None = None  # [E]
    attn_out_norm: jax.Array | None = None  # [D]: config.sandwich_norms, on the attention's output
    mlp_out_norm: jax.Array | None = None  # [D]: on the MLP's output
    router: jax.Array | None = None  # [D, X]: X experts; only in a mixture-of-experts layer
    expert_gate: jax.Array | None = None  # [X, D, F]
    expert_up: jax.Array | None = None  # [X, D, F]
    expert_down: jax.Array | None = None  # [X, F, D]
    router_bias: jax.Array | None = None  # [X]: config.moe_bias, on the router's logits
    router_score_bias: jax.Array | None = None  # [X]: config.router_score_bias (choice only)
    expert_gate_bias: jax.Array | None = None  # [X, F]: config.moe_bias
    expert_up_bias: jax.Array | None = None  # [X, F]
    expert_down_bias: jax.Array | None = None  # [X, D]
    shared_gate: jax.Array | None = None  # [D, Fs]: config.shared_expert_size, in an MoE layer
    shared_up: jax.Array | None = None  # [D, Fs]
    shared_down: jax.Array | None = None  # [Fs, D]
    sinks: jax.Array | None = None  # [H]: config.attention_sinks, each head's logit with no value
    o_bias: jax.Array | None = None  # [D]: config.o_bias
    # Latent attention (config.kv_lora_rank; qkv is None then): see models/mla.py. C = r + R.
    q_a: jax.Array | None = None  # [D, Rq]: config.q_lora_rank
    q_a_norm: jax.Array | None = None  # [Rq]
    q_b: jax.Array | None = None  # [Rq or D, H*E]: the queries, from q_a's latent or from x
    kv_a: jax.Array | None = None  # [D, C]: the latent and the shared rotary key
    kv_a_norm: jax.Array | None = None  # [r]
    kv_b: jax.Array | None = None  # [r, H*(N+A)]: per head, its nope key and value from the latent


@flax.struct.dataclass
class LayerStack:
    """Consecutive decoder layers whose weights have the same shapes (dense or experts; windows
    and rotary bases may differ), stacked on a leading axis: each field of `layers` is [n, ...].
    The decoder runs a stack as one loop over its layers (`decoder_layers`), so a program holds
    one copy of each kind of layer however deep the model. Made inside the program
    (`stack_layers`) where the backend scans layers (on accelerators), never stored: loading,
    checkpoints and training keep one LayerParams per layer."""

    layers: LayerParams

    @property
    def count(self) -> int:
        return jax.tree.leaves(self.layers)[0].shape[0]


@flax.struct.dataclass
class LlamaParams:
    embed: jax.Array  # [V, D]
    # One per layer; inside a program that scans layers, runs of them as LayerStacks.
    layers: tuple[LayerParams | LayerStack, ...]
    final_norm: jax.Array  # [D]
    # [D, V]; None when tied to `embed`, or with a tied head quantized, its quantized copy (the
    # embedding stays float for token lookups; models/quantized.py)
    lm_head: jax.Array | QuantizedWeight | None = None
    # The head ([D, V]: lm_head, or embed transposed) as panels for the CPU kernel (quantized ones
    # for a quantized head); set only by with_panel_weights, for decoding on the CPU.
    head_panels: PanelWeight | QuantizedPanelWeight | None = None

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype the model runs in: its embedding's."""
        return self.embed.dtype


def layer_shapes(config: LlamaConfig, layer: int = 0) -> LayerParams:
    """Layer `layer`'s params with a shape tuple at every leaf: `checkpoint_layer_shapes` with q,
    k and v (and their biases) fused."""
    shapes = checkpoint_layer_shapes(config, layer)
    if config.kv_lora_rank:  # latent attention: nothing fused
        return LayerParams(qkv=None, **shapes)
    qkv = shapes.pop("q")[-1] + shapes.pop("k")[-1] + shapes.pop("v")[-1]
    bias = None
    if config.qkv_bias:
        bias = (qkv,)
        del shapes["q_bias"], shapes["k_bias"], shapes["v_bias"]
    return LayerParams(qkv=(config.hidden_size, qkv), qkv_bias=bias, **shapes)


def checkpoint_layer_shapes(config: LlamaConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s weights by name -> shape in the checkpoint layout (checkpoint.py): the
    query, key and value projections apart, as HF and GGUF files keep them, in HF's order. Only
    the weights the config gives the layer are listed."""
    D, F, E = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    if config.kv_lora_rank:
        shapes = mla.checkpoint_attention_shapes(config)
    else:
        shapes = {"attn_norm": (D,), "q": (D, q), "k": (D, kv), "v": (D, kv)}
        if config.qkv_bias:
            shapes.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
        if config.qk_norm:
            shapes.update(q_norm=(E,), k_norm=(E,))
        if config.attention_sinks:
            shapes["sinks"] = (config.num_heads,)
        shapes["o"] = (q, D)
        if config.o_bias:
            shapes["o_bias"] = (D,)
    if config.sandwich_norms:
        shapes["attn_out_norm"] = (D,)
    shapes["mlp_norm"] = (D,)
    if config.is_moe_layer(layer):
        X, Fm = config.num_experts, config.moe_intermediate_size
        shapes.update(router=(D, X), expert_gate=(X, D, Fm), expert_up=(X, D, Fm), expert_down=(X, Fm, D))
        if config.moe_bias:
            shapes.update(router_bias=(X,), expert_gate_bias=(X, Fm), expert_up_bias=(X, Fm))
            shapes["expert_down_bias"] = (X, D)
        if config.router_score_bias:
            shapes["router_score_bias"] = (X,)
        if Fs := config.shared_expert_size:
            shapes.update(shared_gate=(D, Fs), shared_up=(D, Fs), shared_down=(Fs, D))
    else:
        shapes.update(gate=(D, F), up=(D, F), down=(F, D))
    if config.sandwich_norms:
        shapes["mlp_out_norm"] = (D,)
    return shapes


def fuse_qkv(q, k, v, num_kv_heads: int):
    """The fused projection from separate ones: q [..., H*E], k and v [..., K*E] (weights
    [D, .] or biases, numpy or jax) -> [..., K*(G+2)*E], kv head by kv head (see the module
    docstring): the columns of query heads j*G .. j*G+G-1, then of key j, then of value j."""
    if any(isinstance(w, QuantizedWeight) for w in (q, k, v)):
        return _fuse_quantized_qkv(q, k, v, num_kv_heads)
    xp = np if isinstance(q, np.ndarray) else jnp
    K, lead = num_kv_heads, q.shape[:-1]
    groups = [x.reshape(*lead, K, -1) for x in (q, k, v)]  # [..., K, G*E], [..., K, E], [..., K, E]
    return xp.concatenate(groups, axis=-1).reshape(*lead, -1)


def _fuse_quantized_qkv(q, k, v, num_kv_heads: int):
    """fuse_qkv of quantized weights: every field's columns fused alike (the columns are each
    field's last axis). Where the three differ in format (a GGUF Q4_K_M file keeps some layers'
    v in Q6_K, its q and k in Q4_K), one weight cannot hold them: the fused weight is float32."""
    parts = (q, k, v)
    formats = {
        (w.bits, w.group, w.offsets is None, w.values.dtype) if isinstance(w, QuantizedWeight) else None
        for w in parts
    }
    if len(formats) > 1 or None in formats:
        return fuse_qkv(*(np.asarray(as_array(w, jnp.float32)) for w in parts), num_kv_heads)
    fields = {
        name: fuse_qkv(*(getattr(w, name) for w in parts), num_kv_heads) for name in ("values", "scales")
    }
    offsets = None if q.offsets is None else fuse_qkv(q.offsets, k.offsets, v.offsets, num_kv_heads)
    return QuantizedWeight(**fields, offsets=offsets, bits=q.bits, group=q.group)


def read_fused_qkv(read_q, read_k, read_v, index: tuple[slice, ...], config: LlamaConfig) -> np.ndarray:
    """The fused qkv (or its bias) at `index` (normalized slices, the last one over the fused
    columns) from readers of q, k and v at an index of theirs (`LazyTensor.read_index`): a block of
    whole kv-head groups (what a device of the "model" axis holds) reads just those groups' q, k
    and v columns; any other block reads the three whole and fuses them first."""
    *lead, columns = index
    K, G, E = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
    group = (G + 2) * E  # the fused columns of one kv head: its G query heads, its key, its value
    if columns.start % group == 0 and columns.stop % group == 0:
        j0, j1 = columns.start // group, columns.stop // group
        q = read_q((*lead, slice(j0 * G * E, j1 * G * E)))
        k = read_k((*lead, slice(j0 * E, j1 * E)))
        v = read_v((*lead, slice(j0 * E, j1 * E)))
        return fuse_qkv(q, k, v, j1 - j0)
    whole = (*lead, slice(None))
    return fuse_qkv(read_q(whole), read_k(whole), read_v(whole), K)[..., columns]


def split_qkv(qkv, num_heads: int, num_kv_heads: int):
    """(q [..., H*E], k [..., K*E], v [..., K*E]) from a fused [..., K*(G+2)*E]; undoes fuse_qkv."""
    K, G, lead = num_kv_heads, num_heads // num_kv_heads, qkv.shape[:-1]
    groups = qkv.reshape(*lead, K, G + 2, -1)  # [..., K, G+2, E]
    q, k, v = groups[..., :G, :], groups[..., G, :], groups[..., G + 1, :]
    return q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)


def layer_from_checkpoint(fields: dict[str, Any], config: LlamaConfig) -> LayerParams:
    """A layer's LayerParams from its weights by checkpoint name (q, k, v fused into qkv)."""
    fields = dict(fields)
    if config.kv_lora_rank:  # latent attention: nothing fused
        return LayerParams(qkv=None, **fields)
    K = config.num_kv_heads
    qkv = fuse_qkv(fields.pop("q"), fields.pop("k"), fields.pop("v"), K)
    qkv_bias = None
    if "q_bias" in fields:
        qkv_bias = fuse_qkv(fields.pop("q_bias"), fields.pop("k_bias"), fields.pop("v_bias"), K)
    return LayerParams(qkv=qkv, qkv_bias=qkv_bias, **fields)


def layer_to_checkpoint(layer: LayerParams, config: LlamaConfig, index: int = 0) -> dict[str, Any]:
    """Layer `index`'s weights by checkpoint name, in `checkpoint_layer_shapes` order: qkv split
    into q, k and v (and qkv_bias likewise; absent weights left out)."""
    H, K = config.num_heads, config.num_kv_heads
    fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(LayerParams)}
    qkv = fields.pop("qkv")
    if qkv is not None:
        fields.update(zip(("q", "k", "v"), split_qkv(qkv, H, K), strict=True))
    bias = fields.pop("qkv_bias")
    if bias is not None:
        fields.update(zip(("q_bias", "k_bias", "v_bias"), split_qkv(bias, H, K), strict=True))
    return {name: fields[name] for name in checkpoint_layer_shapes(config, index)}


def layers_bytes(config: LlamaConfig, itemsize: int) -> int:
    """Bytes the decoder layers' weights take (the size of their stacked copy, `stack_layers`)."""
    total = 0
    for i in range(config.num_layers):
        shapes = dataclasses.astuple(layer_shapes(config, i))
        total += sum(math.prod(shape) for shape in shapes if shape is not None)
    return total * itemsize


def param_shapes(config: LlamaConfig) -> LlamaParams:
    """The params tree with a shape tuple at every leaf."""
    return LlamaParams(
        embed=(config.vocab_size, config.hidden_size),
        layers=tuple(layer_shapes(config, i) for i in range(config.num_layers)),
        final_norm=(config.hidden_size,),
        lm_head=None if config.tie_word_embeddings else (config.hidden_size, config.vocab_size),
    )


def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> LlamaParams:
    """Random params for tests: unit-variance activations, norms and biases away from trivial
    values, so that a wrong use of any weight shows in the logits. Drawn in float32 in the
    checkpoint layout (q, k, v apart), fused as a loaded checkpoint is, then cast to `dtype`."""
    shapes = {"embed": (config.vocab_size, config.hidden_size)}
    for i in range(config.num_layers):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in checkpoint_layer_shapes(config, i).items()}
    shapes["final_norm"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    values = {}
    for leaf_key, (name, shape) in zip(jax.random.split(key, len(shapes)), shapes.items(), strict=True):
        noise = jax.random.normal(leaf_key, shape, jnp.float32)
        if "norm" in name:
            values[name] = 1.0 + 0.1 * noise
        elif "bias" in name:
            values[name] = 0.1 * noise
        elif "embed" in name:
            values[name] = noise
        elif name.endswith("sinks"):  # logits beside the scores, of their size
            values[name] = noise
        else:  # projections [.., in, out]
            values[name] = noise / math.sqrt(shape[-2])
    values = {name: value.astype(dtype) for name, value in values.items()}
    layers = tuple(
        layer_from_checkpoint(
            {name: values[f"layers.{i}.{name}"] for name in checkpoint_layer_shapes(config, i)}, config
        )
        for i in range(config.num_layers)
    )
    return LlamaParams(values["embed"], layers, values["final_norm"], values.get("lm_head"))


# ---------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, form: str = "rms") -> jax.Array:
    """RMSNorm over the last axis, its statistics in float32. `form` "rms" (Llama) casts the
    normalized x back to x's dtype and then scales by w; "gemma" scales by 1 + w in float32 and
    casts after, each as its family's reference does (the two round differently in bfloat16)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if form == "gemma":
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    if form == "rms_float32":
        return (normed * weight.astype(jnp.float32)).astype(x.dtype)
    return (weight * normed.astype(x.dtype)).astype(x.dtype)


def _norm(config: LlamaConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    return rms_norm(x, weight, config.rms_norm_eps, config.norm)


def rope_inverse_frequencies(config: LlamaConfig, layer: int = 0) -> np.ndarray:
    """[R/2] float64 inverse frequencies of layer `layer` (R = config.rotary_dim), with its base and
    HF's "linear" or "llama3" scaling applied (see LlamaConfig.layer_rope)."""
    R = config.rotary_dim
    theta, scaling = config.layer_rope(layer)
    inv_freq = 1.0 / (theta ** (np.arange(0, R, 2, dtype=np.float64) / R))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, theta, R, scaling)
    # llama3: leave high frequencies alone, divide low ones by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(middle, blended, out)


def _yarn_inverse_frequencies(inv_freq: np.ndarray, theta: float, R: int, scaling) -> np.ndarray:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than `beta_slow` times over the original
    context are divided by `factor`, those that turn more than `beta_fast` times are kept, and a
    linear ramp over the dimension index blends the two in between, as transformers'
    `_compute_yarn_parameters`. (Its attention factor scales cos and sin: `apply_rope`.)"""

    def dimension(turns):  # the index whose frequency turns `turns` times over the original context
        original = scaling.original_max_position_embeddings
        return R * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(R // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq / scaling.factor * ramp + inv_freq * (1.0 - ramp)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, factor: float = 1.0) -> jax.Array:
    """Rotate x [B, T, N, E] by positions [B, T], in HF's half-split (rotate_half) layout, cos and
    sin times `factor` (YaRN's attention factor, config.rotary_factor: as transformers does, so
    that only the rotated dims are scaled). With fewer frequencies than E/2 (a partial rotary),
    only the first 2 * len(inv_freq) dims turn."""
    R = 2 * len(inv_freq)
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [B, T, R/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    # (x1 cos - x2 sin, x2 cos + x1 sin) written as x cos' + roll(x) sin': XLA:CPU ran the
    # concatenation of the two computed halves 13 times slower (60 small fusions in a decoding
    # step: 1.4 ms of an 8-row step of SmolLM2, 0.15 ms this way). The same products and sums,
    # though XLA may contract them into FMAs differently: within a rounding of the other form.
    cos, sin = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)
    turning = x[..., :R].astype(jnp.float32)
    rotated = (turning * cos + jnp.roll(turning, R // 2, axis=-1) * sin).astype(x.dtype)
    return rotated if R == x.shape[-1] else jnp.concatenate([rotated, x[..., R:]], axis=-1)


def causal_mask(num_tokens: int) -> np.ndarray:
    """[T, T] bool: fresh token t sees fresh tokens u <= t (a chain; trees pass their own). A
    numpy array, so that its values are known while tracing (see _fresh_attention)."""
    return np.tril(np.ones((num_tokens, num_tokens), bool))


# Prefill attention handles its queries in about this many chunks, each at least
# MIN_PREFILL_CHUNK queries long; see _fresh_attention.
PREFILL_CHUNKS = 8
MIN_PREFILL_CHUNK = 64


def _fresh_attention(q, k_new, v_new, fresh_mask, window_keep=None, window=None, positions=None, sinks=None):
    """A prefill into an empty cache: T queries [B, T, K, G, E] attend to the T fresh keys alone,
    under fresh_mask [T, T] and, for a sliding-window layer (`window`, the tokens at positions
    [B, T]), window_keep [B, T, T]. `sinks` [K, G]: each head's sink logit (`_softmax`).

    Where the backend has a blocked prefill kernel (accelerators: Pallas flash attention, or the
    blocked XLA form; specjax/kernels/backend.py) and the mask is known while tracing, that runs: working
    memory O(T x block), never [T, T] scores. Otherwise, on the CPU:

    When the mask is a known numpy array in which no token sees a later one (a causal mask, or a
    tree in node order), the queries go in chunks and chunk [a, b) scores keys [0, b) only.
    Scoring all [T, T] pairs spent half the work on pairs the mask drops, and passed a [K, G, T, T]
    score tensor through memory at every softmax pass: SmolLM2's prefill of 712 tokens took 1.44 s
    that way and 1.13 s in 8 chunks, of 1,912 tokens 6.8 s and 4.2 s (measured here). Each chunk
    is its own set of products to compile (2 to 3 s more per prompt bucket at 8 chunks; 16 chunks
    cost twice that and gained nothing more), hence PREFILL_CHUNKS.

    The operands are laid out once per layer as the cache holds its entries, one per row and kv
    head: queries [B*K, T*G, E] in (token, query head) order, keys and values [B*K, T, E]. A chunk
    then takes contiguous slices of each; sliced from [B, T, K, ...], every chunk's keys and
    values were transposed afresh, copies that grow with T squared (a layer's attention at T =
    832: 12.1 ms that way, 8.3 ms this way, in isolation).
    """
    T = q.shape[1]
    kernel = backend.active().prefill_attention(q.shape[-1])
    if kernel is not None and isinstance(fresh_mask, np.ndarray):
        return _blocked_fresh_attention(kernel, q, k_new, v_new, fresh_mask, window, positions, sinks)
    if not (isinstance(fresh_mask, np.ndarray) and not np.triu(fresh_mask, 1).any()):
        mask = fresh_mask if window_keep is None else jnp.asarray(fresh_mask) & window_keep
        return _masked_attention(q, k_new, v_new, mask, sinks)
    B, _, K, G, E = q.shape
    queries = q.transpose(0, 2, 1, 3, 4).reshape(B * K, T * G, E)
    keys = k_new.transpose(0, 2, 1, 3).reshape(B * K, T, E)
    values = v_new.transpose(0, 2, 1, 3).reshape(B * K, T, E)
    chunk = max(MIN_PREFILL_CHUNK, -(-T // PREFILL_CHUNKS))
    outs = []
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        row_sinks = None  # [B*K, t*G]: each query row's head's sink, rows laid out as the queries
        if sinks is not None:
            row_sinks = jnp.broadcast_to(sinks[None, :, None, :], (B, K, end - start, G))
            row_sinks = row_sinks.reshape(B * K, (end - start) * G)
        keep = np.repeat(fresh_mask[start:end, :end], G, axis=0)[None]  # rows in (token, head) order
        if window_keep is not None:  # [B, t, u] -> [B*K, t*G, u], as the queries are laid out
            window = jnp.broadcast_to(
                window_keep[:, None, start:end, None, :end], (B, K, end - start, G, end)
            )
            keep = keep & window.reshape(B * K, (end - start) * G, end)
        scores = jnp.einsum("rqe,rse->rqs", queries[:, start * G : end * G], keys[:, :end], **_F32)
        scores = _drop_masked(scores, keep)
        probs = _softmax(scores, q.dtype, row_sinks)
        outs.append(jnp.einsum("rqs,rse->rqe", probs, values[:, :end], **_F32))
    return jnp.concatenate(outs, axis=1).reshape(B, K, T, G, E).transpose(0, 2, 1, 3, 4)


def attention_workspace_bytes(
    config: LlamaConfig, batch_size: int, prompt_len: int, width: int, capacity: int, dtype, on
) -> int:
    """The most working memory one layer's attention takes on backend `on` (float32 scores and
    probabilities, partial outputs), beyond its inputs and outputs: the larger of a prefill of
    `prompt_len` tokens and a decoding pass of `width` tokens over `capacity` cache slots, for a
    batch of `batch_size` rows of a model in `dtype` (`on`: a specjax.kernels.backend.Backend). For the
    free-memory check: the score tensor of a long prompt can be larger than the cache."""
    B, H, E, T = batch_size, config.num_heads, config.head_dim, prompt_len
    if on.prefill_attention(E) is None:  # the CPU's chunks: one chunk's [chunk, T] scores at a time
        chunk = min(T, max(MIN_PREFILL_CHUNK, -(-T // PREFILL_CHUNKS)))
        prefill = 2 * B * H * chunk * T * 4
    else:  # blocked: per query a float32 output and its softmax statistics, O(T)
        prefill = 2 * B * H * T * (E + 2) * 4
    if on.cache_attention(E, dtype):
        decode = 4 * B * H * width * (E + 2 + width) * 4  # partial outputs; the fresh tokens' scores
    else:  # XLA scores every slot: [B, H, width, capacity + width], and its softmax
        decode = 2 * B * H * width * (capacity + width) * 4
    return max(prefill, decode)


def _blocked_fresh_attention(kernel, q, k_new, v_new, fresh_mask, window, positions, sinks=None):
    """`_fresh_attention` through a blocked kernel (contract of
    specjax.kernels.attention.prefill_attention), operands laid out one entry per row and kv head;
    sinks [K, G] as the kernel takes them, [B*K, G]."""
    B, T, K, G, E = q.shape
    queries = q.transpose(0, 2, 1, 3, 4).reshape(B * K, T, G, E)
    keys = k_new.transpose(0, 2, 1, 3).reshape(B * K, T, E)
    values = v_new.transpose(0, 2, 1, 3).reshape(B * K, T, E)
    mask = None if np.array_equal(fresh_mask, causal_mask(T)) else fresh_mask
    extra = {} if sinks is None else {"sinks": jnp.tile(sinks.astype(jnp.float32), (B, 1))}
    out = kernel(queries, keys, values, mask=mask, positions=positions, window=window, **extra)
    return out.reshape(B, K, T, G, E).transpose(0, 2, 1, 3, 4)


def _masked_attention(q, k, v, mask, sinks=None):
    """Queries q [B, T, K, G, E] attend to keys and values k, v [B, U, K, E] under mask [T, U] (or
    [B, T, U]); sinks [K, G] or None."""
    probs = _softmax(_masked_scores(q, k, mask), q.dtype, _head_sinks(sinks))
    return jnp.einsum("bkgtu,buke->btkge", probs, v, **_F32)


def _per_row(mask):
    """A mask [T, U] or [B, T, U] shaped to broadcast against scores [B, K, G, T, U]."""
    return mask[None, None, None] if mask.ndim == 2 else mask[:, None, None]


def _masked_scores(q, k, mask):
    """Scores [B, K, G, T, U] of queries q [B, T, K, G, E] against keys k [B, U, K, E], with the
    pairs mask [T, U] (or [B, T, U]) drops set to the lowest float."""
    scores = jnp.einsum("btkge,buke->bkgtu", q, k, **_F32)
    return _drop_masked(scores, _per_row(mask))


# Attention's products accumulate and return float32 (a no-op for a float32 model). In bfloat16,
# a verify pass and a one-token pass then differ only in float32 summation order, not in where
# partial results are rounded to bfloat16: the rounding happens once, at the attention's output.
_F32 = {"preferred_element_type": jnp.float32}


def _drop_masked(scores, keep):
    """scores where `keep` (broadcast against them), the lowest float elsewhere: the pairs a mask
    drops get no weight in the softmax."""
    return jnp.where(keep, scores, jnp.finfo(jnp.float32).min)


def _softmax(scores, dtype, sinks=None):
    """The softmax of scores [..., U] over the last axis, in float32, cast to `dtype`. `sinks`
    (broadcast against scores[..., 0]; gpt-oss): one more logit per row that takes its share of
    the softmax and adds no value, so the row's weights sum to less than 1."""
    scores = scores.astype(jnp.float32)
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1).astype(dtype)
    sinks = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32), scores.shape[:-1])[..., None]
    peak = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sinks)
    weights = jnp.exp(scores - peak)
    return (weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sinks - peak))).astype(dtype)


def _head_sinks(sinks):
    """Sinks [K, G] shaped to broadcast against a row of scores [B, K, G, T] (None stays None)."""
    return None if sinks is None else sinks[None, :, :, None]


def _cache_scores(q, k_cache):
    """Scores [B, K, G, T, S] of queries q [B, T, K, G, E] against the key cache [B*K, E, S].
    The product runs over the cache's own merged row-and-head axis, with each kv head's G*T
    queries as the rows of one product, so XLA reads the buffer as it is stored."""
    B, T, K, G, E = q.shape
    rows = q.transpose(0, 2, 3, 1, 4).reshape(B * K, G * T, E)  # entry b*K + k: its G*T queries
    return jnp.einsum("rqe,res->rqs", rows, k_cache.astype(q.dtype), **_F32).reshape(B, K, G, T, -1)


def _cache_values(probs, v_cache):
    """Attention weights probs [B, K, G, T, S] applied to the value cache [B*K, S, E]: [B, T, K, G, E]."""
    B, K, G, T, S = probs.shape
    out = jnp.einsum("rqs,rse->rqe", probs.reshape(B * K, G * T, S), v_cache.astype(probs.dtype), **_F32)
    return out.reshape(B, K, G, T, -1).transpose(0, 3, 1, 2, 4)


def visible_slots(cache_lengths: jax.Array, fresh_mask: jax.Array, num_slots: int) -> jax.Array:
    """[B, T, S] bool: which cache slots each of the T fresh tokens attends to, once the fresh
    tokens sit at slots `lengths .. lengths + T - 1`: every committed slot, and the fresh slots
    that `fresh_mask [T, T]` allows (a chain's causal mask, or a tree's ancestors)."""
    T = fresh_mask.shape[0]
    offset = jnp.arange(num_slots)[None, :] - cache_lengths[:, None]  # [B, S]: slot - length
    is_fresh = (offset >= 0) & (offset < T)
    fresh_visible = jnp.asarray(fresh_mask)[:, jnp.clip(offset, 0, T - 1)]  # [T, B, S]
    return (offset < 0)[:, None, :] | (is_fresh[:, None, :] & jnp.swapaxes(fresh_visible, 0, 1))


def slot_positions(cache_lengths: jax.Array, positions: jax.Array, num_slots: int) -> jax.Array:
    """[B, S] int32: the position each cache slot holds once the T fresh tokens (positions
    [B, T]) sit at slots `lengths .. lengths + T - 1`. A committed slot s holds position s: a row's
    sequence starts at slot 0 and a tree's accepted path is moved to where a chain puts it."""
    T = positions.shape[1]
    slots = jnp.arange(num_slots)[None, :]
    offset = slots - cache_lengths[:, None]  # [B, S]
    fresh = jnp.take_along_axis(positions, jnp.clip(offset, 0, T - 1), axis=1)
    return jnp.where((offset >= 0) & (offset < T), fresh, slots)


def in_window(query_positions: jax.Array, key_positions: jax.Array, window: int) -> jax.Array:
    """[B, T, U] bool: a query at position p sees a key at position p' when p - p' < window (HF's
    sliding-window rule); query_positions [B, T], key_positions [B, U]."""
    return query_positions[:, :, None] - key_positions[:, None, :] < window


def _cache_attention(q, k_cache, v_cache, visible, sinks=None):
    """T queries [B, T, K, G, E] attend to the cache (keys [B*K, E, S], values [B*K, S, E])
    where visible [B, T, S]; sinks [K, G] or None."""
    scores = _drop_masked(_cache_scores(q, k_cache), visible[:, None, None])
    return _cache_values(_softmax(scores, q.dtype, _head_sinks(sinks)), v_cache)


def _committed_and_fresh_attention(q, k_new, v_new, k_cache, v_cache, committed, fresh_mask, sinks=None):
    """T queries [B, T, K, G, E] attend, in one softmax, to the cache's committed slots
    (committed [B, S], or [B, T, S] under a sliding window; the cache is only read) and to the T
    fresh keys and values [B, T, K, E] under fresh_mask [T, T] (or [B, T, T]): what the
    write-first form computes, without writing."""
    S = v_cache.shape[1]
    keep = committed[:, None, None, None, :] if committed.ndim == 2 else committed[:, None, None]
    old = _drop_masked(_cache_scores(q, k_cache), keep)
    new = _masked_scores(q, k_new, fresh_mask)
    probs = _softmax(jnp.concatenate([old, new], axis=-1), q.dtype, _head_sinks(sinks))
    new = jnp.einsum("bkgtu,buke->btkge", probs[..., S:], v_new, **_F32)
    return _cache_values(probs[..., :S], v_cache) + new


def _kernel_attention(
    q,
    k_new,
    v_new,
    k_cache,
    v_cache,
    committed,
    fresh_mask,
    starts=None,
    layer=None,
    sinks=None,
    written=False,
):
    """T queries [B, T, K, G, E] attend, in one softmax, to each row's committed cache slots
    (0 .. committed[b] - 1, or from starts[b, t] on under a sliding window; read by the backend's
    kernel, `backend.active().cache_attention`: the CPU's specjax.kernels.cache_attention or a
    Pallas kernel) and to the T fresh keys and values [B, T, K, E] under fresh_mask [T, T] (or
    [B, T, T]): what `_committed_and_fresh_attention` and `_cache_attention` compute.

    XLA scores every slot of the static cache, committed or not (and XLA:CPU ran the small
    products at a fraction of the bandwidth: 30 layers over 896 slots, 4-5 ms for one token, 16 ms
    for nine). The kernel reads the committed slots only and returns its part of the softmax
    normalized, with the log-sum-exp of its scores; the fresh part joins by rescaling both to
    their common log-sum-exp. With `layer`, the caches are a stack's ([n, B*K, ...]) and the
    kernel reads that layer of them in place. A head's sink (sinks [K, G]) is one more term of
    that log-sum-exp, with no value: it only scales both parts down.

    `written`: the fresh keys and values are already in the cache, at slots committed[b] on. A
    pass of one token then needs no merge: the kernel reads one slot more, the token's own (a
    decoding step ran 8 small XLA ops a layer for the merge, about 1 us each, where its layer's
    kernels take 100-400 us in float32 and 40-150 in Q8_0).
    """
    B, T, K, G, E = q.shape
    queries = q.transpose(0, 2, 3, 1, 4).reshape(B * K, G * T, E)  # entry b*K + k: its G*T queries
    if starts is not None:  # [B, T] -> one per query row, in the same (entry, head, token) order
        starts = jnp.broadcast_to(starts[:, None, None, :], (B, K, G, T)).reshape(B * K, G * T)
    kernel = backend.active().cache_attention(E, q.dtype)
    stacked = {} if layer is None else {"layer": layer}
    # (A one-token pass's mask is [[True]]: it sees itself. A cache of another dtype holds the
    # token's key rounded, which the merge below does not read.)
    own_slot = written and T == 1 and k_cache.dtype == k_new.dtype and v_cache.dtype == v_new.dtype
    lengths = jnp.repeat(committed + 1 if own_slot else committed, K)
    old, old_lse = kernel(queries, k_cache, v_cache, lengths, starts, **stacked)
    old = old.reshape(B, K, G, T, E)
    old_lse = old_lse.reshape(B, K, G, T)
    if own_slot:
        if sinks is not None:  # the sink's share of the softmax scales the output down
            old = old * jax.nn.sigmoid(old_lse - _head_sinks(sinks).astype(jnp.float32))[..., None]
        return old.transpose(0, 3, 1, 2, 4).astype(q.dtype)
    scores = _masked_scores(q, k_new, fresh_mask).astype(jnp.float32)  # [B, K, G, T, T]
    new_lse = jax.nn.logsumexp(scores, axis=-1)  # finite: a fresh token always sees itself
    new = jnp.einsum("bkgtu,buke->bkgte", jnp.exp(scores - new_lse[..., None]), v_new.astype(jnp.float32))
    lse = jnp.logaddexp(old_lse, new_lse)  # old_lse is -inf for a row with nothing committed
    if sinks is not None:
        lse = jnp.logaddexp(lse, _head_sinks(sinks).astype(jnp.float32))
    out = old * jnp.exp(old_lse - lse)[..., None] + new * jnp.exp(new_lse - lse)[..., None]
    return out.transpose(0, 3, 1, 2, 4).astype(q.dtype)  # [B, T, K, G, E]


def attention(
    q,
    k_new,
    v_new,
    k_cache,
    v_cache,
    visible,
    fresh_mask,
    write=True,
    committed=None,
    scale=None,
    window_keep=None,
    starts=None,
    window=None,
    positions=None,
    layer=None,
    sinks=None,
):
    """Attention of T fresh queries q [B, T, H, E]; returns [B, T, H*E]. Scores are scaled by
    `scale` (default 1/sqrt(E)). `sinks` [H] (gpt-oss): each head's logit that joins its softmax
    with no value (compared with the scaled scores), in every form below. With `layer` (an
    index), k_cache and v_cache are a stack's buffers ([n, B*K, ...], see KVCache) and the
    layer's attention reads layer `layer` of them.

    Decoding (`visible [B, T, S]` given): the fresh keys and values are already written into the
    cache k_cache [B*K, E, S], v_cache [B*K, S, E], and the queries attend to the visible slots. Writing
    before reading means the old buffer is dead once written, so XLA can update it in place
    (reading the old cache after the write kept both alive and copied the cache every step; see
    KVCache for the layout that keeps the write in place). A prefill into an empty cache
    (`visible` None) attends to the fresh k_new, v_new [B, T, K, E] alone under fresh_mask
    [T, T]. With `write=False` the cache holds only committed entries and `visible` ([B, S], or
    [B, T, S] under a sliding window) marks them; the fresh keys join under fresh_mask.
    With `committed [B]` (each row's committed slots; a decoding pass of a model whose weights are
    panels, see `decoder_layers`), either form goes through the CPU kernel: `_kernel_attention`,
    where `starts [B, T]` (a sliding window) is the first committed slot each token sees.
    `window_keep [B, T, T]`: which fresh pairs a sliding window keeps (prefill, read-only and
    kernel forms; the write-first form has it in `visible`). `window` and `positions` [B, T]: the
    sliding window and the tokens' positions, for a prefill's blocked kernel.
    """
    B, T, H, E = q.shape
    K = k_new.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    q = q.reshape(B, T, K, H // K, E) * scale
    fresh = fresh_mask if window_keep is None else jnp.asarray(fresh_mask) & window_keep
    sinks = None if sinks is None else sinks.reshape(K, H // K)  # [K, G]: as the queries' heads
    if committed is not None:
        out = _kernel_attention(
            q, k_new, v_new, k_cache, v_cache, committed, fresh, starts, layer, sinks, written=write
        )
    elif visible is None:
        out = _fresh_attention(q, k_new, v_new, fresh_mask, window_keep, window, positions, sinks)
    else:
        if layer is not None:  # a stack's buffers: XLA reads the layer's slice in its products
            k_cache = jax.lax.dynamic_index_in_dim(k_cache, layer, keepdims=False)
            v_cache = jax.lax.dynamic_index_in_dim(v_cache, layer, keepdims=False)
        if not write:
            out = _committed_and_fresh_attention(q, k_new, v_new, k_cache, v_cache, visible, fresh, sinks)
        else:
            out = _cache_attention(q, k_cache, v_cache, visible, sinks)
    return out.reshape(B, T, H * E).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class _LayerMasks:
    """What the fresh tokens of one pass attend to in layers of one kind (full attention, or one
    sliding window): the arguments of `attention` that depend on the window."""

    visible: jax.Array | None  # see `attention`
    window_keep: jax.Array | None  # [B, T, T], only under a window
    starts: jax.Array | None  # [B, T], only under a window with the kernel
    window: int | None = None  # the window, for a prefill's blocked kernel
    positions: jax.Array | None = None  # [B, T], likewise


def _layer_masks(window, positions, cache, fresh_mask, visible, write, committed) -> _LayerMasks:
    """Masks for the layers with sliding window `window` (None: full attention), from the pass's
    full-attention `visible` (None for a prefill)."""
    if window is None:
        return _LayerMasks(visible, None, None)
    keep = in_window(positions, positions, window)  # [B, T, T]
    if visible is None:  # a prefill: only fresh pairs
        return _LayerMasks(None, keep, None, window, positions)
    S = cache.capacity
    if committed is not None:  # the kernel: committed slots from positions - window + 1 on
        return _LayerMasks(visible, keep, positions - (window - 1))
    if not write:  # committed slots [B, S] -> [B, T, S]; slot s holds position s
        slots = jnp.broadcast_to(jnp.arange(S)[None, :], (positions.shape[0], S))
        return _LayerMasks(visible[:, None, :] & in_window(positions, slots, window), keep, None)
    near = in_window(positions, slot_positions(cache.lengths, positions, S), window)
    return _LayerMasks(visible & near, None, None)


def _gated(config: LlamaConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated MLP's hidden activations from its gate and up projections [..., F]."""
    if config.hidden_act == "clamped_swiglu":  # gpt-oss
        limit = config.swiglu_limit
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return gate * jax.nn.sigmoid(config.swiglu_alpha * gate) * (up + 1)
    if config.hidden_act == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    return jax.nn.silu(gate) * up


def _gated_mlp(config: LlamaConfig, h: jax.Array, gate, up, down, norm=None, residual=None) -> jax.Array:
    """A gated MLP over h [..., D]: a layer's dense MLP, or an MoE layer's shared experts. `gate`
    may be both projections as one panel weight (GateUpPanels; `up` is None then). `norm` and
    `residual`: h normed first, the residual added to the output (see `project`)."""
    if isinstance(gate, GateUpPanels):
        both = project(h, gate.both, norm=norm)
        F = gate.hidden
        activations = _gated(config, both[..., :F], both[..., gate.up_start : gate.up_start + F])
    else:
        activations = _gated(config, project(h, gate, norm=norm), project(h, up, norm=norm))
    return project(activations, down, residual=residual)


def route(config: LlamaConfig, x: jax.Array, lp: LayerParams) -> tuple[jax.Array, jax.Array]:
    """The experts each of N tokens x [N, D] goes to and their weights, every family's one way:
    the router's logits (lp.router [D, X], plus lp.router_bias [X], gpt-oss's) are scored by a
    softmax over the experts (Mixtral, Qwen3-MoE, gpt-oss) or each by its sigmoid (GLM-4.5,
    DeepSeek-V3), in float32. The choice ranks the scores plus lp.router_score_bias [X] (a
    correction DeepSeek learns for load balance) where given: the experts fall into
    num_expert_groups groups, each ranked by the sum of its two best, and a token picks its top
    num_experts_per_tok among the experts of its best topk_expert_groups groups. The weights are
    the chosen experts' scores without the correction, renormalized to sum to 1 where
    norm_topk_prob says (gpt-oss's softmax over the top k logits is that), times
    routed_scaling_factor. Returns (weights [N, k] float32, experts [N, k] int32)."""
    N, X = x.shape[0], lp.router.shape[-1]
    if config.router_scoring == "sigmoid":  # the product in float32, as DeepSeek's and GLM's are
        logits = x.astype(jnp.float32) @ lp.router.astype(jnp.float32)
    else:
        logits = x @ lp.router
    if lp.router_bias is not None:
        logits = logits + lp.router_bias
    logits = logits.astype(jnp.float32)  # [N, X]
    if config.router_scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores if lp.router_score_bias is None else scores + lp.router_score_bias.astype(jnp.float32)
    groups = config.num_expert_groups
    if config.topk_expert_groups < groups:
        by_group = choice.reshape(N, groups, X // groups)
        group_scores = jnp.sum(jax.lax.top_k(by_group, 2)[0], axis=-1)  # [N, groups]
        _, best = jax.lax.top_k(group_scores, config.topk_expert_groups)  # [N, topk_groups]
        kept = jnp.any(best[:, :, None] == jnp.arange(groups)[None, None, :], axis=1)  # [N, groups]
        choice = jnp.where(jnp.repeat(kept, X // groups, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, config.num_experts_per_tok)  # [N, k]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if config.norm_topk_prob:  # (DeepSeek's 1e-20 guards sigmoid scores that all underflow)
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * config.routed_scaling_factor, experts.astype(jnp.int32)


def moe_mlp(
    config: LlamaConfig, h: jax.Array, lp: LayerParams, reduce: Callable[[jax.Array], jax.Array] | None = None
) -> jax.Array:
    """A mixture of experts over h [B, T, D]: each token through its num_experts_per_tok experts
    (gated MLPs with weights expert_gate, expert_up [X, D, F], expert_down [X, F, D], and with
    config.moe_bias their biases), summed with the router's weights (`route`). Only the routed
    experts' weights are read:

    - on GPU and TPU, the (token, expert) assignments are sorted by expert and each expert applied
      to its group by `jax.lax.ragged_dot`, a grouped product over the routed experts only;
    - on the CPU, where XLA lowers ragged_dot to a masked product over every expert and every
      assignment (a decoding step 5 to 25 times slower here), a loop over the experts skips those
      no token was routed to and runs each routed one once over all the tokens
      (`_experts_one_by_one`).

    Where the family has shared experts (config.shared_expert_size), their gated MLP over every
    token is added. Under tensor parallelism each device holds every expert's slice of F (and the
    shared experts' slice of theirs), routes the same way (the router is replicated), and
    `reduce` (default: none) sums the partial outputs; the down projections' biases, whole on
    every device, join after that sum, once.
    """
    B, T, D = h.shape
    x = h.reshape(B * T, D)
    weights, experts = route(config, x, lp)  # [N, k]
    if backend.active().experts_one_by_one():
        mixed = _experts_one_by_one(config, x, weights, experts, lp)
    else:
        mixed = _experts_grouped(config, x, weights, experts, lp)
    out = mixed.astype(h.dtype)
    if lp.shared_gate is not None:  # shared experts: one gated MLP every token goes through
        out = out + _gated_mlp(config, x, lp.shared_gate, lp.shared_up, lp.shared_down)
    out = (_identity if reduce is None else reduce)(out)
    if lp.expert_down_bias is not None:  # each token's routed experts' biases, weighted
        biases = lp.expert_down_bias[experts].astype(jnp.float32)  # [N, k, D]
        out = out + jnp.einsum("nk,nkd->nd", weights, biases).astype(h.dtype)
    return out.reshape(B, T, D)


def _expert_mlp(config: LlamaConfig, x, lp: LayerParams, j) -> jax.Array:
    """Expert j's MLP over x [N, D], without its down projection's bias (see `moe_mlp`); its
    weights arrays or quantized, each product reading them as the backend does."""
    gate, up = project(x, _expert(lp.expert_gate, j)), project(x, _expert(lp.expert_up, j))
    if lp.expert_gate_bias is not None:
        gate, up = gate + lp.expert_gate_bias[j], up + lp.expert_up_bias[j]
    return project(_gated(config, gate, up), _expert(lp.expert_down, j))


def _expert(w, j):
    """Expert j's weight [D_in, D_out] of a stack of them [X, D_in, D_out] (an array or quantized)."""
    return jax.tree.map(lambda a: a[j], w)


def _experts_one_by_one(config: LlamaConfig, x, weights, experts, lp: LayerParams) -> jax.Array:
    """[N, D] float32: for each expert some token was routed to, its MLP over all N tokens, added
    with each token's weight for it (0 for the tokens not routed to it); the other experts are
    skipped (a lax.cond), their weights never read."""

    def add_expert(j, out):
        routed = experts == j  # [N, k]
        weight = jnp.sum(jnp.where(routed, weights, 0.0), axis=-1)  # [N]

        def run(out):
            y = _expert_mlp(config, x, lp, j)
            return out + y.astype(jnp.float32) * weight[:, None]

        return jax.lax.cond(jnp.any(routed), run, lambda out: out, out)

    # Zeros typed like an expert's output: under shard_map, varying over the same mesh axes as the
    # weights' slices (lax.cond wants both branches, and the loop its carry, of one type).
    # (A quantized weight's values are split as the weight is, along D_in or D_out.)
    down = lp.expert_down.values if isinstance(lp.expert_down, QuantizedWeight) else lp.expert_down
    zeros = jnp.zeros_like(x[:, :1] * down[0, :1, :], jnp.float32)  # [N, D]
    return jax.lax.fori_loop(0, lp.expert_gate.shape[0], add_expert, zeros)


def _experts_grouped(config: LlamaConfig, x, weights, experts, lp: LayerParams) -> jax.Array:
    """[N, D] float32: the assignments sorted by expert, each expert's MLP applied to its group by
    `jax.lax.ragged_dot`, the results put back in assignment order and summed per token."""
    N, k = experts.shape
    chosen = experts.reshape(-1)  # [M]: assignment m belongs to token m // k
    order = jnp.argsort(chosen, stable=True)
    sizes = jnp.bincount(chosen, length=lp.expert_gate.shape[0]).astype(jnp.int32)
    rows = x[order // k]
    # ragged_dot takes float weights: quantized experts are dequantized here, a float copy of the
    # layer's expert weights while it runs (the CPU loops over the experts instead, each product
    # reading its integers).
    gate_w, up_w, down_w = (as_array(w, x.dtype) for w in (lp.expert_gate, lp.expert_up, lp.expert_down))
    gate = jax.lax.ragged_dot(rows, gate_w, sizes)
    up = jax.lax.ragged_dot(rows, up_w, sizes)
    if lp.expert_gate_bias is not None:  # each sorted row's expert's biases
        gate, up = gate + lp.expert_gate_bias[chosen[order]], up + lp.expert_up_bias[chosen[order]]
    grouped = jax.lax.ragged_dot(_gated(config, gate, up), down_w, sizes)
    out = jnp.zeros_like(grouped).at[order].set(grouped)  # back in assignment order
    return jnp.sum(out.reshape(N, k, -1).astype(jnp.float32) * weights[..., None], axis=1)


def _layer(
    config: LlamaConfig,
    masks: _LayerMasks,
    inv_freq: np.ndarray,
    positions,
    cache,
    fresh_mask,
    x,
    lp,
    k_buf,
    v_buf,
    reduce,
    write,
    committed=None,
    attention_input=None,
    layer=None,
):
    """One decoder layer. x [B, T, D]; k_buf, v_buf this layer's cache buffers (see KVCache), or
    with `layer` (an index) a stack's buffers, of which the layer reads and writes that one;
    `masks` what its kind of attention sees (`_layer_masks`), inv_freq its rotary frequencies.
    Returns the new x and the buffers with the fresh keys and values written at slots
    `cache.lengths + t`; with `write=False`, the new x and the fresh keys and values [B, T, K, E].

    Head counts come from the weights' shapes, not the config, so that the same code runs on a
    tensor-parallel slice holding K/m whole kv-head groups (H/m query and K/m kv heads); `reduce`
    then sums the partial outputs of o and down over the slices (see specjax/sharding). Norms of
    an output (Gemma's sandwich norms) come after the sum: they need the whole vector.
    `committed` (each row's committed slots) sends attention through the CPU kernel (`attention`).
    `attention_input(x, lp) -> (attention's input, the residual)` replaces the usual (norm of x,
    x): an EAGLE-3 head's first layer reads a token embedding and a feature side by side
    (models/eagle3.py).
    """
    B, T, _ = x.shape
    E, G = config.head_dim, config.num_heads // config.num_kv_heads
    norm = None
    if attention_input is not None:
        h, residual = attention_input(x, lp)
    elif config.kv_lora_rank:
        h, residual = _norm(config, x, lp.attn_norm), x
    else:  # the norm goes with qkv's product (`project`)
        h, residual, norm = x, x, (config, lp.attn_norm)
    if config.kv_lora_rank:  # DeepSeek's latent attention (models/mla.py)
        out, k_new, v_new = mla.mla_attention(
            config, masks, inv_freq, positions, cache, fresh_mask, h, lp, k_buf, v_buf, write, layer
        )
        return (residual_mlp(config, residual + reduce(out), lp, reduce), k_new, v_new)
    qkv = project(h, lp.qkv, norm=norm)
    if config.qkv_bias:
        qkv = qkv + lp.qkv_bias
    qkv = qkv.reshape(B, T, -1, G + 2, E)  # [B, T, K, G+2, E]: K local kv heads, see fuse_qkv
    K = qkv.shape[2]
    q, k, v = qkv[:, :, :, :G].reshape(B, T, K * G, E), qkv[:, :, :, G], qkv[:, :, :, G + 1]
    if config.qk_norm:
        q, k = _norm(config, q, lp.q_norm), _norm(config, k, lp.k_norm)
    factor = config.rotary_factor
    q, k = apply_rope(q, positions, inv_freq, factor), apply_rope(k, positions, inv_freq, factor)
    if write:
        fresh = masks.visible is None  # a prefill into an empty cache
        k_buf, v_buf = cache.write_keys(k_buf, k, fresh, layer), cache.write_values(v_buf, v, fresh, layer)
    attended = attention(
        q,
        k,
        v,
        k_buf,
        v_buf,
        masks.visible,
        fresh_mask,
        write,
        committed,
        scale=config.attention_scale,
        window_keep=masks.window_keep,
        starts=masks.starts,
        window=masks.window,
        positions=masks.positions,
        layer=layer,
        sinks=lp.sinks,
    )
    if reduce is _identity and lp.o_bias is None and lp.attn_out_norm is None:
        x = project(attended, lp.o, residual=residual)  # the sum goes with the product
    else:
        out = reduce(project(attended, lp.o))
        if lp.o_bias is not None:  # whole on every device: after the sum of the slices' products
            out = out + lp.o_bias
        x = residual + (out if lp.attn_out_norm is None else _norm(config, out, lp.attn_out_norm))
    x = residual_mlp(config, x, lp, reduce)
    return (x, k_buf, v_buf) if write else (x, k, v)


def residual_mlp(config: LlamaConfig, x: jax.Array, lp: LayerParams, reduce) -> jax.Array:
    """x [B, T, D] plus the layer's MLP (dense or experts) of its normed x."""
    if lp.router is None and reduce is _identity and lp.mlp_out_norm is None:
        # the norm and the sum go with the products (`project`)
        return _gated_mlp(config, x, lp.gate, lp.up, lp.down, norm=(config, lp.mlp_norm), residual=x)
    h = _norm(config, x, lp.mlp_norm)
    if lp.router is None:
        out = reduce(_gated_mlp(config, h, lp.gate, lp.up, lp.down))
    else:
        out = moe_mlp(config, h, lp, reduce)
    return x + (out if lp.mlp_out_norm is None else _norm(config, out, lp.mlp_out_norm))


def attention_keys_values(
    config: LlamaConfig,
    lp: LayerParams,
    x: jax.Array,
    positions: jax.Array,
    layer: int = 0,
    attention_input: Callable | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The keys (normed where the family norms them, rotated) and values [B, T, K, E] that layer
    `layer` (weights lp) writes into its cache for its input x [B, T, D] at positions [B, T], as
    `_layer` computes them (`attention_input` as there): all a caller needs where only the cache
    matters (a head catching up on the target's features, DFlash's context), without the layer's
    attention and MLP. The queries are computed and dropped: one fused product."""
    h = _norm(config, x, lp.attn_norm) if attention_input is None else attention_input(x, lp)[0]
    B, T, _ = h.shape
    E, G = config.head_dim, config.num_heads // config.num_kv_heads
    qkv = project(h, lp.qkv)
    if config.qkv_bias:
        qkv = qkv + lp.qkv_bias
    qkv = qkv.reshape(B, T, qkv.shape[-1] // ((G + 2) * E), G + 2, E)  # (no -1: T may be 0)
    k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]
    if config.qk_norm:
        k = _norm(config, k, lp.k_norm)
    return apply_rope(k, positions, rope_inverse_frequencies(config, layer), config.rotary_factor), v


def project(x: jax.Array, w: jax.Array, norm=None, residual: jax.Array | None = None) -> jax.Array:
    """x [..., D_in] @ w [D_in, D_out], as the active backend multiplies (specjax/kernels/backend.py: on
    the CPU, weights stored as panels go through the CPU kernel and one or two rows are split for
    both cores; elsewhere the plain product).

    `norm` (config, weight [D_in]): x normed first (`_norm`); `residual` [..., D_out]: added to the
    product. The CPU kernels do both inside their call for float32 rows and Llama's form of the
    norm (specjax.kernels.around): as XLA ops they were five of a one-row step's 24 small ops a
    layer (a norm alone four), about 1 us each. Elsewhere they are XLA's, as written."""
    on = backend.active()
    if on.fuses_around(w) and x.dtype == jnp.float32 and (norm is None or norm[0].norm in _KERNEL_NORMS):
        kernel_norm = None if norm is None else (norm[1], norm[0].rms_norm_eps)
        return on.matmul(x, w, norm=kernel_norm, residual=residual)
    if norm is not None:
        x = _norm(norm[0], x, norm[1])
    out = on.matmul(x, w)
    return out if residual is None else residual + out


# The norms the CPU kernels compute: in float32 both are x times its inverse RMS, times the weight.
_KERNEL_NORMS = ("rms", "rms_float32")


PANEL_FIELDS = ("qkv", "o", "gate", "up", "down")


def with_panel_weights(params: LlamaParams) -> LlamaParams:
    """The same model with every layer's projection weights stored as panels (specjax.kernels),
    which `project` multiplies with the CPU decoding kernel, and a panel copy of the LM head for
    `lm_head` (the [V, D] embedding stays for token lookups). For inference on the CPU only: the
    kernel has no gradient and no sharding rule, and it computes in float32 (`generate` packs
    float32 models only). A mixture of experts' weights stay as they are (see `moe_mlp`). Quantized
    weights (QuantizedWeight) become quantized panels, multiplied by the quantized kernel."""
    layers = tuple(panel_layer(layer) for layer in params.layers)
    head = params.embed.T if params.lm_head is None else params.lm_head
    return params.replace(layers=layers, head_panels=pack_panels(head))


def panel_layer(layer: LayerParams) -> LayerParams:
    """One layer with its projection weights as panels (see `with_panel_weights`); a trained
    head's layers take the same form for drafting on the CPU. A dense MLP's gate and up become one
    panel weight where they are stored alike (GateUpPanels, in `gate`; `up` is None)."""
    packed = {
        name: pack_panels(getattr(layer, name)) for name in PANEL_FIELDS if getattr(layer, name) is not None
    }
    if "gate" in packed and "up" in packed:
        fused = fuse_gate_up(packed["gate"], packed["up"])
        if fused is not None:
            packed.update(gate=fused, up=None)
    return layer.replace(**packed)


@flax.struct.dataclass
class GateUpPanels:
    """A gated MLP's gate and up weights [D, F] as one panel weight: gate's panels, then up's, so
    that the CPU kernel multiplies both in one call. Each kernel call costs a few microseconds
    beside its product (a [576, 64] product in cache took 3-3.5 us, an XLA elementwise op 1.2;
    running it on one thread instead of handing parts to the pool changed nothing), which a
    one-row 4-bit product of SmolLM2's shapes, 15-40 us, feels. Measured here
    (benchmarks/quantized_products.py's harness, one row): a 4-bit [576, 3072] product 39.5 us
    against 2 x 28.1 for two [576, 1536] ones, float32 158 against 2 x 90; the built-in model's
    Q4_1 generate of 128 tokens, fused and unfused packings of the same weights timed in turn in
    one process, 6.5% faster fused (float32: the same, 1.009x; docs/benchmarks.md)."""

    # Columns [0, hidden): gate's; [up_start, up_start + hidden): up's.
    both: PanelWeight | QuantizedPanelWeight
    hidden: int = flax.struct.field(pytree_node=False)  # F
    up_start: int = flax.struct.field(pytree_node=False)  # gate's columns rounded up to whole panels


def fuse_gate_up(gate, up) -> GateUpPanels | None:
    """gate and up (panels of one kind, [D, F] each) as GateUpPanels; None where they are stored
    differently (float32 beside quantized, or other bits, groups or scale types, as a GGUF file
    may mix), which then stay two products."""
    if gate.shape != up.shape or type(gate) is not type(up):
        return None
    F = gate.shape[1]
    if isinstance(gate, PanelWeight):
        up_start = gate.panels.shape[0] * PANEL
        both = PanelWeight(panels=jnp.concatenate([gate.panels, up.panels]), d_out=up_start + F)
        return GateUpPanels(both=both, hidden=F, up_start=up_start)
    kinds = [(w.bits, w.group, w.scales.dtype, w.offsets is None) for w in (gate, up)]
    if kinds[0] != kinds[1]:
        return None
    offsets = None if gate.offsets is None else jnp.concatenate([gate.offsets, up.offsets])
    num_panels = gate.values.shape[0]
    both = gate.replace(
        values=jnp.concatenate([gate.values, up.values]),
        scales=jnp.concatenate([gate.scales, up.scales]),
        offsets=offsets,
        d_out=num_panels * PANEL + F,
    )
    return GateUpPanels(both=both, hidden=F, up_start=num_panels * PANEL)


def pack_panels(w) -> PanelWeight | QuantizedPanelWeight:
    """A weight [D_in, D_out] as the CPU kernels' panels: quantized ones for a QuantizedWeight,
    float32 ones for an array and for FP8 values, dequantized: FP8 has no CPU kernel, and int8
    panels would round its values again (see docs/models.md, "Quantized weights", for the
    measurement)."""
    if is_fp8(w):
        return pack(as_array(w, jnp.float32))
    return pack_quantized(w) if isinstance(w, QuantizedWeight) else pack(w)


def _identity(x: jax.Array) -> jax.Array:
    return x


def embed_tokens(params: LlamaParams, config: LlamaConfig, tokens: jax.Array) -> jax.Array:
    """The token embeddings [..., D] of tokens [...], times sqrt(hidden_size) for the families
    that scale them (Gemma: the factor rounded to the model's dtype first, as HF does)."""
    x = params.embed[tokens]
    if config.embed_scale:
        x = x * jnp.asarray(math.sqrt(config.hidden_size), x.dtype)
    return x


def forward_hidden(
    params: LlamaParams,
    config: LlamaConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    fresh_mask: jax.Array | None = None,
    empty_cache: bool = False,
    reduce: Callable[[jax.Array], jax.Array] | None = None,
    write: bool = True,
    capture: tuple[int, ...] = (),
) -> tuple[jax.Array, KVCache | FreshEntries] | tuple[jax.Array, KVCache | FreshEntries, jax.Array]:
    """Run T new tokens per row through the model and its final norm.

    tokens, positions [B, T] int32. The tokens' keys and values are written into the cache at
    slots `cache.lengths + t`; `cache.lengths` is left for the caller to advance. A cache with
    fewer layers than the model runs only the first layers (an early-exit self-draft).
    `empty_cache=True` (a prefill into a fresh cache) skips reading the cache: besides saving the
    work, it keeps XLA from constant-folding attention over the all-zero buffers, which took
    minutes of compile time. `reduce` (default: none) is applied to each layer's attention and MLP
    outputs before they join the residual stream: under tensor parallelism, the sum over the model
    axis of the partial products. Returns the final-normed hidden states [B, T, D] and the cache,
    or with `write=False` the cache untouched and the fresh entries returned instead
    (FreshEntries, for `KVCache.write`; see there for why). With `capture` (layer ids; id i is the
    residual stream entering layer i, id L the last layer's output, before the final norm), a
    third value: those streams side by side, [B, T, len(capture) * D] (an EAGLE-3 head's input).
    """
    if cache.num_layers > config.num_layers:
        raise ValueError(f"cache has {cache.num_layers} layers, the model only {config.num_layers}")
    x = embed_tokens(params, config, tokens)  # [B, T, D]
    layers = params.layers[: len(cache.k)]  # (a stack's buffer may hold its first layers only)
    out = decoder_layers(
        layers, config, x, positions, cache, fresh_mask, empty_cache, reduce, write=write, capture=capture
    )
    return (_norm(config, out[0], params.final_norm), *out[1:])


def decoder_layers(
    layers: tuple[LayerParams, ...],
    config: LlamaConfig,
    x: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    fresh_mask: jax.Array | None = None,
    empty_cache: bool = False,
    reduce: Callable[[jax.Array], jax.Array] | None = None,
    visible: jax.Array | None = None,
    write: bool = True,
    first_attention_input: Callable | None = None,
    capture: tuple[int, ...] = (),
) -> tuple[jax.Array, KVCache | FreshEntries] | tuple[jax.Array, KVCache | FreshEntries, jax.Array]:
    """Run the residual stream x [B, T, D] through `layers` (one cache buffer each), writing the
    fresh keys and values at slots `cache.lengths + t`. The body of `forward_hidden`, and the
    decoder layer of an EAGLE head (which feeds its own inputs rather than token embeddings).
    `visible [B, T, S]` overrides which cache slots each fresh token attends to (default:
    `visible_slots`; EAGLE's unrolled training loss sets its own). Returns x after the last layer
    (not normed) and the cache, or with `write=False` (a decoding pass only) the fresh entries.
    `first_attention_input`: the first layer's `attention_input` (see `_layer`). `capture`: see
    `forward_hidden` (a third value, the captured streams side by side)."""
    T = x.shape[1]
    if fresh_mask is None:
        fresh_mask = causal_mask(T)
    elif isinstance(fresh_mask, np.ndarray):  # kept on the host: see _fresh_attention
        fresh_mask = fresh_mask.astype(bool)
    else:
        fresh_mask = jnp.asarray(fresh_mask, bool)
    reduce = _identity if reduce is None else reduce
    # Where the backend has a kernel that reads each row's committed slots only (the CPU's, or
    # Pallas on an accelerator), decoding passes attend through it; not where `visible` is given
    # (it says what to attend to).
    committed = None
    if (
        not empty_cache
        and visible is None
        and not config.kv_lora_rank  # latent attention reads its cache itself (models/mla.py)
        and backend.active().cache_attention(config.head_dim, x.dtype)
    ):
        committed = cache.lengths
    if not write:
        if empty_cache or visible is not None:
            raise ValueError("write=False is for decoding passes over a cache's committed slots")
        visible = jnp.arange(cache.capacity)[None, :] < cache.lengths[:, None]  # [B, S] committed
    elif visible is None and not empty_cache:
        visible = visible_slots(cache.lengths, fresh_mask, cache.capacity)
    # Layers of one kind (window, rotary base) share their masks and frequencies: Gemma 3
    # interleaves two kinds, other families have one.
    masks, frequencies = {}, {}
    num_layers = cache.num_layers
    if any(not 0 <= i <= num_layers for i in capture):
        raise ValueError(f"capture: layer ids must be in 0..{num_layers}, got {capture}")

    def kind(i):  # the masks and rotary frequencies of layer i
        window, rope = config.layer_window(i), config.layer_rope(i)
        if window not in masks:
            masks[window] = _layer_masks(window, positions, cache, fresh_mask, visible, write, committed)
        if rope not in frequencies:
            frequencies[rope] = rope_inverse_frequencies(config, i)
        return masks[window], frequencies[rope]

    new_k, new_v, captured = [], [], {}
    first = 0  # the index of the buffer's first layer
    for element, k_buf, v_buf in zip(layers, cache.k, cache.v, strict=True):
        n = layers_in(k_buf)
        run = (config, *kind(first), positions, cache, fresh_mask)
        if isinstance(element, LayerStack):
            if first == 0 and first_attention_input is not None:
                raise ValueError("first_attention_input: the first layer must not be in a LayerStack")
            # The stack's layers may be of several kinds (Gemma 3's sliding and full layers): one
            # set of `_layer`'s leading arguments per kind, and each layer's kind.
            keys = [(config.layer_window(first + j), config.layer_rope(first + j)) for j in range(n)]
            distinct = list(dict.fromkeys(keys))
            runs = [
                (config, *kind(first + keys.index(key)), positions, cache, fresh_mask) for key in distinct
            ]
            kind_of = tuple(distinct.index(key) for key in keys)
            x, k_out, v_out = _stacked_layers(
                runs, kind_of, element, x, k_buf, v_buf, reduce, write, committed, first, capture, captured
            )
        else:
            if first in capture:
                captured[first] = x
            x, k_out, v_out = _layer(
                *run,
                x,
                element,
                k_buf,
                v_buf,
                reduce,
                write,
                committed,
                first_attention_input if first == 0 else None,
            )
        new_k.append(k_out)
        new_v.append(v_out)
        first += n
    captured[num_layers] = x
    entries = (
        FreshEntries(k=tuple(new_k), v=tuple(new_v))
        if not write
        else cache.replace(k=tuple(new_k), v=tuple(new_v))
    )
    if not capture:
        return x, entries
    return x, entries, jnp.concatenate([captured[i] for i in capture], axis=-1)


def _stacked_layers(
    runs, kind_of, stack: LayerStack, x, k_buf, v_buf, reduce, write, committed, first, capture, captured
):
    """The first n layers of `stack` (n: those its cache buffers k_buf, v_buf [n, B*K, ...] hold;
    an early exit may end inside a stack), as `fori_loop`s over the stacked weights and buffers:
    one loop, or one per stretch between the layer ids in `capture` (the streams entering those
    layers go into `captured`). `runs`: `_layer`'s leading arguments (masks, rotary frequencies)
    for each kind of layer in the stack; `kind_of[j]`: layer j's. Returns x and the written
    buffers, or with `write=False` the fresh entries [n, B, T, K, E].

    Each step takes its layer's slice of the weights (XLA fuses it into the products) and reads
    and writes its layer of the stacked buffers in place; with `write=False` the loop carries the
    fresh entries out instead. Layers of several kinds (a window on some, another rotary base)
    run through a `lax.switch` on the layer's kind, one branch per kind, so the loop's body holds
    one copy of the layer per kind whatever the depth. A prefill's switch only computes (its
    attention reads no cache) and the write follows it, so the cache is updated in place; a
    decoding pass that writes (a draft model's own) updates it inside the branches."""
    n = layers_in(k_buf)
    B, T, _ = x.shape
    K, E, Ev = k_buf.shape[1] // B, k_buf.shape[2], v_buf.shape[3]
    if write:
        k_out, v_out = k_buf, v_buf
    else:  # zeros "like" the buffers: under shard_map, varying over the same mesh axes
        k_out = jnp.zeros_like(k_buf, x.dtype, shape=(n, B, T, K, E))
        v_out = jnp.zeros_like(v_buf, x.dtype, shape=(n, B, T, K, Ev))

    prefill = runs[0][1].visible is None  # (the masks of every kind agree on that)
    cache = runs[0][4]

    def layer(i, x, weights, k_in, v_in, write_now):  # layer i, with its kind's arguments
        def of_kind(run, x, weights, k_in, v_in):
            return _layer(*run, x, weights, k_in, v_in, reduce, write_now, committed, layer=i)

        if len(runs) == 1:
            return of_kind(runs[0], x, weights, k_in, v_in)
        branches = [functools.partial(of_kind, run) for run in runs]
        return jax.lax.switch(jnp.asarray(kind_of)[i], branches, x, weights, k_in, v_in)

    def step(i, carry):
        x, k_out, v_out = carry
        weights = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), stack.layers)
        if write and (len(runs) == 1 or not prefill):
            return layer(i, x, weights, k_out, v_out, True)
        x, k, v = layer(i, x, weights, k_out if write else k_buf, v_out if write else v_buf, False)
        if write:  # a prefill: its fresh entries written after the switch
            return x, cache.write_keys(k_out, k, True, i), cache.write_values(v_out, v, True, i)
        k_out = jax.lax.dynamic_update_index_in_dim(k_out, k.astype(k_out.dtype), i, 0)
        v_out = jax.lax.dynamic_update_index_in_dim(v_out, v.astype(v_out.dtype), i, 0)
        return x, k_out, v_out

    cuts = sorted({0, n, *(i - first for i in capture if first < i < first + n)})
    carry = (x, k_out, v_out)
    for lo, hi in itertools.pairwise(cuts):
        if first + lo in capture:
            captured[first + lo] = carry[0]
        carry = jax.lax.fori_loop(lo, hi, step, carry)
    return carry


def stack_layers(params: LlamaParams, config: LlamaConfig) -> LlamaParams:
    """`params` with each run of two or more consecutive layers with weights of the same shapes
    and formats (dense and expert layers apart; a quantized weight's bits and group are part of
    its structure, so a GGUF's Q4_K and Q6_K layers stack apart) as one `LayerStack`, whatever
    their windows and rotary bases (`decoder_layers` switches on those per layer). For a program
    that scans layers (the backend's `scans_layers`), called once before its loop: the stacks are
    a copy of the layers' weights, made once per call, not per step."""
    if any(isinstance(element, LayerStack) for element in params.layers):
        return params

    def kind(i):
        shapes = [(w.shape, w.dtype) for w in jax.tree.leaves(params.layers[i])]
        return jax.tree.structure(params.layers[i]), shapes

    elements, i = [], 0
    while i < len(params.layers):
        end = i + 1
        while end < len(params.layers) and kind(end) == kind(i):
            end += 1
        run = params.layers[i:end]
        elements.append(run[0] if len(run) == 1 else LayerStack(jax.tree.map(lambda *w: jnp.stack(w), *run)))
        i = end
    return params.replace(layers=tuple(elements))


def lm_head(params: LlamaParams, hidden: jax.Array, config: LlamaConfig | None = None) -> jax.Array:
    """Logits [..., V] in float32 from final-normed hidden states [..., D]; with `config`, soft-capped
    where its family does that (`final_logit_softcapping`; every caller in the loop passes it).
    The product accumulates in float32 whatever the model's dtype."""
    # As one 2-D product: XLA:CPU ran the 3-D einsum over the [V, D] embedding at half the speed
    # (4.9 against 2.4 ms for one row of SmolLM2's 113 MB head, measured here).
    rows = hidden.reshape(-1, hidden.shape[-1])
    if params.head_panels is not None:  # a copy for the CPU kernel (with_panel_weights)
        logits = backend.active().product_f32(rows, params.head_panels)
    elif params.lm_head is None:
        logits = backend.active().head_product(rows, params.embed)
    else:
        logits = backend.active().product_f32(rows, params.lm_head)
    logits = logits.reshape(*hidden.shape[:-1], logits.shape[-1]).astype(jnp.float32)
    cap = None if config is None else config.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def forward(
    params: LlamaParams,
    config: LlamaConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    fresh_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Logits [B, T, V], hidden states [B, T, D] and the cache after writing the tokens."""
    hidden, cache = forward_hidden(params, config, tokens, positions, cache, fresh_mask)
    return lm_head(params, hidden, config), hidden, cache
