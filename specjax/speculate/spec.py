"""The static part of a generation program (`LoopSpec`: equal specs share one compilation) and
what its program allocates (`memory_bytes`, checked before anything is allocated). The program
itself is speculate/loop.py's."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.kernels import backend
from specjax.kernels.backend import Backend
from specjax.models import quantized
from specjax.models.attention import attention_workspace_bytes
from specjax.models.cache import cache_bytes
from specjax.models.config import LlamaConfig
from specjax.models.params import LlamaParams, layers_bytes
from specjax.speculate.sampling import WarpSpec


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Everything static about one generation program; equal specs share one compilation."""

    config: LlamaConfig
    batch_size: int
    prompt_bucket: int  # prompts are right-padded to this many tokens
    capacity: int  # slots per row in the token buffer and the KV cache
    warp: WarpSpec
    proposer: Any = None  # a ProposerSpec (speculate/proposers/protocol.py), None for plain decoding
    mesh: Any = None  # a jax Mesh: the target's forward runs under shard_map on it (specjax/sharding)
    dtype: str = "float32"  # the target's weights and activations
    cache_dtype: str = "float32"  # the target's KV cache
    # The kernels and precision the program is traced with (specjax/kernels/backend.py); None: the active
    # backend where the program is traced (plain XLA on the default platform outside a generate).
    backend: Backend | None = None
    # Prefill in chunks of this many tokens of one row at a time, inside the program (`chunked_prefill`):
    # the prompts then come in the token buffer's width (`prompt_bucket` == `capacity`) and no pass
    # depends on their lengths. None: the prompts in one pass over [B, prompt_bucket] (`whole_prefill`).
    prefill_chunk: int | None = None
    # The target's KV cache in pages of this many slots (models/cache.py, KVCache.pages), each row
    # given its own pages in order (`identity_pages`); None: the dense layout. The serving engine
    # hands pages out itself (specjax/serve/pages.py).
    page_size: int | None = None
    # Per emitted token, its logprob and the logprobs of this many most likely tokens
    # (speculate/logprobs.py), computed in the loop into buffers of the state; None: off, none of it
    # compiled.
    logprobs: int | None = None
    # Per prompt token, its logprob and this many most likely tokens, from a one-pass prefill that
    # keeps every position's hidden state (speculate/prompt_logprobs.py); None: off.
    prompt_logprobs: int | None = None

    @property
    def packs_prefill(self) -> bool:
        """Whether the chunked prefill packs the rows' prompts end to end (`packed_prefill`): on a
        paged cache whose backend's attention kernel reads the pages in place (elsewhere a pass of
        one-token rows would gather every token's row from the pools)."""
        if self.prefill_chunk is None:
            return False
        return pages_pack(self.page_size, self.backend or backend.active(), self.config, self.dtype)

    @property
    def k(self) -> int:
        """Draft positions: the most drafts one step can accept (a tree's depth)."""
        return 0 if self.proposer is None else self.proposer.k

    @property
    def tree(self):
        """The proposer's TokenTree, or None for a chain of k drafts (or plain decoding)."""
        return None if self.proposer is None else self.proposer.capabilities.tree

    @property
    def num_drafted(self) -> int:
        return num_drafted(self.proposer)

    @property
    def proposer_reads_features(self) -> bool:
        """Whether the proposer reads the target's features at init (InitContext.target_features)."""
        return self.proposer is not None and self.proposer.capabilities.target_features is not None

    @property
    def proposer_feature_width(self) -> int:
        """The width F of the features the proposer reads per token (the hidden size, or n of
        them side by side for n captured layers); 0 where it reads none."""
        if not self.proposer_reads_features:
            return 0
        return self.config.hidden_size * len(self.proposer.capabilities.feature_layers or (None,))


def pages_pack(page_size: int | None, on: Backend, config: LlamaConfig, dtype: str) -> bool:
    """Whether a chunked prefill over a cache in pages of `page_size` (None: dense) packs the rows'
    prompts end to end on backend `on`: where its attention kernel reads the pages in place (else
    a pass of one-token rows would gather every token's row from the pools)."""
    return page_size is not None and on.cache_attention_reads_pages(config.head_dim, dtype, page_size)


def num_drafted(proposer) -> int:
    """Tokens a verify pass scores after the last one (so cache slots it writes past a row's
    length, less one): k for a chain, a tree's node count, 0 for plain decoding."""
    if proposer is None:
        return 0
    tree = proposer.capabilities.tree
    return proposer.k if tree is None else tree.num_nodes


def memory_bytes(spec: LoopSpec, params: LlamaParams | None = None) -> int:
    """Device memory the program allocates beyond the weights, estimated before allocating: the
    KV caches (target and proposer), the token buffer, the penalty counts, and the largest
    temporaries (one verify pass's logits and probabilities, the prefill's activations, and the
    working memory of one layer's attention on the program's backend). With the target's
    `params`, the stacked copy of its layers (a program that scans them) is counted at their
    stored size (quantized weights' own); without, from the config and dtype."""
    c, B, S, K = spec.config, spec.batch_size, spec.capacity, spec.num_drafted
    V, T = c.vocab_size, spec.prompt_bucket
    total = cache_bytes(c, B, S, np.dtype(jnp.dtype(spec.cache_dtype)).itemsize) + B * S * 4
    if spec.proposer is not None:
        total += spec.proposer.state_bytes(B, S)
    if spec.warp.penalties:
        total += B * V * 5 + B * (K + 1) * V * 4  # counts, prompt mask, counts at the drafts
    total += 3 * B * (K + 1) * V * 4  # logits, target and draft probabilities
    if spec.logprobs is not None:  # the buffers (speculate/logprobs.py) and one pass's log-probabilities
        total += B * S * (4 + 8 * spec.logprobs) + B * (K + 1) * V * 4
    if spec.prompt_logprobs is not None:  # the prompt's records and one chunk's logits
        total += B * T * (4 + 8 * spec.prompt_logprobs) + 2 * B * 16 * V * 4
    ffw = max(c.intermediate_size, (c.moe_intermediate_size or 0) * c.num_experts_per_tok)
    itemsize = np.dtype(jnp.dtype(spec.dtype)).itemsize
    on = spec.backend or backend.active()
    if spec.prefill_chunk is None:  # the prefill's activations, in the model's dtype
        total += B * T * (2 * ffw + 4 * c.hidden_size) * itemsize
        workspace = attention_workspace_bytes(c, B, T, K + 1, S, spec.dtype, on)
    else:  # one row's chunk at a time, a decoding pass of C tokens; the features gathered for init
        C = spec.prefill_chunk
        total += C * (2 * ffw + 4 * c.hidden_size) * itemsize
        total += B * S * spec.proposer_feature_width * itemsize
        workspace = max(
            attention_workspace_bytes(c, 1, 1, C, S, spec.dtype, on),  # a chunk's pass
            attention_workspace_bytes(c, B, 1, K + 1, S, spec.dtype, on),  # a decoding step's
        )
    if on.scans_layers:  # the layers' weights stacked, a copy beside them while the program runs
        total += layers_bytes(c, itemsize) if params is None else quantized.nbytes(params.layers)
    return total + workspace
