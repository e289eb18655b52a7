r"""Seconds per training step of the MLP speculator for the built-in model, scoring a random subset of
positions (`positions_per_sequence`) against every position.

    .venv/bin/python benchmarks/mlp_speculator_step.py [--positions 64,0] [--batch-size 8] \
        [--max-len 256] [--steps 3]

`specjax.train.train_mlp_speculator`'s own jitted step (its objective and `optimizer_and_step`:
AdamW over the 3 stages' 170M parameters, the loss at --positions random positions of each
sequence, 0: all of them) on a batch shaped like `make heads`' distillation set: --batch-size
sequences of --max-len tokens, random hidden states and tokens, every sequence full (the time does
not depend on the values). Each setting is compiled and run once (reported), then its --steps
steps are timed one by one (median), all in one process.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, markdown_table, median_time

import specjax
from specjax.models.mlp_speculator import MLPSpeculatorConfig, init_mlp_speculator
from specjax.train.common import optimizer_and_step
from specjax.train.mlp_speculator import _objective  # the trainer's objective, as it compiles it


def time_steps(config: MLPSpeculatorConfig, positions: int | None, batch: tuple, steps: int) -> tuple:
    """(the first step's seconds, compile included; the median of the next `steps`)."""
    optimizer, step = optimizer_and_step(_objective(config, positions), 1e-3, 40, 400, 0.0, 1.0)  # 400 steps
    params = init_mlp_speculator(config, jax.random.key(0))
    state = [params, optimizer.init(params)]
    keys = iter(jax.random.split(jax.random.key(1), steps + 1))

    def one_step():
        params, opt_state, loss, _ = step(*state, *batch, next(keys))
        state[:] = jax.block_until_ready((params, opt_state))
        float(loss)

    start = time.perf_counter()
    one_step()
    return time.perf_counter() - start, median_time(one_step, steps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--positions", default="64,0", help="positions per sequence, 0: all (default 64,0)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--n-predict", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting (median)")
    args = parser.parse_args()

    c = specjax.load("smollm2-135m").config
    config = MLPSpeculatorConfig(c.hidden_size, c.hidden_size, c.vocab_size, args.n_predict)
    rng = np.random.default_rng(0)
    B, T = args.batch_size, args.max_len
    hidden = jnp.asarray(rng.normal(size=(B, T, c.hidden_size)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, c.vocab_size, size=(B, T)).astype(np.int32))
    batch = (hidden, tokens, jnp.ones((B, T), bool))
    rows = []
    for positions in (int(p) for p in args.positions.split(",")):
        first, seconds = time_steps(config, positions or None, batch, args.steps)
        rows.append([positions or f"all {T}", B, first, seconds])
        print(
            f"positions {positions or 'all'}: first step {first:.1f} s, then {seconds:.2f} s a step",
            flush=True,
        )
    print(machine())
    print(markdown_table(["positions per sequence", "batch", "first step, s (compile)", "s / step"], rows))


if __name__ == "__main__":
    main()
