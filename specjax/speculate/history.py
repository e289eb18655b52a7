"""What the penalties look at: per row, how often each token has been generated, and which
tokens the prompt holds.

The counts live in the loop state and grow only by committed tokens, so a rejected draft never
leaves a trace. To score drafts in one pass, `counts_at_nodes` gives the counts as they would be
after each drafted token if the drafts on its path (a chain's earlier drafts, a tree node's
ancestors) were accepted: exactly the state plain decoding would have there.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class TokenHistory:
    counts: jax.Array  # [B, V] int32: generated (committed) occurrences of each token
    in_prompt: jax.Array  # [B, V] bool: the token occurs in the row's prompt

    @classmethod
    def of_prompts(cls, prompt_tokens: jax.Array, prompt_lengths: jax.Array, vocab_size: int):
        """prompt_tokens [B, T] right-padded, prompt_lengths [B]."""
        B, T = prompt_tokens.shape
        real = jnp.arange(T)[None, :] < prompt_lengths[:, None]
        in_prompt = jnp.zeros((B, vocab_size), bool).at[jnp.arange(B)[:, None], prompt_tokens].max(real)
        return cls(counts=jnp.zeros((B, vocab_size), jnp.int32), in_prompt=in_prompt)

    def add(self, tokens: jax.Array, num_tokens: jax.Array) -> TokenHistory:
        """Count the first num_tokens[b] of tokens [B, T] (other entries may be -1 or stale)."""
        B, T = tokens.shape
        taken = (jnp.arange(T)[None, :] < num_tokens[:, None]).astype(jnp.int32)
        safe = jnp.where(taken > 0, tokens, 0)
        return self.replace(counts=self.counts.at[jnp.arange(B)[:, None], safe].add(taken))

    def counts_at_nodes(self, node_tokens: jax.Array, valid: jax.Array, sees: jax.Array) -> jax.Array:
        """[B, N+1, V]: the counts after each node of a token tree (root first) = the counts plus
        the drafted tokens on the path to it. node_tokens, valid [B, N]; sees [N+1, N+1] the tree's
        attention mask (node i sees itself and its ancestors)."""
        V = self.counts.shape[1]
        drafted = jax.nn.one_hot(node_tokens, V, dtype=jnp.int32) * valid[..., None]  # [B, N, V]
        drafted = jnp.concatenate([jnp.zeros_like(drafted[:, :1]), drafted], axis=1)  # [B, N+1, V]
        on_path = jnp.einsum("ij,bjv->biv", sees.astype(jnp.int32), drafted)
        return self.counts[:, None, :] + on_path
