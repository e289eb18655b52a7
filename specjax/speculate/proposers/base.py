"""What every proposer returns, and the checks all proposers share."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.sharding import replicate
from specjax.speculate.sampling import adjust_logits, choose_tokens

MAX_SPECULATIVE_TOKENS = 16  # k above this buys nothing measurable and bloats the verify pass


@flax.struct.dataclass
class Proposal:
    """Up to K draft tokens per row.

    draft_probs is the exact (warped) distribution each draft token was drawn from, or None for a
    deterministic proposer (its q is one-hot on the draft token). valid is a prefix mask: a row
    may draft fewer than K tokens, or none.
    """

    draft_tokens: jax.Array  # [B, K] int32
    valid: jax.Array  # [B, K] bool
    draft_probs: jax.Array | None = None  # [B, K, V] float32


def check_k(owner: str, k) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{owner} k must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")


class Stateless:
    """Defaults for a proposer spec that keeps no state of its own (NGram, or a researcher's own
    rule over the tokens): no memory, nothing to set up after the prefill, nothing to catch up on.
    A subclass supplies `k`, `always_drafts` and `propose` (see proposers/__init__.py)."""

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        return 0

    def init(self, target_params, params, prompt_tokens, prompt_lengths, capacity, target_hidden):
        return None

    def update(self, state, path_hidden, num_accepted):
        return state

    def observe(self, target_params, params, state, tokens, lengths):
        return state


@flax.struct.dataclass
class LastHiddenState:
    hidden: jax.Array  # [B, D] the target's final-normed hidden state the last token came from


class FromLastHidden:
    """Defaults for a proposer spec that drafts from one hidden state per row (Medusa, the MLP
    speculator): the target's, at the token before the last committed one (the state the last
    token was predicted from). A subclass supplies `hidden_size`, `k` and `propose`."""

    hidden_size: int

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        return batch_size * self.hidden_size * 4

    def init(self, target_params, params, prompt_tokens, prompt_lengths, capacity, target_hidden):
        rows = jnp.arange(prompt_tokens.shape[0])
        return LastHiddenState(hidden=target_hidden[rows, prompt_lengths - 1])

    def update(self, state: LastHiddenState, path_hidden, num_accepted) -> LastHiddenState:
        rows = jnp.arange(path_hidden.shape[0])
        return LastHiddenState(hidden=path_hidden[rows, num_accepted])

    def accepting(self, K: int):
        """Itself: `update` takes the hidden state after any number of accepted drafts."""
        return self

    def observe(self, target_params, params, state: LastHiddenState, tokens, lengths) -> LastHiddenState:
        return state  # nothing to catch up on: `update` keeps the one hidden state it drafts from


def draft_distribution(proposal: Proposal, vocab_size: int) -> jax.Array:
    """q of each draft [B, K, V]: its own, or one-hot for a deterministic proposer."""
    if proposal.draft_probs is not None:
        return proposal.draft_probs.astype(jnp.float32)
    return jax.nn.one_hot(proposal.draft_tokens, vocab_size, dtype=jnp.float32)


def init_state(
    spec, target_params, params, prompt_tokens, prompt_lengths, capacity, target_hidden, target_cache
):
    """`spec.init(...)`, handed the target's cache after the prompt (`target_cache=`) where the spec
    reads it (`reads_target_cache`: a draft that starts from the target's keys and values instead
    of running the prompt itself); other specs, a researcher's own among them, keep the six
    arguments of the protocol (proposers/__init__.py)."""
    args = (target_params, params, prompt_tokens, prompt_lengths, capacity, target_hidden)
    if getattr(spec, "reads_target_cache", False):
        return spec.init(*args, target_cache=target_cache)
    return spec.init(*args)


def draft_keys(keys: jax.Array, k: int) -> jax.Array:
    """One key per row [B] -> one per draft position and row [k, B]."""
    return jnp.swapaxes(jax.vmap(lambda key: jax.random.split(key, k))(keys), 0, 1)


def choose_draft(keys, logits, sampling, warp, history, counts):
    """One draft token per row from a drafter's logits [B, V], adjusted and warped exactly as the
    target's are (bias, penalties with `counts` [B, V] as they would stand after the drafts so
    far, temperature and filters). Returns (tokens [B], probs [B, V]: the distribution each was
    drawn from, None when every row is greedy, counts with the tokens added)."""
    if history is not None:
        logits = adjust_logits(logits, sampling, warp, counts, history.in_prompt)
    else:
        logits = adjust_logits(logits, sampling, warp)
    token, probs = choose_tokens(keys, logits, sampling, warp)
    if history is not None:
        counts = counts.at[jnp.arange(token.shape[0]), token].add(1)
    return token, probs, counts


class Wrapper:
    """Defaults for a proposer spec that wraps another one, `inner` (ForcedSpec, DynamicSpec):
    everything it does not change is the inner spec's."""

    inner: Any

    @property
    def k(self) -> int:
        return self.inner.k

    @property
    def tree(self):
        return getattr(self.inner, "tree", None)

    @property
    def always_drafts(self) -> bool:
        return self.inner.always_drafts

    @property
    def feature_layers(self):
        return getattr(self.inner, "feature_layers", None)

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        return self.inner.state_bytes(batch_size, capacity)

    @property
    def reads_target_cache(self) -> bool:
        return getattr(self.inner, "reads_target_cache", False)

    def init(self, *args, **target_cache):
        return self.inner.init(*args, **target_cache)

    def propose(self, *args):
        return self.inner.propose(*args)

    def update(self, state, path_hidden, num_accepted):
        return self.inner.update(state, path_hidden, num_accepted)

    def with_panel_weights(self, params):
        """The inner spec's params for drafting on the CPU (a trained head's panels), if it has any."""
        packing = getattr(self.inner, "with_panel_weights", None)
        return params if packing is None else packing(params)

    def place_params(self, params, mesh):
        """The inner spec's params placed on `mesh` as it asks (a draft model's), else replicated."""
        placing = getattr(self.inner, "place_params", None)
        return replicate(params, mesh) if placing is None else placing(params, mesh)

    def stack_layers(self, params):
        """The inner spec's params with a draft model's layers stacked (see DraftSpec), if it has any."""
        stacking = getattr(self.inner, "stack_layers", None)
        return params if stacking is None else stacking(params)


def kept_inputs(owner, target, build: Callable[[Any], Any]):
    """`build(target)`, kept on `owner` (a user-facing proposer object) while `target.params`
    lives: every call with the same model gets the same params object, so that the gather of a
    draft vocabulary's head columns runs once and the CPU panel copy made for that object
    (api._with_panels) is found again."""
    kept = owner.__dict__.get("_kept_inputs")
    if kept is not None and kept[0]() is target.params:
        return kept[1]
    inputs = build(target)
    object.__setattr__(owner, "_kept_inputs", (weakref.ref(target.params), inputs))
    return inputs


@flax.struct.dataclass
class HeadInputs:
    """The params of a trained-head proposer (Medusa, EAGLE): the head's own, and the target's LM
    head restricted to the head's draft vocabulary (models/draft_vocab.py), gathered once per call."""

    head: Any  # MedusaParams or EagleParams
    head_matrix: jax.Array  # [D, W]
    vocab: jax.Array  # [W] int32: draft-vocabulary index -> token id
