"""Lookup drafting replayed on the host over a finished greedy generation.

Under greedy decoding the output does not depend on the proposer (that is what lossless means), so
one plain run answers, exactly, how many target forwards a lookup proposer would have needed to
produce it: at each step the draft is a function of the tokens so far, and the verifier keeps the
draft's longest prefix that equals the output. A sweep over NGram's k, n_max and n_min then costs
numpy time instead of a generation per setting.

`copy_oracle_accepts` goes further: at each step it drafts the continuation of whichever earlier
position of the sequence agrees longest with the true output, a choice no real proposer can make
(it reads the answer). No prompt-lookup proposer, whatever its occurrence rule or k, needs fewer
steps, so the oracle's steps bound the speedup of all of them.

Both mirror the compiled loop's accounting: the first new token comes from the prefill, each later
step emits its accepted tokens plus one of the target's own, and a step never emits past the end
of the output (its last token, an EOS or the max_new_tokens limit). The last step's accepted
count stops there too; the loop's `accepted` metric may count drafts that agree beyond it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Replayed(NamedTuple):
    """One replayed generation, per decoding step (the target forwards after the prefill)."""

    drafted: np.ndarray  # [steps] draft tokens proposed (0: the step took a one-token pass)
    accepted: np.ndarray  # [steps] of those, accepted


def ngram_replay(prompt: Sequence[int], output: Sequence[int], k: int, n_max: int, n_min: int) -> Replayed:
    """The decoding steps of `NGram(k, n_max, n_min)` producing `output` after `prompt`.

    A plain run takes len(output) - 1 decoding steps and this one len(result.accepted); their
    ratio bounds NGram's speedup wherever a verify step costs at least a plain step. The rule is
    NGram's (proposers/ngram.py), written again here over numpy: the longest n-gram, n from n_max
    down to n_min, ending at the last token that also ends earlier; its most recent earlier end
    wins; up to k tokens that followed it, as many as the sequence holds.
    """

    def step(sequence: np.ndarray, length: int) -> tuple[int, int]:
        draft = _ngram_draft(sequence[:length], k, n_max, n_min)
        return len(draft), _agreement(draft, sequence[length:])

    return _decode_steps(prompt, output, step)


def _decode_steps(prompt: Sequence[int], output: Sequence[int], step) -> Replayed:
    """The compiled loop's accounting: the prefill emits the first output token; then each step,
    `step(sequence, length) -> (drafted, accepted)` with the first `length` tokens out, emits its
    accepted tokens plus one of the target's own, never past the end of the output."""
    sequence = np.asarray(list(prompt) + list(output), np.int64)
    drafted, accepted = [], []
    length = len(prompt) + 1
    while length < len(sequence):
        num_drafted, num_accepted = step(sequence, length)
        drafted.append(num_drafted)
        accepted.append(num_accepted)
        length += min(num_accepted + 1, len(sequence) - length)
    return Replayed(np.asarray(drafted, np.int64), np.asarray(accepted, np.int64))


def _ngram_draft(context: np.ndarray, k: int, n_max: int, n_min: int) -> np.ndarray:
    last = len(context) - 1
    for n in range(n_max, n_min - 1, -1):
        if n > last:  # an earlier n-gram needs n tokens before the last one
            continue
        suffix = context[last - n + 1 :]
        # an earlier end j in [n - 1, last) with context[j - n + 1 : j + 1] == suffix
        windows = np.lib.stride_tricks.sliding_window_view(context[:last], n)  # window i ends at i + n - 1
        ends = np.flatnonzero((windows == suffix).all(axis=1)) + n - 1
        if len(ends):
            start = ends[-1] + 1
            return context[start : start + k]
    return context[:0]


def copy_oracle_accepts(
    prompt: Sequence[int], output: Sequence[int], k: int | None = None, min_match: int = 0
) -> np.ndarray:
    """Accepted draft tokens per decoding step of the best possible copy from earlier context.

    At each step every earlier position j of the sequence (prompt and output so far) whose
    `min_match` preceding tokens equal the sequence's last `min_match` tokens is a candidate
    start: its draft is the up to k tokens (all of them with k=None) from j up to the current end,
    and the step accepts the longest agreement with the true output over all candidates.

    NGram with n_min >= min_match drafts a prefix of one of these candidates (or nothing), so it
    never accepts more in a step taken from the same point. From a later point the oracle reaches
    at least as far: the candidate that carried it there, advanced by the tokens since, is still
    a candidate and still agrees up to the same place. So NGram with any n_max, any n_min >=
    min_match, any k up to this k and any rule for choosing among occurrences needs at least as
    many steps; with min_match=0 the same holds for every drafter that copies from the context.
    """

    def step(sequence: np.ndarray, length: int) -> tuple[int, int]:
        truth = sequence[length:]
        limit = len(truth) - 1 if k is None else min(k, len(truth) - 1)  # the step's own token is extra
        starts = np.arange(min_match, length)  # [candidates]
        for i in range(1, min_match + 1):  # the i-th token before the start equals the i-th from the end
            starts = starts[sequence[starts - i] == sequence[length - i]]
        if limit <= 0 or len(starts) == 0:
            return 0, 0
        span = min(limit, length - int(starts.min()))
        positions = starts[:, None] + np.arange(span)[None, :]  # [candidates, span]
        agree = (positions < length) & (sequence[np.minimum(positions, length - 1)] == truth[None, :span])
        best = int(np.cumprod(agree, axis=1).sum(axis=1).max())  # longest agreed prefix
        return best, best  # the oracle drafts just what agrees

    return _decode_steps(prompt, output, step).accepted


def _agreement(draft: np.ndarray, truth: np.ndarray) -> int:
    """How many leading tokens of draft equal truth's, leaving truth's last token to the target."""
    span = min(len(draft), len(truth) - 1)
    same = draft[:span] == truth[:span]
    return int(span if same.all() else np.argmin(same))
