"""Verification: which draft tokens the target keeps, and the one token it adds.

Pure jax.numpy and no model code, so the verifiers run inside the compiled loop (no Python
branch on values, no host sync) and can be tested against exact laws:

- `rejection_sample` (default, lossless at any temperature; Leviathan et al. 2023, Chen et al.
  2023): the emitted tokens follow the target's distribution `p` exactly, whatever the draft's `q`.
- `greedy_verify` (temperature 0): keep drafts while they equal the target's argmax.
- `expected_acceptance`: the analytic acceptance probability `sum_v min(p, q)` per position,
  the reference that measured acceptance rates are compared with.

Both verifiers return `tokens [B, K+1]`: the `n = num_accepted` accepted drafts, then the
target's own token at position `n` (the correction, or the bonus token when `n == K`), then -1.

Einsum letters: B batch, K draft positions (k speculative tokens), V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.speculate.sampling import greedy_argmax


def _check_shapes(target: jax.Array, draft_tokens: jax.Array, valid: jax.Array | None, what: str) -> None:
    """Shapes are static, so a mismatch fails at trace time with a readable message."""
    if draft_tokens.ndim != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {draft_tokens.shape}")
    batch, k = draft_tokens.shape
    if target.ndim != 3 or target.shape[:2] != (batch, k + 1):
        raise ValueError(f"{what} must be [B, K+1, V] = [{batch}, {k + 1}, V], got shape {target.shape}")
    if valid is not None and valid.shape != (batch, k):
        raise ValueError(f"valid must be [B, K] = [{batch}, {k}], got shape {valid.shape}")


def keys_per_row(key: jax.Array, batch: int) -> jax.Array:
    """[B] keys from one key (split) or from one per row (as they are); typed or raw uint32."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not typed:
        key = jax.random.wrap_key_data(key)
    if key.shape == (batch,):
        return key
    if key.shape != ():
        raise ValueError(f"key must be one PRNG key or one per row ({batch}), got shape {key.shape}")
    return jax.random.split(key, batch)


def residual_floor(dtype) -> jax.Array:
    """Below this total mass a rejection residual is float rounding noise (see rejection_sample)."""
    return 16 * jnp.finfo(dtype).eps


def _prefix_length(keep: jax.Array) -> jax.Array:
    """keep [B, K] bool -> [B] int32: the length of each row's leading run of True."""
    return jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=-1), axis=-1, dtype=jnp.int32)


def assemble(prefix: jax.Array, num_accepted: jax.Array, stop_token: jax.Array) -> jax.Array:
    """prefix [B, K+1] before n, stop_token [B] at n, -1 after: int32 [B, K+1]."""
    positions = jnp.arange(prefix.shape[1])
    n = num_accepted[:, None]
    tokens = jnp.where(positions < n, prefix, jnp.where(positions == n, stop_token[:, None], -1))
    return tokens.astype(jnp.int32)


def rejection_sample(
    key: jax.Array,
    target_probs: jax.Array,
    draft_probs: jax.Array,
    draft_tokens: jax.Array,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Lossless verification of a chain of K drafts by rejection sampling.

    Args:
      key: a PRNG key, or one per row ([B]); split here into the acceptance uniforms and the
        stop-token draw. With one key per row, a row's draws depend on its key alone.
      target_probs: [B, K+1, V] the target's warped distribution `p` at each draft position
        and at the bonus position K.
      draft_probs: [B, K, V] the exact distribution `q` each draft token was sampled from
        (one-hot for deterministic proposers).
      draft_tokens: [B, K] int.
      valid: [B, K] bool prefix mask (a row may draft fewer than K), or None for all valid.
        A position after the first invalid one is never accepted.

    Returns:
      tokens [B, K+1] int32 (accepted drafts, then the correction or bonus token, then -1) and
      num_accepted [B] int32 in 0..K.

    Draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); the first rejected or
    invalid position n draws from normalize(max(p_n - q_n, 0)), with q taken as 0 at invalid
    positions and at the bonus position K (nothing was drafted there, so the draw is from p_n).
    Every emitted token then follows p exactly. A token with p = 0 is never emitted.
    """
    _check_shapes(target_probs, draft_tokens, valid, "target_probs")
    batch, k = draft_tokens.shape
    if draft_probs.shape != (batch, k, target_probs.shape[2]):
        want = (batch, k, target_probs.shape[2])
        raise ValueError(f"draft_probs must be [B, K, V] = {want}, got shape {draft_probs.shape}")
    # At least float32: bfloat16 would round the acceptance ratios and the residual coarsely.
    dtype = jnp.promote_types(jnp.result_type(target_probs, draft_probs), jnp.float32)
    p = target_probs.astype(dtype)  # [B, K+1, V]
    q = draft_probs.astype(dtype)  # [B, K, V]
    draft_tokens = draft_tokens.astype(jnp.int32)
    valid = jnp.ones((batch, k), bool) if valid is None else valid.astype(bool)
    keys = jax.vmap(jax.random.split)(keys_per_row(key, batch))  # [B, 2]
    accept_keys, stop_keys = keys[:, 0], keys[:, 1]

    # Accept iff u * q(x) < p(x) with u ~ U[0, 1): probability min(1, p/q), with no division.
    # The strict inequality never accepts a token with p(x) = 0; a token with q(x) = 0 (which a
    # correct proposer never drafts) is accepted exactly when p(x) > 0, the limit of p/q.
    p_draft = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]  # [B, K]
    q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]  # [B, K]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,), dtype))(accept_keys)  # [B, K]
    num_accepted = _prefix_length(valid & (u * q_draft < p_draft))  # [B]

    # The distributions at each row's stop position n (gathers, not one-hot matmuls, so that
    # no accelerator's reduced-precision dot touches the probabilities).
    rows = jnp.arange(batch)
    q_drafted = jnp.where(valid[..., None], q, 0)  # nothing was drafted at invalid positions
    q_ext = jnp.concatenate([q_drafted, jnp.zeros((batch, 1, q.shape[2]), dtype)], axis=1)  # [B, K+1, V]
    p_stop = p[rows, num_accepted]  # [B, V]
    residual = jnp.maximum(p_stop - q_ext[rows, num_accepted], 0)  # [B, V]; > 0 only where p > 0

    # When p == q on the support a rejection has probability 0 in exact arithmetic, yet float
    # rounding (or a q with more mass than p) can still reject, leaving a residual of ~0 to
    # normalise. Below a few ulps of 1 the residual is noise: draw from p instead. For normalised
    # p and q the rejection has probability sum(residual) <= floor, so this changes the law by at
    # most the floor in total variation; and a 0/0 can never arise.
    usable = jnp.sum(residual, axis=-1, keepdims=True) > residual_floor(dtype)
    stop_probs = jnp.where(usable, residual, p_stop)
    # Gumbel-max over log-probabilities: -inf (probability 0) is never drawn and no
    # normalisation is needed, unlike an inverse-CDF draw whose rounding can overshoot.
    stop_token = jax.vmap(jax.random.categorical)(stop_keys, jnp.log(stop_probs))  # [B]

    prefix = jnp.concatenate([draft_tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)  # [B, K+1]
    return assemble(prefix, num_accepted, stop_token), num_accepted


def greedy_verify(
    target_logits: jax.Array, draft_tokens: jax.Array, valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Verification at temperature 0: accept while the draft equals the target's argmax.

    Args:
      target_logits: [B, K+1, V] the target's logits at the K draft positions and the bonus one.
      draft_tokens: [B, K] int.
      valid: [B, K] bool prefix mask, or None for all valid.

    Returns:
      tokens [B, K+1] int32 and num_accepted [B] int32, laid out as in `rejection_sample`:
      the output is exactly the target's greedy continuation, n + 1 tokens of it.
    """
    _check_shapes(target_logits, draft_tokens, valid, "target_logits")
    batch, k = draft_tokens.shape
    valid = jnp.ones((batch, k), bool) if valid is None else valid.astype(bool)
    target_tokens = greedy_argmax(target_logits)  # [B, K+1]
    num_accepted = _prefix_length(valid & (draft_tokens == target_tokens[:, :k]))
    # Accepted drafts equal the argmax, so the row is the argmax up to and including n.
    stop_token = target_tokens[jnp.arange(batch), num_accepted]
    return assemble(target_tokens, num_accepted, stop_token), num_accepted


def expected_acceptance(target_probs: jax.Array, draft_probs: jax.Array) -> jax.Array:
    """The probability that each draft is accepted given it is reached: sum_v min(p, q).

    Args:
      target_probs: [B, K, V] or [B, K+1, V] (the bonus position is ignored).
      draft_probs: [B, K, V].

    Returns:
      [B, K] float. It is what `rejection_sample` accepts with on average over x ~ q, so
      measured acceptance rates can be checked against it without sampling noise.
    """
    k = draft_probs.shape[1]
    if target_probs.shape[1] not in (k, k + 1) or target_probs.shape[2] != draft_probs.shape[2]:
        raise ValueError(
            f"target_probs must be [B, K(+1), V] for draft_probs {draft_probs.shape}, "
            f"got shape {target_probs.shape}"
        )
    return jnp.sum(jnp.minimum(target_probs[:, :k], draft_probs), axis=-1)
