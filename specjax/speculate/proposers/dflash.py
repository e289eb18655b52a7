"""DFlash: a whole block of drafts from one forward pass of a small head (models/dflash.py).

State per row: the head's KV cache of context entries (the target's fused features projected
to each layer's keys and values, one per committed position but the last) and the target
features that have not been projected yet ("pending"), exactly as EAGLE keeps them:

- after the prefill, the prompt's positions are in the context and nothing is pending;
- after a step that accepted n drafts, the target's features at the last token and the accepted
  drafts (n + 1 of them) are pending.

`propose` projects the pending features into the context (one pass of each layer's k and v
projections), then runs the block [the last committed token, mask tokens] at the next positions
through the head once; slots 1 .. block - 1 give the drafts (argmax: deterministic, so lossless
at any temperature), verified as a chain.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_int
from specjax.models.cache import KVCache, cache_bytes, init_cache
from specjax.models.config import LlamaConfig
from specjax.models.dflash import (
    DFlashConfig,
    DFlashHead,
    dflash_block,
    dflash_context,
    dflash_logits,
    dflash_panel_weights,
)
from specjax.models.model import Model
from specjax.speculate.grammar import mask_draft_logits
from specjax.speculate.proposers.base import MAX_SPECULATIVE_TOKENS, HeadInputs, Proposal, kept_inputs
from specjax.speculate.proposers.protocol import (
    Capabilities,
    InitContext,
    ProposeContext,
    Proposer,
    ProposerSpec,
    UpdateContext,
)


@flax.struct.dataclass
class DFlashState:
    cache: KVCache  # the head's context entries, one per layer
    pending: jax.Array  # [B, accepts+1, A] target features not yet projected into the context
    num_pending: jax.Array  # [B] int32


@dataclasses.dataclass(frozen=True)
class DFlashSpec(ProposerSpec):
    config: DFlashConfig
    block: int  # the anchor and block - 1 drafts
    target_config: LlamaConfig  # for reading tokens through the target's head
    dtype: str = "float32"
    max_accepted: int | None = None  # more than k when paired with a longer drafter (`accepting`)

    @property
    def k(self) -> int:
        return self.block - 1

    @property
    def capabilities(self) -> Capabilities:
        # Its pending features hold `accepts` + 1 of the target's: more than k as a Hybrid part
        # beside a longer drafter.
        return Capabilities(
            target_features=self.config.aux_layer_ids, catches_up=True, accepts=self.max_accepted
        )

    def accepting(self, K: int) -> DFlashSpec:
        """This spec, catching up on up to K accepted drafts a step (K >= k)."""
        return self if K <= self.accepts else dataclasses.replace(self, max_accepted=K)

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        pending = batch_size * (self.accepts + 1) * self.config.feature_size * 4
        return cache_bytes(self.config.layer_config, batch_size, capacity, itemsize) + pending

    def init(self, ctx: InitContext) -> DFlashState:
        """Project the prompt's features into the context: positions 0 .. L - 2 once the first
        token is committed (the padding past each prompt is written too, stale and masked)."""
        params, prompt_tokens, prompt_lengths = ctx.params, ctx.prompt_tokens, ctx.prompt_lengths
        capacity, target_features = ctx.capacity, ctx.target_features
        B, T = prompt_tokens.shape
        cache = init_cache(self.config.layer_config, B, capacity, self.dtype)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        cache = dflash_context(params.head, self.config, target_features, positions, cache)
        pending = jnp.zeros((B, self.accepts + 1, target_features.shape[-1]), target_features.dtype)
        return DFlashState(cache.replace(lengths=prompt_lengths), pending, jnp.zeros((B,), jnp.int32))

    def with_panel_weights(self, params: HeadInputs) -> HeadInputs:
        """The params for drafting on the CPU: the head's weights as panels (specjax.kernels,
        float32 only)."""
        if self.dtype != "float32":
            return params
        return params.replace(head=dflash_panel_weights(params.head))

    def update(self, ctx: UpdateContext, state: DFlashState) -> DFlashState:
        pending = ctx.path_features.astype(state.pending.dtype)
        return state.replace(pending=pending, num_pending=ctx.num_accepted + 1)

    def _catch_up(self, params: HeadInputs, state: DFlashState, lengths):
        """The context cache with the pending features projected in: positions 0 .. L - 2."""
        start = lengths - 1 - state.num_pending  # the first pending feature's position
        positions = start[:, None] + jnp.arange(self.accepts + 1)[None, :]
        cache = dflash_context(
            params.head, self.config, state.pending, positions, state.cache.replace(lengths=start)
        )
        return cache.advance(state.num_pending)

    def observe(self, ctx: ProposeContext, state: DFlashState) -> DFlashState:
        """A step it does not draft (Hybrid's gate held it back): only the catch-up."""
        return state.replace(cache=self._catch_up(ctx.params, state, ctx.lengths))

    def propose(self, ctx: ProposeContext, state: DFlashState):
        target_params, params, tokens, lengths = ctx.target_params, ctx.params, ctx.tokens, ctx.lengths
        B = tokens.shape[0]
        rows = jnp.arange(B)
        cache = self._catch_up(params, state, lengths)
        block = jnp.full((B, self.block), self.config.mask_token_id, jnp.int32)
        block = block.at[:, 0].set(tokens[rows, lengths - 1])
        block_positions = (lengths - 1)[:, None] + jnp.arange(self.block)[None, :]
        outputs = dflash_block(params.head, self.config, target_params.embed, block, block_positions, cache)
        logits = dflash_logits(params.head, self.config, target_params, outputs[:, 1:], self.target_config)
        if ctx.grammar_states is None:
            draft = params.vocab[jnp.argmax(logits, axis=-1)].astype(jnp.int32)  # [B, k]
        else:  # slot by slot, each masked by the automaton's state after the drafts before it
            grammar, states, drafts = ctx.sampling.grammar, ctx.grammar_states, []
            for i in range(self.k):  # k small and static
                masked = mask_draft_logits(grammar, logits[:, i], states, params.vocab)
                drafts.append(params.vocab[jnp.argmax(masked, axis=-1)].astype(jnp.int32))
                states = grammar.step(states, drafts[-1], self.target_config.vocab_size)
            draft = jnp.stack(drafts, axis=1)
        proposal = Proposal(draft_tokens=draft, valid=jnp.ones(draft.shape, bool))
        return proposal, state.replace(cache=cache)


@dataclasses.dataclass(frozen=True, eq=False)
class DFlash(Proposer):
    """A DFlash head (specjax.models.DFlashHead: trained here or read with specjax.load_head)
    drafting `block - 1` tokens per step from one forward pass (default: the head's own block
    size), verified as a chain."""

    head: DFlashHead
    block: int | None = None

    def __post_init__(self):
        if not isinstance(self.head, DFlashHead):
            raise ValueError(
                f"DFlash head must be a specjax.models.DFlashHead (see specjax.load_head), got "
                f"{type(self.head).__name__}"
            )
        block = self.head.config.block_size if self.block is None else self.block
        if not is_int(block) or not 2 <= block <= MAX_SPECULATIVE_TOKENS + 1:
            raise ValueError(
                f"DFlash block must be an integer in 2..{MAX_SPECULATIVE_TOKENS + 1} (the anchor and "
                f"block - 1 drafts), got {block!r}"
            )
        object.__setattr__(self, "block", block)

    @property
    def k(self) -> int:
        return self.block - 1

    def with_k(self, k: int) -> DFlash:
        return DFlash(self.head, block=k + 1)  # the anchor and k drafts

    def trained_heads(self) -> tuple:
        return (self.head,)

    def spec(self, target: Model, warp=None, mesh=None) -> DFlashSpec:
        self.head.check_target(target)
        dtype = self.head.params.fc.dtype.name
        return DFlashSpec(config=self.head.config, block=self.block, target_config=target.config, dtype=dtype)

    def params(self, target: Model) -> HeadInputs:
        def build(target):
            return HeadInputs(head=self.head.params, head_matrix=None, vocab=jnp.asarray(self.head.vocab))

        return kept_inputs(self, target, build)
