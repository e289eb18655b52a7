"""Log-probabilities of the emitted tokens, computed inside the compiled loop (`generate(...,
logprobs=N)`).

Which distribution: the one the target's sampler used at the position, that is the *processed*
distribution the token was drawn from: the logits after logit bias and penalties, then
temperature, top-k, top-p and min-p (`warp_logits`); tokens those filters drop have logprob -inf.
A greedy row (temperature 0) reports the log-softmax of its adjusted logits (bias and penalties)
at temperature 1, with no filter. A rejection-sampling correction token is drawn from the
residual max(p - q, 0), yet its reported logprob is its logprob under the target's processed
distribution p (as vLLM reports it), so that every token's logprob is the same whatever the
proposer: under every proposer, a token's logprob is the one plain decoding reports for it
(within float rounding: the verify pass scores several tokens at once).

Each emitted token comes from the target's logits of a pass the loop makes anyway (the prefill,
a plain step, a verify pass): nothing is run again. The records of a pass's candidates
(`records`) are written beside the tokens where `commit` writes those, into fixed-size buffers of
the loop state (`TokenLogprobs`, aligned with `DecodeState.tokens`), so the host reads them once
at the end. N is static (`LoopSpec.logprobs`): None compiles the program without any of it.

Shapes: B batch, T candidates of one pass, S the token buffer's slots, N alternatives, V vocab.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.speculate.sampling import SamplingParams, is_greedy, warp_logits


@flax.struct.dataclass
class LogprobRecords:
    """One pass's candidates' logprobs: chosen [B, T] float32, top_ids [B, T, N] int32 and
    top_values [B, T, N] float32 (N alternatives, best first; both None when N is 0)."""

    chosen: jax.Array
    top_ids: jax.Array | None
    top_values: jax.Array | None

    def pad_to(self, width: int) -> LogprobRecords:
        """The records padded with zeros to `width` candidates (a narrower verify pass's)."""

        def pad(x):
            if x is None or x.shape[1] == width:
                return x
            return jnp.concatenate([x, jnp.zeros((x.shape[0], width - x.shape[1]) + x.shape[2:], x.dtype)], 1)

        return LogprobRecords(pad(self.chosen), pad(self.top_ids), pad(self.top_values))

    def gather(self, index: jax.Array) -> LogprobRecords:
        """The records at index [B, T'] of each row's candidates (a tree's accepted path)."""

        def take(x):
            if x is None:
                return None
            at = index.reshape(index.shape + (1,) * (x.ndim - 2))
            return jnp.take_along_axis(x, at, axis=1)

        return LogprobRecords(take(self.chosen), take(self.top_ids), take(self.top_values))


@flax.struct.dataclass
class TokenLogprobs:
    """The loop state's buffers, one slot per token of `DecodeState.tokens` (the prompt's slots
    hold zeros): chosen [B, S] float32, top_ids [B, S, N] int32, top_values [B, S, N] float32
    (None when N is 0)."""

    chosen: jax.Array
    top_ids: jax.Array | None
    top_values: jax.Array | None

    @classmethod
    def empty(cls, num_top: int | None, batch: int, slots: int) -> TokenLogprobs | None:
        """Zeroed buffers for N = num_top alternatives, or None when logprobs are off (None)."""
        if num_top is None:
            return None
        top = None if num_top == 0 else (batch, slots, num_top)
        return cls(
            chosen=jnp.zeros((batch, slots), jnp.float32),
            top_ids=None if top is None else jnp.zeros(top, jnp.int32),
            top_values=None if top is None else jnp.zeros(top, jnp.float32),
        )

    def write(self, starts: jax.Array, records: LogprobRecords) -> TokenLogprobs:
        """Write records [B, T, ...] at slot starts[b] of each row (where `commit` writes the
        candidates: past the emitted ones they land beyond the row's end, never read)."""

        def put(buffer, values):
            if buffer is None:
                return None
            zeros = (0,) * (buffer.ndim - 2)
            return jax.vmap(lambda row, start, v: jax.lax.dynamic_update_slice(row, v, (start, *zeros)))(
                buffer, starts, values.astype(buffer.dtype)
            )

        return TokenLogprobs(
            put(self.chosen, records.chosen),
            put(self.top_ids, records.top_ids),
            put(self.top_values, records.top_values),
        )

    def window(self, columns: jax.Array) -> LogprobRecords:
        """The records at columns [B, W] of each row (a continuous batch's chunk's new tokens)."""
        return LogprobRecords(self.chosen, self.top_ids, self.top_values).gather(columns)


def processed_log_probs(adjusted: jax.Array, sampling: SamplingParams, warp) -> jax.Array:
    """[B, ..., V] float32: the log-probabilities each row's token is drawn from at each position
    (see the module docstring), from adjusted logits [B, ..., V] (`adjust`)."""
    plain = jax.nn.log_softmax(adjusted.astype(jnp.float32), axis=-1)
    if warp.greedy:
        return plain
    return jnp.where(is_greedy(sampling, plain), plain, warp_logits(adjusted, sampling, warp))


def records(
    num_top: int | None, adjusted: jax.Array, sampling: SamplingParams, warp, tokens: jax.Array
) -> LogprobRecords | None:
    """The logprob of tokens [B, T] (a pass's candidates; -1 past them) under the processed
    distribution at their positions, from the adjusted logits [B, T, V] each was chosen from,
    and the num_top most likely tokens there; None when logprobs are off (num_top None)."""
    if num_top is None:
        return None
    log_probs = processed_log_probs(adjusted, sampling, warp)  # [B, T, V]
    index = jnp.maximum(tokens, 0)[..., None]
    chosen = jnp.take_along_axis(log_probs, index, axis=-1)[..., 0]  # [B, T]
    if num_top == 0:
        return LogprobRecords(chosen, None, None)
    values, ids = jax.lax.top_k(log_probs, num_top)  # [B, T, N]
    return LogprobRecords(chosen, ids.astype(jnp.int32), values)


@dataclasses.dataclass(frozen=True)
class Logprobs:
    """One row's emitted tokens with their logprobs, on the host (`GenerateResult.logprobs[b]`).

    token_ids [n] int32 (the row's `result.tokens`), logprobs [n] float32 (each token's own, under
    the distribution its sampler used: see speculate/logprobs.py), top_ids [n, N] int32 and
    top_logprobs [n, N] float32 (at each position the N most likely tokens of that distribution,
    best first; N = `generate`'s logprobs, [n, 0] for logprobs=0). Tokens a row's filters (top-k,
    top-p, min-p) drop there have logprob -inf."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def __len__(self) -> int:
        return len(self.token_ids)

    def top(self, i: int) -> dict[int, float]:
        """{token id: logprob} of the N most likely tokens at the row's i-th emitted token."""
        return {int(t): float(v) for t, v in zip(self.top_ids[i], self.top_logprobs[i], strict=True)}

    def first(self, num_top: int) -> Logprobs:
        """These records with only their `num_top` most likely alternatives (an engine computes
        its most, and each request gets the number it asked for)."""
        return dataclasses.replace(
            self, top_ids=self.top_ids[:, :num_top], top_logprobs=self.top_logprobs[:, :num_top]
        )

    @classmethod
    def of_row(cls, buffers, token_ids, b: int, start: int) -> Logprobs:
        """The records of token_ids [n], row b's, at slots start.. of fetched buffers (a
        TokenLogprobs or LogprobRecords of numpy arrays [B, S, ...])."""
        token_ids = np.asarray(token_ids, np.int32)
        end = start + len(token_ids)
        chosen = np.asarray(buffers.chosen[b, start:end])
        if buffers.top_ids is None:
            no = (len(token_ids), 0)
            return cls(token_ids, chosen, np.zeros(no, np.int32), np.zeros(no, np.float32))
        top_ids, top_values = buffers.top_ids[b, start:end], buffers.top_values[b, start:end]
        return cls(token_ids, chosen, np.asarray(top_ids), np.asarray(top_values))
