"""Drafting with a model: a separate small model (DraftModel) or the target's first layers
(SelfDraft, early exit), each with its own KV cache.

Cache bookkeeping: at every propose, row b's draft cache is trusted up to slot L - 2 (L the
sequence length), and the first draft pass feeds the last two tokens. Slot L - 2 is then
rewritten with the same token, which costs one extra token of work but means the draft never
needs a separate catch-up pass: after a full acceptance the last draft token, never fed to the
draft, is simply the second-to-last token of the next step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import check_int
from specjax.kernels.layouts import with_panel_weights
from specjax.models.cache import KVCache, cache_bytes, init_cache, starting_from
from specjax.models.config import LlamaConfig
from specjax.models.llama import lm_head, stack_layers
from specjax.models.model import Model
from specjax.sharding import (
    check_model_split,
    mesh_dense,
    mesh_entries_by_row,
    mesh_forward_hidden,
    shard_params,
)
from specjax.speculate.proposers.base import Proposal, check_k, choose_draft, draft_keys
from specjax.speculate.proposers.protocol import (
    Capabilities,
    InitContext,
    ProposeContext,
    Proposer,
    ProposerSpec,
    UpdateContext,
)
from specjax.speculate.sampling import WarpSpec


@flax.struct.dataclass
class DraftState:
    cache: KVCache


@dataclasses.dataclass(frozen=True)
class DraftSpec(ProposerSpec):
    """The static, hashable part of a model-based proposer."""

    config: LlamaConfig  # the draft's config (for SelfDraft: the target's)
    k: int
    num_layers: int  # layers the draft runs (SelfDraft: an early exit)
    shares_target_params: bool
    warp: WarpSpec = WarpSpec()
    mesh: Any = None  # a jax Mesh to run on, or None (one device)
    tensor_parallel: bool = False  # heads split over the mesh like the target's; else replicated
    dtype: str = "float32"  # the draft's weights, which its KV cache follows
    prompt_from_target: bool = False  # the draft's cache starts as the target's over the prompt

    @property
    def capabilities(self) -> Capabilities:
        # Every row drafts k tokens every step; the cache holds the draft's own drafts.
        return Capabilities(narrows=True, caches_own_drafts=True, reads_target_cache=self.prompt_from_target)

    def narrowed(self, k: int) -> DraftSpec:
        return dataclasses.replace(self, k=k)

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        """Device memory of the state (the draft's KV cache), to check before allocating."""
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        return cache_bytes(self.config, batch_size, capacity, itemsize, num_layers=self.num_layers)

    def _forward(self, params, tokens, positions, cache, empty_cache=False):
        return mesh_forward_hidden(
            self.mesh, params, self.config, tokens, positions, cache, empty_cache, self.tensor_parallel
        )

    def init(self, ctx: InitContext) -> DraftState:
        params = ctx.target_params if self.shares_target_params else ctx.params
        B, T = ctx.prompt_tokens.shape
        cache = init_cache(
            self.config, B, ctx.capacity, self.dtype, num_layers=self.num_layers, like=params.layers
        )
        if self.prompt_from_target:  # no prefill of its own: the target's keys and values
            target_cache = mesh_dense(self.mesh, ctx.target_cache)  # (its own cache is dense, per row)
            if not self.tensor_parallel:  # split by row alone, where the target's is by head too
                target_cache = mesh_entries_by_row(self.mesh, target_cache)
            return DraftState(cache=starting_from(cache, target_cache))
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        _, cache = self._forward(params, ctx.prompt_tokens, positions, cache, empty_cache=True)
        return DraftState(cache=cache.advance(ctx.prompt_lengths))

    def update(self, ctx: UpdateContext, state: DraftState) -> DraftState:
        return state  # the draft catches up inside propose (see the module docstring)

    def place_params(self, params, mesh):
        """A draft model's own weights placed on `mesh`: split like the target's where it runs
        tensor-parallel, else replicated (a SelfDraft has none of its own: None)."""
        if params is None:
            return None
        return shard_params(params, self.config, mesh, self.tensor_parallel)

    def with_panel_weights(self, params):
        """A draft model's own weights as panels for the CPU kernels, which compute in float32 (a
        draft of another dtype keeps XLA's products; a SelfDraft has no params of its own)."""
        return with_panel_weights(params) if self.dtype == "float32" else params

    def stack_layers(self, params):
        """A draft model's own params with its layers stacked, for a program that scans layers
        (a SelfDraft runs the target's, which the loop stacks)."""
        return params if self.shares_target_params else stack_layers(params, self.config)

    def propose(self, ctx: ProposeContext, state: DraftState):
        """Draft k tokens per row, each drawn from the draft's logits adjusted and warped exactly as
        the target's are (bias, penalties with the counts as they would stand after the drafts so
        far, the rows' constraints along the drafts, temperature and filters); draft_probs is that
        distribution (None if every row is greedy)."""
        params = ctx.target_params if self.shares_target_params else ctx.params
        tokens, lengths, sampling, history = ctx.tokens, ctx.lengths, ctx.sampling, ctx.history
        B = tokens.shape[0]
        rows = jnp.arange(B)[:, None]
        cache = state.cache.replace(lengths=lengths - 2)

        def draft_one(cache, counts, states, fed, fed_positions, step_keys):
            hidden, cache = self._forward(params, fed, fed_positions, cache)
            logits = lm_head(params, hidden[:, -1], self.config)  # [B, V]
            cache = cache.advance(jnp.full((B,), fed.shape[1], jnp.int32))
            token, probs, counts, states = choose_draft(
                step_keys, logits, sampling, self.warp, history, counts, states
            )
            return cache, counts, states, token, probs

        keys = draft_keys(ctx.keys, self.k)  # [K, B]
        counts = None if history is None else history.counts
        first_positions = lengths[:, None] - 2 + jnp.arange(2)[None, :]  # [B, 2]
        cache, counts, states, token, probs = draft_one(
            cache, counts, ctx.grammar_states, tokens[rows, first_positions], first_positions, keys[0]
        )

        def later(carry, step_keys):
            cache, counts, states, token, position = carry
            cache, counts, states, next_token, probs = draft_one(
                cache, counts, states, token[:, None], position[:, None], step_keys
            )
            return (cache, counts, states, next_token, position + 1), (next_token, probs)

        carry = (cache, counts, states, token, lengths)
        (cache, _, _, _, _), (rest, rest_probs) = jax.lax.scan(later, carry, keys[1:])
        draft = jnp.concatenate([token[:, None], rest.T], axis=1)  # [B, K]
        draft_probs = None
        if probs is not None:
            draft_probs = jnp.concatenate([probs[:, None], jnp.moveaxis(rest_probs, 0, 1)], axis=1)
        proposal = Proposal(draft_tokens=draft, valid=jnp.ones(draft.shape, bool), draft_probs=draft_probs)
        return proposal, DraftState(cache=cache)


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel(Proposer):
    """Draft with a separate model that shares the target's vocabulary.

    On a mesh the draft is placed independently of the target: replicated by default (every
    device holds it whole and drafts its rows with no communication, the better choice for a
    draft small enough to be latency-bound), or with `tensor_parallel=True` split over the
    mesh's model axis like the target (its heads and ffw size must divide the model degree).

    `prompt_from_target=True` is for a draft with the target's config, above all a quantized copy
    of the target (`DraftModel(specjax.load(source, quantization="int8"), prompt_from_target=True)`):
    its KV cache starts as the target's keys and values over the prompt instead of a prefill of
    its own, which would cost about what the target's does (a quantized prefill computes in float
    too). Its drafts then attend to keys and values that its own weights would have made only
    approximately: that may change what it proposes, never what is generated.
    """

    model: Model
    k: int = 4
    tensor_parallel: bool = False
    prompt_from_target: bool = False

    def __post_init__(self):
        if not isinstance(self.model, Model):
            raise ValueError(f"DraftModel model must be a specjax.Model, got {type(self.model).__name__}")
        check_k("DraftModel", self.k)
        if not isinstance(self.tensor_parallel, bool):
            raise ValueError(f"DraftModel tensor_parallel must be a bool, got {self.tensor_parallel!r}")
        if not isinstance(self.prompt_from_target, bool):
            raise ValueError(f"DraftModel prompt_from_target must be a bool, got {self.prompt_from_target!r}")

    def spec(self, target: Model, warp: WarpSpec, mesh=None) -> DraftSpec:
        check_same_vocabulary(target, self.model)
        if self.prompt_from_target and self.model.config != target.config:
            pairs = [
                (field.name, getattr(self.model.config, field.name), getattr(target.config, field.name))
                for field in dataclasses.fields(target.config)
            ]
            differ = [
                f"{name} {ours!r} (target {theirs!r})" for name, ours, theirs in pairs if ours != theirs
            ]
            raise ValueError(
                "DraftModel prompt_from_target=True needs a draft with the target's config (a "
                f"quantized copy of it, say); the draft's differs: {', '.join(differ)}"
            )
        if mesh is not None and self.tensor_parallel:
            check_model_split(mesh, self.model.config, who="DraftModel(tensor_parallel=True) draft")
        return DraftSpec(
            config=self.model.config,
            k=self.k,
            num_layers=self.model.config.num_layers,
            shares_target_params=False,
            warp=warp,
            mesh=mesh,
            tensor_parallel=self.tensor_parallel,
            dtype=self.model.params.dtype.name,
            prompt_from_target=self.prompt_from_target,
        )

    def params(self, target: Model):
        return self.model.params

    def with_k(self, k: int) -> DraftModel:
        return dataclasses.replace(self, k=k)


@dataclasses.dataclass(frozen=True)
class SelfDraft(Proposer):
    """Early-exit self-drafting: the target's first `layers` layers, its final norm and its head.
    Its cache starts as those layers' part of the target's over the prompt (no prefill of its own)."""

    layers: int = 8
    k: int = 4

    def __post_init__(self):
        check_k("SelfDraft", self.k)
        check_int("SelfDraft layers", self.layers, 1)

    def spec(self, target: Model, warp: WarpSpec, mesh=None) -> DraftSpec:
        if not 1 <= self.layers <= target.config.num_layers - 1:
            raise ValueError(
                f"SelfDraft layers must be in 1..{target.config.num_layers - 1} for a target of "
                f"{target.config.num_layers} layers, got {self.layers}"
            )
        return DraftSpec(
            config=target.config,
            k=self.k,
            num_layers=self.layers,
            shares_target_params=True,
            warp=warp,
            mesh=mesh,
            tensor_parallel=True,  # the target's weights, split as they are
            dtype=target.params.dtype.name,
            # Its layers are the target's first ones: the target's keys and values over the prompt
            # are what a prefill of its own would compute.
            prompt_from_target=True,
        )

    def with_k(self, k: int) -> SelfDraft:
        return dataclasses.replace(self, k=k)


def check_same_vocabulary(target: Model, draft: Model) -> None:
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"DraftModel model has vocab_size {draft.config.vocab_size}, the target "
            f"{target.config.vocab_size}: a draft must share the target's vocabulary"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise ValueError("DraftModel model's tokenizer differs from the target's: a draft must share it")
