"""The decoder's params: one `LayerParams` per layer in a `LlamaParams`, their shapes, and the
conversions between the checkpoint layout and the params' own.

Einsum letters: D hidden, H query heads, K kv heads, G query heads per kv head (H = K * G),
E head dim, F ffw hidden, X experts, V vocab.

Projection weights are stored `[in, out]` and applied as `x @ W`. A field a layer's family does
not have is None, so one dataclass serves every family (models/config.py picks which fields a
layer has).

The query, key and value projections are one weight, `qkv`, so that a decoding step makes one
product for them, not three: XLA:CPU runs a [576, 576] product on one core at about 18 GB/s
and the two [576, 192] ones cost nearly as much again, while a [576, 960] product takes both
cores in about the time of the [576, 576] one (three products made a SmolLM2 step 1.5 to 2 ms
slower, 6-9% of it; docs/notes/benchmarks-history.md). Its columns go kv head by kv head: the G
query heads that share kv head j, then key j, then value j (`fuse_qkv`). A tensor-parallel split
of the columns into equal parts then hands each device whole groups, its query heads with their
keys and values.

Checkpoints, and the disk cache of converted GGUF weights, keep the checkpoint layout: flat
tensors one per weight and layer ("layers.3.q", "layers.3.k", ...; a mixture's experts one
tensor [X, ...] per weight and layer), q, k and v apart as HF and GGUF files keep them
(`checkpoint_layer_shapes`). Loading reads them layer by layer and fuses q, k and v as it goes
(models/checkpoint.py); `layer_from_checkpoint` and `layer_to_checkpoint` convert one layer.
Nothing on disk is stacked: a program that runs its layers as a loop stacks them itself
(models/llama.py, `stack_layers`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import PanelWeight
from specjax.kernels.quantized import QuantizedPanelWeight, QuantizedWeight
from specjax.models import mla
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
    The decoder runs a stack as one loop over its layers (models/llama.py, `decoder_layers`), so
    a program holds one copy of each kind of layer however deep the model. Made inside the
    program (`stack_layers`) where the backend scans layers (`scan_layers=True`, on any platform;
    layers are unrolled by default everywhere), never stored: loading, checkpoints and training
    keep one LayerParams per layer."""

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
    # for a quantized head); set only by specjax.kernels.layouts.with_panel_weights, for decoding
    # on the CPU.
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


def checkpoint_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's flat name -> shape in the checkpoint layout ("embed", "layers.3.q", ...,
    "final_norm", "lm_head" unless tied): the table a checkpoint for `config` must fill exactly."""
    shapes = {"embed": (config.vocab_size, config.hidden_size)}
    for i in range(config.num_layers):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in checkpoint_layer_shapes(config, i).items()}
    shapes["final_norm"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    return shapes


def layers_bytes(config: LlamaConfig, itemsize: int) -> int:
    """Bytes the decoder layers' weights take (the size of their stacked copy: models/llama.py,
    `stack_layers`)."""
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
    shapes = checkpoint_shapes(config)
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
