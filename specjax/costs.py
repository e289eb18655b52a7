"""What a decoding step costs on this machine, in plain decoding steps (for GoodputSchedule).

A host-side tool: it times whole `generate` calls. The speculate layer below does not import
generate, so `GoodputSchedule.measure` reaches this module's `measure_step_costs` through the
timer installed into it at the end of this module (`import specjax` loads it).

Three kinds of run, each at two lengths so that prefill and compile cancel (the extra tokens'
time over the extra steps):
  plain decoding                                          -> t_plain per step
  ForcedAcceptance(0, k=k), free drafts                   -> t_plain + k * verify_cost * t_plain
  ForcedAcceptance(0, proposer), the proposer's k drafts  -> ... + k * draft_cost * t_plain
At forced acceptance 0 every step emits exactly one token, so the runs take the same number of
steps; EOS is banned by a logit bias so that no row ends early. The three run in turn, round after
round, and each cost is the median over the rounds of that round's difference: a busy moment of
the machine slows the three runs of a round alike and falls out of the difference (one timing of
each, a minute apart, gave a k = 1 head's drafting a cost of 0 on a loaded host).
"""

from __future__ import annotations

import statistics
import time

from specjax.api import generate
from specjax.checks import check_int
from specjax.speculate.proposers.dynamic import set_cost_meter
from specjax.speculate.proposers.forced import ForcedAcceptance
from specjax.speculate.proposers.protocol import Proposer
from specjax.speculate.sampling import Sampling

_clock = time.perf_counter  # the tests put a clock of their own here


def measure_step_costs(
    model, proposer, prompts, max_new_tokens: int = 64, rounds: int = 5, **generate_options
) -> dict:
    """{"plain_step_s", "verify_cost", "draft_cost", "k"}: the costs of one more verified token and
    one more drafted token, each as a fraction of a plain decoding step (never below 0), the
    medians over `rounds` rounds (module doc). `generate_options` (kernels, ...) go to every timed
    `generate` call: time what will run."""
    if not isinstance(proposer, Proposer):
        raise ValueError(f"proposer must be a specjax proposer (NGram, DraftModel, ...), got {proposer!r}")
    k = proposer.draft_positions
    check_int("rounds", rounds, 1)
    eos = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        eos.add(int(model.tokenizer.eos_token_id))
    sampling = Sampling(logit_bias={int(t): -1e9 for t in eos})
    runs = {"plain": None, "free": ForcedAcceptance(0.0, k=k), "drafted": ForcedAcceptance(0.0, proposer)}
    lengths = (max(1, max_new_tokens // 4), max_new_tokens)

    def call(proposer, n):
        return generate(model, prompts, proposer, sampling, max_new_tokens=n, **generate_options)

    for run in runs.values():  # compile, warm up
        for n in lengths:
            call(run, n)
    step_s = {name: [] for name in runs}  # per round: seconds per step
    for _ in range(rounds):
        for name, run in runs.items():
            seconds, steps = [], []
            for n in lengths:
                start = _clock()
                result = call(run, n)
                seconds.append(_clock() - start)
                steps.append(int(result.metrics.steps.max()))
            step_s[name].append((seconds[1] - seconds[0]) / max(steps[1] - steps[0], 1))
    if min(step_s["plain"]) <= 0:  # the costs are fractions of it: noise would pass for a cost
        raise RuntimeError(
            f"plain decoding's extra steps took no measurable time in a round ({min(step_s['plain'])} s "
            f"per step at max_new_tokens={max_new_tokens}): time longer runs (more max_new_tokens or "
            "prompts) or a larger model"
        )

    def cost(more, less):  # the median over rounds of that round's extra time per token
        return max(
            statistics.median(
                (a - b) / (k * plain)
                for a, b, plain in zip(step_s[more], step_s[less], step_s["plain"], strict=True)
            ),
            0.0,
        )

    return {
        "plain_step_s": statistics.median(step_s["plain"]),
        "verify_cost": cost("free", "plain"),
        "draft_cost": cost("drafted", "free"),
        "k": k,
    }


set_cost_meter(measure_step_costs)
