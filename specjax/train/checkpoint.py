"""The training checkpoints the trainers resume from, and (re-exported from specjax.models.heads,
their home beside model loading) `save_head` / `load_head` for trained heads.

Training checkpoints are an orbax CheckpointManager directory of params, optimizer state and
step, with `train.json` recording the run's settings so a resume cannot mix two runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from specjax.models.heads import load_head, save_head

__all__ = ["TrainingCheckpoints", "load_head", "open_training_checkpoints", "save_head"]

RUN_FILE = "train.json"


class TrainingCheckpoints:
    """Params, optimizer state and step of a training run, every few steps."""

    def __init__(self, directory: Path):
        options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state) -> None:
        state = {"params": params, "opt_state": opt_state, "step": jnp.asarray(step, jnp.int32)}
        self.manager.save(step, args=ocp.args.StandardSave(state))
        self.manager.wait_until_finished()

    def restore(self, step: int, params, opt_state) -> tuple[Any, Any, int]:
        """The state saved at `step`, in the structure of `params` and `opt_state`."""
        like = {"params": params, "opt_state": opt_state, "step": jnp.asarray(0, jnp.int32)}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        state = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        return state["params"], state["opt_state"], int(state["step"])

    def close(self) -> None:
        self.manager.close()


def open_training_checkpoints(
    directory: str | Path, run_info: dict, params, opt_state, resume: bool
) -> tuple[TrainingCheckpoints, tuple[Any, Any, int] | None]:
    """The checkpoints in `directory` and, with `resume`, the latest state there (None if none).

    `run_info` (settings, data size, target signature) is written to train.json on the first
    save; resuming from a directory written with other settings raises a ValueError, as does a
    fresh run (`resume=False`) in a directory that already holds checkpoints.
    """
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    run_info = json.loads(json.dumps(run_info))
    run_file = directory / RUN_FILE
    checkpoints = TrainingCheckpoints(directory)
    latest = checkpoints.latest_step()
    if latest is not None and not resume:
        checkpoints.close()
        raise ValueError(
            f"checkpoint_dir {str(directory)!r} already holds checkpoints (up to step {latest}): pass "
            "resume=True to continue that run, or an empty directory to start another"
        )
    if run_file.is_file():
        saved = json.loads(run_file.read_text())
        if latest is not None and saved != run_info:
            checkpoints.close()
            raise ValueError(
                f"checkpoint_dir {str(directory)!r} holds a run with {saved}, not {run_info}: use "
                "another directory for these settings"
            )
    run_file.write_text(json.dumps(run_info, indent=2) + "\n")
    restored = None if latest is None else checkpoints.restore(latest, params, opt_state)
    return checkpoints, restored
