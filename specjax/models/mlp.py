"""A layer's MLP: a gated MLP (SwiGLU, GeGLU, gpt-oss's clamped SwiGLU) or a mixture of experts
(`route`: softmax or sigmoid scores, expert groups, shared experts, gpt-oss's biases).

Einsum letters: B batch, T new tokens, N tokens (B * T), D hidden, F ffw hidden, X experts,
k experts per token.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from specjax.kernels import backend
from specjax.kernels.quantized import QuantizedWeight
from specjax.models.config import LlamaConfig
from specjax.models.norms import Norm
from specjax.models.params import LayerParams
from specjax.models.products import gated_projections, project
from specjax.models.quantized import as_array


def _gated(config: LlamaConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated MLP's hidden activations from its gate and up projections [..., F]."""
    if config.hidden_act == "clamped_swiglu":  # gpt-oss
        limit = config.swiglu_limit
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return gate * jax.nn.sigmoid(config.swiglu_alpha * gate) * (up + 1)
    if config.hidden_act == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    return jax.nn.silu(gate) * up


def gated_mlp(
    config: LlamaConfig,
    x: jax.Array,
    gate,
    up,
    down,
    norm: Norm | None = None,
    residual: jax.Array | None = None,
    reduce: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """residual + reduce(down(act(norm(x) @ gate) * (norm(x) @ up))) over x [..., D]: a layer's
    dense MLP, or an MoE layer's shared experts. `norm`, `residual` and `reduce` (each optional:
    the tensor-parallel sum of the slices' outputs) as `products.project` takes them."""
    gate_out, up_out = gated_projections(x, gate, up, norm)
    return project(_gated(config, gate_out, up_out), down, residual=residual, reduce=reduce)


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
        out = out + gated_mlp(config, x, lp.shared_gate, lp.shared_up, lp.shared_down)
    if reduce is not None:
        out = reduce(out)
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
