"""MTP: draft with the target's own multi-token-prediction layers (models/mtp.py).

An MTP layer is an EAGLE head that shipped with the target: its input at position t is a hidden
state fused with the embedding of the token that followed, its output (post-norm) is read by the
target's LM head and fed back as the next step's hidden state. So it drafts with EAGLE's
machinery (proposers/eagle.py): its own KV cache, caught up inside the loop on the target's
final-normed hidden states at the accepted positions ("pending", as EAGLE keeps them), and token
trees from the top candidates (one layer). Only the layers, the logits and the chain differ.

Several layers (DeepSeek-V3 trains one, but `num_nextn_predict_layers` may be more): draft step i
runs layer i mod n, fed the previous step's post-norm output and its drafted token, as vLLM and
SGLang do. Layer j > 0 reads layer j - 1's outputs one position on, as transformers' MtpModel
chains them: its pair q is (g^{j-1}_q, x_{q+1+j}), g^{-1} the target's hidden states. Each layer
keeps its own one-layer KV cache of the pairs whose tokens are committed (layer j holds pairs
0 .. L-2-j with L tokens committed). A step feeds layer j one block: the c pending pairs it can
now commit (c - 1 accepted drafts and the bonus token: the first one's input is layer j - 1's
output at its last committed pair of the step before, kept in `carried`), then the j pairs holding
the drafts d_0 .. d_{j-1}, past its committed length (scratch, like EAGLE's tree nodes); d_j is
read from the last. Steps i >= n feed layer i mod n one pair each, after its scratch. So with
k <= n every draft equals transformers' MtpModel's on the same context, and with one layer the
chain is EAGLE's.

Chains are greedy, or at temperature > 0 sampled from the MTP logits adjusted and warped exactly
as the target's are (q is that distribution: lossless by rejection sampling); trees draft the top
candidates (q one-hot, lossless at any temperature).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_int
from specjax.models.cache import KVCache, cache_bytes, init_cache
from specjax.models.llama import lm_head
from specjax.models.model import Model
from specjax.models.mtp import MTPConfig, MTPLayerParams, missing_mtp_error, mtp_features, mtp_layer_config
from specjax.models.params import LlamaParams
from specjax.speculate.proposers.base import HeadInputs, Proposal, choose_draft, draft_keys, kept_inputs
from specjax.speculate.proposers.eagle import EagleSpec, EagleState, HeadProposer, settle_drafting
from specjax.speculate.proposers.protocol import InitContext, ProposeContext
from specjax.speculate.sampling import WarpSpec
from specjax.speculate.tree import TokenTree


@flax.struct.dataclass
class MTPHead:
    layers: tuple[MTPLayerParams, ...]  # in drafting order
    target: (
        LlamaParams  # the target's embedding, final norm and LM head (no layers): its head reads the drafts
    )


@flax.struct.dataclass
class MTPState(EagleState):
    """EAGLE's state (`cache` is layer 0's) and the later layers' own."""

    later: tuple[KVCache, ...] = ()  # layers 1 .. n-1, one layer each
    carried: jax.Array | None = None  # [B, n-1, D]: layer j-1's output at its last committed pair


@dataclasses.dataclass(frozen=True)
class MTPSpec(EagleSpec):
    config: MTPConfig
    warp: WarpSpec = WarpSpec()  # the target's warping, which sampled drafts follow

    @property
    def num_layers(self) -> int:
        return len(self.config.layers)

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        later = (self.num_layers - 1) * cache_bytes(self.config.layer_config, batch_size, capacity, itemsize)
        carried = batch_size * (self.num_layers - 1) * self._pending_width * 4
        return super().state_bytes(batch_size, capacity) + later + carried

    def with_panel_weights(self, params: HeadInputs) -> HeadInputs:
        return params  # XLA's products (the target's head reads the drafts as it is)

    def _feed_layer(self, params: HeadInputs, j: int, embed, features, tokens, positions, cache, **options):
        """Layer j's post-norm outputs [B, T, D] for pairs (features, next tokens), and its cache."""
        layer = params.head.layers[j]
        return mtp_features(
            layer, self.config.layer_config, embed, features, tokens, positions, cache, **options
        )

    def _feed_target(self, params: HeadInputs, embed, target_features, tokens, positions, cache, **options):
        return self._feed_layer(params, 0, embed, target_features, tokens, positions, cache, **options)

    def _write_target(self, params: HeadInputs, embed, target_features, tokens, positions, cache):
        return self._feed_target(params, embed, target_features, tokens, positions, cache)[1]

    _feed_own = _feed_target  # (trees: one layer) fed its own post-norm outputs, as MtpModel chains them

    def _logits(self, params: HeadInputs, outputs):
        return lm_head(params.head.target, outputs, self.config.layer_config)

    def init(self, ctx: InitContext) -> MTPState:
        """Layer j takes the prompt's pairs (g^{j-1}_p, x_{p+1+j}), p < T - 1 - j committed; the
        target's f_{T-1} waits for the first token (as for EAGLE), and layer j - 1's output at its
        last committed pair for layer j's first."""
        params, prompt_tokens, prompt_lengths = ctx.params, ctx.prompt_tokens, ctx.prompt_lengths
        target_params, capacity, target_hidden = ctx.target_params, ctx.capacity, ctx.target_features
        B, T = prompt_tokens.shape
        rows = jnp.arange(B)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        features, caches, carried = target_hidden, [], []
        for j in range(self.num_layers):
            shifted = prompt_tokens[:, 1 + j :]  # x_{p+1+j}; the missing ones padded (stale pairs)
            next_tokens = jnp.pad(shifted, ((0, 0), (0, T - shifted.shape[1])))
            committed = jnp.maximum(prompt_lengths - 1 - j, 0)  # a prompt shorter than j + 2: none yet
            if j:
                carried.append(features[rows, committed])
            cache = init_cache(self.config.layer_config, B, capacity, self.dtype)
            features, cache = self._feed_layer(
                params, j, target_params.embed, features, next_tokens, positions, cache, empty_cache=True
            )
            caches.append(cache.replace(lengths=committed))
        pending = jnp.zeros((B, self.accepts + 1, target_hidden.shape[-1]), target_hidden.dtype)
        D = features.shape[-1]
        return MTPState(
            cache=caches[0],
            pending=pending.at[:, 0].set(target_hidden[rows, prompt_lengths - 1]),
            num_pending=jnp.ones((B,), jnp.int32),
            later=tuple(caches[1:]),
            carried=jnp.stack(carried, axis=1) if carried else jnp.zeros((B, 0, D), features.dtype),
        )

    def _feed_blocks(self, target_params, params: HeadInputs, state: MTPState, tokens, lengths, choose=None):
        """Feed every layer its block of the step (module doc): layer j the c pending pairs, then
        the j pairs holding the drafts d_0 .. d_{j-1}. `choose(j, features [B, D]) -> token [B]`
        drafts d_j from layer j's output at its last pair (None: no drafts, the catch-up only).
        Returns (the state with every cache caught up, the caches at their scratch lengths,
        layer n-1's output at its last pair [B, D])."""
        B, S = tokens.shape
        rows = jnp.arange(B)
        c = state.num_pending
        start = lengths - 1 - c  # layer 0's first pending pair (layer j's: start - j)
        caches = (state.cache, *state.later)
        features, committed, scratch, carried = state.pending, [], [], []
        for j in range(self.num_layers):
            offsets = jnp.arange(self.accepts + 1 + j)[None, :]
            block_tokens = tokens[rows[:, None], jnp.minimum(start[:, None] + 1 + offsets, S - 1)]
            if j:  # layer j - 1's outputs one pair on, the step before's last committed one first
                carried.append(features[rows, c - 1])
                features = jnp.concatenate([state.carried[:, j - 1 : j], features], axis=1)
            features, cache = self._feed_layer(
                params,
                j,
                target_params.embed,
                features,
                block_tokens,
                (start - j)[:, None] + offsets,
                caches[j],
            )
            committed.append(cache.advance(c))
            scratch.append(cache.advance(c + j))
            if choose is not None:  # d_j = x_{L+j}, read by the next layers' blocks
                tokens = tokens.at[rows, lengths + j].set(choose(j, features[rows, c - 1 + j]), mode="drop")
        new_state = state.replace(
            cache=committed[0],
            later=tuple(committed[1:]),
            carried=jnp.stack(carried, axis=1) if carried else state.carried,
        )
        return new_state, scratch, features[rows, c - 1 + self.num_layers - 1]

    def observe(self, ctx: ProposeContext, state: MTPState) -> MTPState:
        if self.num_layers == 1:
            return super().observe(ctx, state)
        return self._feed_blocks(ctx.target_params, ctx.params, state, ctx.tokens, ctx.lengths)[0]

    def propose(self, ctx: ProposeContext, state: MTPState):
        if self.tree is not None:  # one layer (MTP.spec): EAGLE's tree drafting from the top candidates
            return super().propose(ctx, state)
        target_params, params, tokens, lengths = ctx.target_params, ctx.params, ctx.tokens, ctx.lengths
        keys, sampling, history = ctx.keys, ctx.sampling, ctx.history
        B = tokens.shape[0]
        rows = jnp.arange(B)
        if not self.warp.greedy:
            keys = draft_keys(keys, self.k)  # [K, B]
        drafted = {
            "tokens": [],
            "probs": [],
            "logprobs": [],
            "counts": None if history is None else history.counts,
            "states": ctx.grammar_states,
        }

        def choose(i, features):  # d_i from step i's output
            logits = self._logits(params, features).astype(jnp.float32)  # [B, V]
            step_keys = None if self.warp.greedy else keys[i]
            token, probs, drafted["counts"], drafted["states"] = choose_draft(
                step_keys, logits, sampling, self.warp, history, drafted["counts"], drafted["states"]
            )
            drafted["tokens"].append(token)
            drafted["probs"].append(probs)
            drafted["logprobs"].append(jax.nn.log_softmax(logits)[rows, token])
            return token

        n = self.num_layers
        state, scratch, last = self._feed_blocks(target_params, params, state, tokens, lengths, choose)
        for i in range(n, self.k):  # layer i mod n, fed one pair after its scratch
            j = i % n
            position = (lengths - 2 + i - j)[:, None]  # its pair holding d_{i-1} = x_{L-1+i}
            token = drafted["tokens"][-1][:, None]
            out, cache = self._feed_layer(
                params, j, target_params.embed, last[:, None], token, position, scratch[j]
            )
            scratch[j] = cache.advance(jnp.ones((B,), jnp.int32))
            last = out[:, 0]
            choose(i, last)
        draft_tokens = jnp.stack(drafted["tokens"][: self.k], axis=1)  # [B, k]
        valid = jnp.ones(draft_tokens.shape, bool)
        if self.confidence_threshold > 0.0:  # EAGLE-2's path probability under the layers' own softmax
            path = jnp.cumsum(jnp.stack(drafted["logprobs"][: self.k], axis=1), axis=1)
            valid = path >= np.log(self.confidence_threshold)
        probs = drafted["probs"][: self.k]
        draft_probs = None if probs[0] is None else jnp.stack(probs, axis=1)
        return Proposal(draft_tokens=draft_tokens, valid=valid, draft_probs=draft_probs), state


@dataclasses.dataclass(frozen=True, eq=False)
class MTP(HeadProposer):
    """Draft with the target's own MTP layers (DeepSeek-V3, GLM-4.5: `model.mtp`, read at load): a
    chain of k tokens (default 3), step i with layer `layers[i % n]`, or a token tree (`tree`,
    whose depth is then k; one layer) from the top candidates. `layers`: which of the checkpoint's
    MTP layers draft, in order (default: all of them; only the first k take part). Chains are
    sampled at temperature > 0 (q the warped MTP distribution). `confidence_threshold` as for
    Eagle (chains only)."""

    k: int | None = None
    layers: tuple[int, ...] | None = None
    tree: TokenTree | None = None
    confidence_threshold: float = 0.0

    def __post_init__(self):
        if self.k is None and self.tree is None:
            object.__setattr__(self, "k", 3)
        settle_drafting(self, "MTP")
        layers = self.layers
        if layers is not None:
            if is_int(layers):
                layers = (layers,)
            if (
                not isinstance(layers, tuple | list)
                or not layers
                or not all(is_int(i) and i >= 0 for i in layers)
                or len(set(layers)) != len(layers)
            ):
                raise ValueError(
                    "MTP layers must be None or a non-empty tuple of distinct MTP layer indices >= 0, "
                    f"got {self.layers!r}"
                )
            object.__setattr__(self, "layers", tuple(layers))

    def trained_heads(self) -> tuple:
        return ()  # the target's own MTP layers

    def _layers(self, target: Model) -> tuple[int, ...]:
        """The MTP layers that draft for `target`, in drafting order, checked against what it has."""
        if target.mtp is None:
            raise missing_mtp_error(target)
        n = len(target.mtp)
        layers = tuple(range(n)) if self.layers is None else self.layers
        if any(i >= n for i in layers):
            raise ValueError(f"MTP layers={layers!r}: model {target.name!r} has {n} MTP layer(s), 0..{n - 1}")
        if self.tree is not None and len(layers) > 1:
            raise ValueError(
                f"MTP layers={layers!r} with a tree: a token tree drafts with one MTP layer; give "
                f"layers=({layers[0]},), or k for a chain through all of them"
            )
        return layers[: self.k]  # step i runs layer i mod n: only the first k draft

    def spec(self, target: Model, warp=None, mesh=None) -> MTPSpec:
        layers = self._layers(target)
        return MTPSpec(
            config=MTPConfig(mtp_layer_config(target.config), layers),
            k=self.k,
            tree=self.tree,
            dtype=target.mtp[layers[0]].eh_proj.dtype.name,
            confidence_threshold=self.confidence_threshold,
            warp=WarpSpec() if warp is None else warp,
        )

    def params(self, target: Model) -> HeadInputs:
        def build(target):
            layers = tuple(target.mtp[i] for i in self._layers(target))
            head = MTPHead(layers=layers, target=target.params.replace(layers=()))
            vocab = jnp.arange(target.config.vocab_size, dtype=jnp.int32)
            return HeadInputs(head=head, head_matrix=None, vocab=vocab)

        return kept_inputs(self, target, build)


__all__ = ["MTP", "MTPSpec", "MTPHead", "MTPState"]
