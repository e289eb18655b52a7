"""What a decoding step costs on this machine, in plain decoding steps (for GoodputSchedule).

A host-side tool: it times whole `generate` calls. The speculate layer below does not import
generate, so `GoodputSchedule.measure` reaches this module's `measure_step_costs` through the
timer installed into it at the end of this module (`import specjax` loads it).

Three timed runs, each at two lengths so that prefill and compile cancel (the extra tokens'
time over the extra steps):
  plain decoding                                          -> t_plain per step
  ForcedAcceptance(0, k=k), free drafts                   -> t_plain + k * verify_cost * t_plain
  ForcedAcceptance(0, proposer), the proposer's k drafts  -> ... + k * draft_cost * t_plain
At forced acceptance 0 every step emits exactly one token, so the runs take the same number of
steps; EOS is banned by a logit bias so that no row ends early.
"""

from __future__ import annotations

import time

import numpy as np

from specjax.api import generate
from specjax.speculate.proposers.dynamic import set_cost_meter
from specjax.speculate.proposers.forced import ForcedAcceptance, _draft_positions
from specjax.speculate.sampling import Sampling


def _step_seconds(model, prompts, proposer, max_new_tokens: int, sampling) -> float:
    def seconds(n):
        generate(model, prompts, proposer, sampling, max_new_tokens=n)  # compile, warm up
        best = np.inf
        for _ in range(2):
            start = time.perf_counter()
            result = generate(model, prompts, proposer, sampling, max_new_tokens=n)
            best = min(best, time.perf_counter() - start)
        return best, int(result.metrics.steps.max())

    short, steps_short = seconds(max(1, max_new_tokens // 4))
    long, steps_long = seconds(max_new_tokens)
    return (long - short) / max(steps_long - steps_short, 1)


def measure_step_costs(model, proposer, prompts, max_new_tokens: int = 64) -> dict:
    """{"plain_step_s", "verify_cost", "draft_cost", "k"}: the costs of one more verified token and
    one more drafted token, each as a fraction of a plain decoding step (never below 0)."""
    k = _draft_positions(proposer)
    if k is None:
        raise ValueError(f"proposer must be a proposer with a k (NGram, DraftModel, ...), got {proposer!r}")
    eos = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        eos.add(int(model.tokenizer.eos_token_id))
    sampling = Sampling(logit_bias={int(t): -1e9 for t in eos})
    plain = _step_seconds(model, prompts, None, max_new_tokens, sampling)
    free = _step_seconds(model, prompts, ForcedAcceptance(0.0, k=k), max_new_tokens, sampling)
    drafted = _step_seconds(model, prompts, ForcedAcceptance(0.0, proposer), max_new_tokens, sampling)
    return {
        "plain_step_s": plain,
        "verify_cost": max(free - plain, 0.0) / (k * plain),
        "draft_cost": max(drafted - free, 0.0) / (k * plain),
        "k": k,
    }


set_cost_meter(measure_step_costs)
