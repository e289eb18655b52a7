"""The decoder transformer of every supported family, as pure functions over a params pytree.

One forward serves Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, Mixtral, Qwen3-MoE, GLM-4.5,
DeepSeek-V3 and gpt-oss: the config (models/config.py) picks each piece, one small function per
concern, each in its own module: the norm (models/norms.py: Llama's, Gemma's or gpt-oss's form;
q/k norms), rotary embeddings (models/rotary.py: per-layer bases, partial rotary, YaRN),
attention (models/attention.py: full or a sliding window, attention sinks; what a pass sees,
models/passes.py) or DeepSeek's latent attention (models/mla.py), and the MLP (models/mlp.py:
SwiGLU, GeGLU, gpt-oss's clamped SwiGLU, or a mixture of experts). This module holds the layer
that composes them, the decoder over its layers, and the LM head. Weights and activations are in
the params' dtype (models/params.py); norm statistics, softmax and logits are float32. Every
product goes through the backend seam (models/products.py), which knows how each weight is
stored and which kernels the platform has.

Einsum letters, used throughout:
    B batch, T new tokens, S cache slots, D hidden, H query heads, K kv heads,
    G query heads per kv head (H = K * G), E head dim, F ffw hidden, V vocab, L layers.

Layers are a tuple, one `LayerParams` (and one cache buffer) per layer, run by a Python loop,
unrolled, on every platform by default: a slice of a stacked weight is copied out of the stack
before it is multiplied, which made decoding steps about twice as slow on the CPU and on a GPU
(the measurements: specjax/kernels/backend.py, `Backend.scans_layers`). Asked for
(`scan_layers=True`), the program stacks each run of layers of one shape once, before its loop
(`stack_layers`, a `LayerStack`), and each pass runs a stack as one `fori_loop` over it, the
cache's buffer for that run stacked alike: the program holds one copy of each kind of layer
whatever the depth.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import mla
from specjax.models.attention import attention
from specjax.models.cache import FreshEntries, KVCache, layers_in
from specjax.models.config import LlamaConfig
from specjax.models.mlp import gated_mlp, moe_mlp
from specjax.models.norms import Norm, apply_norm
from specjax.models.params import LayerParams, LayerStack, LlamaParams
from specjax.models.passes import (
    LayerCache,
    LayerPass,
    PassKind,
    causal_mask,
    layer_masks,
    plan_pass,
    visible_slots,
)
from specjax.models.products import head_logits, project
from specjax.models.rotary import apply_rope, rope_inverse_frequencies


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
    return (apply_norm(config, out[0], params.final_norm), *out[1:])


def decoder_layers(
    layers: tuple[LayerParams | LayerStack, ...],
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
    `visible [B, T, S]` overrides which cache slots each fresh token attends to in a decoding
    pass that writes (default: `visible_slots`; EAGLE's unrolled training loss sets its own).
    Returns x after the last layer (not normed) and the cache, or with `write=False` (a decoding
    pass only) the fresh entries. `first_attention_input`: the first layer's `attention_input`
    (see `_layer`). `capture`: see `forward_hidden` (a third value, the captured streams side by
    side).

    The pass's kind (models/passes.py) follows from `empty_cache` and `write`; the backend's
    kernels for it are asked once, here (`plan_pass`): a decoding pass attends through the kernel
    that reads each row's committed slots where the backend has one (the CPU's, or Pallas on an
    accelerator), not where `visible` says what to attend to, nor in latent attention, which
    reads its cache itself (models/mla.py)."""
    T = x.shape[1]
    if fresh_mask is None:
        fresh_mask = causal_mask(T)
    elif isinstance(fresh_mask, np.ndarray):  # kept on the host: see attention's prefill chunks
        fresh_mask = fresh_mask.astype(bool)
    else:
        fresh_mask = jnp.asarray(fresh_mask, bool)
    if not write and (empty_cache or visible is not None):
        raise ValueError("write=False is for decoding passes over a cache's committed slots")
    if empty_cache and visible is not None:
        raise ValueError("visible: a prefill into an empty cache attends to its fresh tokens alone")
    kind = PassKind.PREFILL if empty_cache else PassKind.WRITE_FIRST if write else PassKind.READ_ONLY
    plan = plan_pass(kind, config.head_dim, x.dtype, kernels=visible is None and not config.kv_lora_rank)
    if kind is PassKind.READ_ONLY:
        visible = jnp.arange(cache.capacity)[None, :] < cache.lengths[:, None]  # [B, S] committed
    elif kind is PassKind.WRITE_FIRST and visible is None:
        visible = visible_slots(cache.lengths, fresh_mask, cache.capacity)
    # Layers of one kind (window, rotary base) share their masks and frequencies: Gemma 3
    # interleaves two kinds, other families have one.
    masks, frequencies = {}, {}
    num_layers = cache.num_layers
    if any(not 0 <= i <= num_layers for i in capture):
        raise ValueError(f"capture: layer ids must be in 0..{num_layers}, got {capture}")

    def layer_pass(i) -> LayerPass:  # the pass as layer i's kind sees it
        window, rope = config.layer_window(i), config.layer_rope(i)
        if window not in masks:
            masks[window] = layer_masks(window, positions, cache, visible, plan)
        if rope not in frequencies:
            frequencies[rope] = rope_inverse_frequencies(config, i)
        return LayerPass(plan, masks[window], frequencies[rope], positions, fresh_mask, cache)

    new_k, new_v, captured = [], [], {}
    first = 0  # the index of the buffer's first layer
    for element, k_buf, v_buf in zip(layers, cache.k, cache.v, strict=True):
        n = layers_in(k_buf)
        if isinstance(element, LayerStack):
            if first == 0 and first_attention_input is not None:
                raise ValueError("first_attention_input: the first layer must not be in a LayerStack")
            # The stack's layers may be of several kinds (Gemma 3's sliding and full layers): the
            # pass as each kind sees it, and each layer's kind.
            keys = [(config.layer_window(first + j), config.layer_rope(first + j)) for j in range(n)]
            distinct = list(dict.fromkeys(keys))
            kinds = tuple(layer_pass(first + keys.index(key)) for key in distinct)
            kind_of = tuple(distinct.index(key) for key in keys)
            with jax.named_scope(f"layers_{first}_to_{first + n - 1}"):
                x, k_out, v_out = _stacked_layers(
                    config, element, x, k_buf, v_buf, kinds, kind_of, reduce, first, capture, captured
                )
        else:
            if first in capture:
                captured[first] = x
            attention_input = first_attention_input if first == 0 else None
            with jax.named_scope(f"layer_{first}"):
                x, k_out, v_out = _layer(
                    config,
                    layer_pass(first),
                    x,
                    element,
                    LayerCache.of(cache, k_buf, v_buf),
                    reduce,
                    attention_input,
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
    config: LlamaConfig,
    stack: LayerStack,
    x: jax.Array,
    k_buf: jax.Array,
    v_buf: jax.Array,
    kinds: tuple[LayerPass, ...],
    kind_of: tuple[int, ...],
    reduce: Callable[[jax.Array], jax.Array] | None,
    first: int,
    capture: tuple[int, ...],
    captured: dict[int, jax.Array],
):
    """The first n layers of `stack` (n: those its cache buffers k_buf, v_buf [n, B*K, ...] hold;
    an early exit may end inside a stack; `first` the id of its first layer), as `fori_loop`s
    over the stacked weights and buffers: one loop, or one per stretch between the layer ids in
    `capture` (the streams entering those layers go into `captured`). `kinds`: the pass as each
    kind of layer in the stack sees it (masks, rotary frequencies); `kind_of[j]`: layer j's.
    Returns x and the written buffers, or in a READ_ONLY pass the fresh entries [n, B, T, K, E].

    Each step takes its layer's slice of the weights (XLA fuses it into the products) and reads
    and writes its layer of the stacked buffers in place; in a READ_ONLY pass the loop carries the
    fresh entries out instead. Layers of several kinds (a window on some, another rotary base)
    run through a `lax.switch` on the layer's kind, one branch per kind, so the loop's body holds
    one copy of the layer per kind whatever the depth. A prefill's switch only computes (its
    attention reads no cache) and the write follows it, so the cache is updated in place; a
    decoding pass that writes (a draft model's own) updates it inside the branches."""
    n = layers_in(k_buf)
    B, T, _ = x.shape
    plan, cache = kinds[0].plan, kinds[0].cache  # (one pass: every kind has the same)
    K, E, Ev = cache.kv_heads(k_buf), k_buf.shape[2], v_buf.shape[3]
    if plan.writes:
        k_out, v_out = k_buf, v_buf
    else:  # zeros "like" the buffers: under shard_map, varying over the same mesh axes
        k_out = jnp.zeros_like(k_buf, x.dtype, shape=(n, B, T, K, E))
        v_out = jnp.zeros_like(v_buf, x.dtype, shape=(n, B, T, K, Ev))
    prefill = plan.kind is PassKind.PREFILL

    def layer(i, x, weights, k_in, v_in, returns_entries=False):  # layer i, as its kind sees the pass
        def of_kind(seen, x, weights, k_in, v_in):
            buffers = LayerCache.of(cache, k_in, v_in, layer=i)
            return _layer(config, seen, x, weights, buffers, reduce, returns_entries=returns_entries)

        if len(kinds) == 1:
            return of_kind(kinds[0], x, weights, k_in, v_in)
        branches = [functools.partial(of_kind, seen) for seen in kinds]
        return jax.lax.switch(jnp.asarray(kind_of)[i], branches, x, weights, k_in, v_in)

    def step(i, carry):
        x, k_out, v_out = carry
        weights = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), stack.layers)
        if plan.writes and (len(kinds) == 1 or not prefill):
            return layer(i, x, weights, k_out, v_out)
        if plan.writes:  # a prefill through a switch: its fresh entries written after it
            x, k, v = layer(i, x, weights, k_out, v_out, returns_entries=True)
            return x, cache.write_keys(k_out, k, True, i), cache.write_values(v_out, v, True, i)
        x, k, v = layer(i, x, weights, k_buf, v_buf)
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


def _layer(
    config: LlamaConfig,
    seen: LayerPass,
    x: jax.Array,
    lp: LayerParams,
    buffers: LayerCache,
    reduce: Callable[[jax.Array], jax.Array] | None = None,
    attention_input: Callable | None = None,
    returns_entries: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decoder layer: x [B, T, D] through its attention and its MLP, in the pass `seen` (its
    plan, and the masks and rotary frequencies of the layer's kind), its cache read and written
    through `buffers`. Returns the new x and the buffers with the fresh keys and values written at
    slots `cache.lengths + t`; in a READ_ONLY pass, or with `returns_entries` (a stack's prefill,
    which writes them itself), the new x and the fresh keys and values [B, T, K, E].

    Head counts come from the weights' shapes, not the config, so that the same code runs on a
    tensor-parallel slice holding K/m whole kv-head groups (H/m query and K/m kv heads); `reduce`
    then sums the partial outputs of o and down over the slices (see specjax/sharding). Norms of
    an output (Gemma's sandwich norms) come after the sum: they need the whole vector.
    `attention_input(x, lp) -> (attention's input, the residual)` replaces the usual (norm of x,
    x): an EAGLE-3 head's first layer reads a token embedding and a feature side by side
    (models/eagle3.py).
    """
    writes = seen.plan.writes and not returns_entries
    with jax.named_scope("attention"):
        x, keys, values = _attention_block(config, seen, x, lp, buffers, reduce, attention_input, writes)
    with jax.named_scope("mlp"):
        x = residual_mlp(config, x, lp, reduce)
    return x, keys, values


def _attention_block(
    config: LlamaConfig,
    seen: LayerPass,
    x: jax.Array,
    lp: LayerParams,
    buffers: LayerCache,
    reduce: Callable[[jax.Array], jax.Array] | None,
    attention_input: Callable | None,
    writes: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] plus the layer's attention of its normed x (see `_layer`), and the buffers
    with the fresh keys and values written (`writes`), or those keys and values [B, T, K, E]."""
    B, T, _ = x.shape
    E, G = config.head_dim, config.num_heads // config.num_kv_heads
    norm = None
    if attention_input is not None:
        h, residual = attention_input(x, lp)
    elif config.kv_lora_rank:
        h, residual = apply_norm(config, x, lp.attn_norm), x
    else:  # the norm goes with qkv's product (`project`)
        h, residual, norm = x, x, Norm.of(config, lp.attn_norm)
    if config.kv_lora_rank:  # DeepSeek's latent attention (models/mla.py)
        out, keys, values = mla.mla_attention(config, seen, h, lp, buffers, writes)
        return residual + (out if reduce is None else reduce(out)), keys, values
    qkv = project(h, lp.qkv, norm=norm)
    if config.qkv_bias:
        qkv = qkv + lp.qkv_bias
    qkv = qkv.reshape(B, T, -1, G + 2, E)  # [B, T, K, G+2, E]: K local kv heads, see fuse_qkv
    K = qkv.shape[2]
    q, k, v = qkv[:, :, :, :G].reshape(B, T, K * G, E), qkv[:, :, :, G], qkv[:, :, :, G + 1]
    if config.qk_norm:
        q, k = apply_norm(config, q, lp.q_norm), apply_norm(config, k, lp.k_norm)
    factor = config.rotary_factor
    q, k = (
        apply_rope(q, seen.positions, seen.inv_freq, factor),
        apply_rope(k, seen.positions, seen.inv_freq, factor),
    )
    if writes:
        buffers = seen.write(buffers, k, v)
    attended = attention(
        q, k, v, buffers, seen.masks, seen.fresh_mask, seen.plan, scale=config.attention_scale, sinks=lp.sinks
    )
    if lp.o_bias is None and lp.attn_out_norm is None:  # the output joins the residual as it is
        x = project(attended, lp.o, residual=residual, reduce=reduce)
    else:
        out = project(attended, lp.o, reduce=reduce)
        if lp.o_bias is not None:  # whole on every device: after the sum of the slices' products
            out = out + lp.o_bias
        x = residual + (out if lp.attn_out_norm is None else apply_norm(config, out, lp.attn_out_norm))
    return (x, buffers.keys, buffers.values) if writes else (x, k, v)


def residual_mlp(
    config: LlamaConfig, x: jax.Array, lp: LayerParams, reduce: Callable[[jax.Array], jax.Array] | None = None
) -> jax.Array:
    """x [B, T, D] plus the layer's MLP (dense or experts) of its normed x."""
    norm = Norm.of(config, lp.mlp_norm)
    if lp.router is None and lp.mlp_out_norm is None:  # the output joins the residual as it is
        return gated_mlp(config, x, lp.gate, lp.up, lp.down, norm=norm, residual=x, reduce=reduce)
    h = norm(x)
    if lp.router is None:
        out = gated_mlp(config, h, lp.gate, lp.up, lp.down, reduce=reduce)
    else:
        out = moe_mlp(config, h, lp, reduce)
    return x + (out if lp.mlp_out_norm is None else apply_norm(config, out, lp.mlp_out_norm))


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
    h = apply_norm(config, x, lp.attn_norm) if attention_input is None else attention_input(x, lp)[0]
    B, T, _ = h.shape
    E, G = config.head_dim, config.num_heads // config.num_kv_heads
    qkv = project(h, lp.qkv)
    if config.qkv_bias:
        qkv = qkv + lp.qkv_bias
    qkv = qkv.reshape(B, T, qkv.shape[-1] // ((G + 2) * E), G + 2, E)  # (no -1: T may be 0)
    k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]
    if config.qk_norm:
        k = apply_norm(config, k, lp.k_norm)
    return apply_rope(k, positions, rope_inverse_frequencies(config, layer), config.rotary_factor), v


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
    logits = head_logits(rows, params)
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
