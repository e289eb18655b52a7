"""IBM's MLP speculator: a chain of k drafts from the target's last hidden state (models/mlp_speculator.py).

The state is Medusa's: per row, the target's final-normed hidden state at the token before the
last committed one, the state that token was predicted from (vLLM feeds the speculator the same,
its `previous_hidden_states`, with the last sampled token). Stage i reads the state and the token
before it (the last committed token, then each draft) and drafts the next token: its argmax for
greedy rows, a draw from its logits adjusted and warped exactly as the target's are for sampled
rows, with `draft_probs` that distribution, as a draft model drafts (proposers/draft.py). Rejection
sampling then keeps the output lossless at any temperature.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.models.mlp_speculator import (
    MLPSpeculatorConfig,
    MLPSpeculatorHead,
    MLPSpeculatorParams,
    first_state,
    mlp_stage,
    mlp_stage_logits,
)
from specjax.models.model import Model
from specjax.speculate.proposers.base import (
    FromLastHidden,
    LastHiddenState,
    Proposal,
    check_k,
    choose_draft,
    draft_keys,
)
from specjax.speculate.proposers.protocol import ProposeContext, Proposer
from specjax.speculate.sampling import WarpSpec


@dataclasses.dataclass(frozen=True)
class MLPSpeculatorSpec(FromLastHidden):
    """The static part of an MLP speculator proposer: its config, k and the target's warping."""

    config: MLPSpeculatorConfig
    k: int
    hidden_size: int
    warp: WarpSpec = WarpSpec()
    max_accepted: int | None = None  # more than k beside a longer drafter (`accepting`)

    def propose(self, ctx: ProposeContext, state: LastHiddenState):
        params, tokens, lengths, sampling, history = (
            ctx.params,
            ctx.tokens,
            ctx.lengths,
            ctx.sampling,
            ctx.history,
        )
        B = tokens.shape[0]
        token = tokens[jnp.arange(B), lengths - 1]  # [B]: the last committed token
        mlp_state = first_state(self.config, state.hidden)
        counts = None if history is None else history.counts
        states = ctx.grammar_states
        drafts, probs = [], []
        for i, step_keys in enumerate(draft_keys(ctx.keys, self.k)):  # k <= n_predict stages, unrolled
            mlp_state = mlp_stage(params, self.config, i, mlp_state, token)
            logits = mlp_stage_logits(params, self.config, i, mlp_state)  # [B, V]
            token, token_probs, counts, states = choose_draft(
                step_keys, logits, sampling, self.warp, history, counts, states
            )
            drafts.append(token)
            probs.append(token_probs)
        draft = jnp.stack(drafts, axis=1)  # [B, K]
        draft_probs = None if probs[0] is None else jnp.stack(probs, axis=1)  # [B, K, V]
        proposal = Proposal(draft_tokens=draft, valid=jnp.ones(draft.shape, bool), draft_probs=draft_probs)
        return proposal, state


@dataclasses.dataclass(frozen=True, eq=False)
class MLPSpeculator(Proposer):
    """IBM's MLP speculator (`specjax.models.MLPSpeculatorHead`: read with `specjax.load_head`,
    trained with `specjax.train.train_mlp_speculator`) drafting a chain of k tokens, one per stage:
    k defaults to the head's n_predict and may not exceed it."""

    head: MLPSpeculatorHead
    k: int | None = None

    def __post_init__(self):
        if not isinstance(self.head, MLPSpeculatorHead):
            raise ValueError(
                "MLPSpeculator head must be a specjax.models.MLPSpeculatorHead (see specjax.load_head), "
                f"got {type(self.head).__name__}"
            )
        n_predict = self.head.config.n_predict
        k = n_predict if self.k is None else self.k
        check_k("MLPSpeculator", k)
        if k > n_predict:
            raise ValueError(
                f"MLPSpeculator k={k} exceeds the head's n_predict={n_predict} (one draft per stage): "
                f"give k in 1..{n_predict}"
            )
        object.__setattr__(self, "k", k)

    def with_k(self, k: int) -> MLPSpeculator:
        return dataclasses.replace(self, k=k)  # (at most n_predict)

    def trained_heads(self) -> tuple:
        return (self.head,)

    def spec(self, target: Model, warp: WarpSpec | None = None, mesh=None) -> MLPSpeculatorSpec:
        self.head.check_target(target)
        return MLPSpeculatorSpec(self.head.config, self.k, target.config.hidden_size, warp or WarpSpec())

    def params(self, target: Model) -> MLPSpeculatorParams:
        return self.head.params
