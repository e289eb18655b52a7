"""Saving and loading Medusa heads, and the training checkpoints `train_medusa` resumes from.

A saved head is a directory: `params/` (orbax: w [M, D, D], b [M, D]) and `head.json` (kind
"medusa", the MedusaConfig fields, the target signature, how the head was made, the specjax
version). Training checkpoints are an orbax CheckpointManager directory of params, optimizer state
and step, with `train.json` recording the run's settings so a resume cannot mix two runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from specjax.models.medusa import MedusaConfig, MedusaHead, MedusaParams
from specjax.models.model import Model

HEAD_FILE = "head.json"
RUN_FILE = "train.json"


def save_head(path: str | Path, head: MedusaHead) -> None:
    """Write `head` to the directory `path` (created; an existing head there is replaced)."""
    if not isinstance(head, MedusaHead):
        raise ValueError(f"head must be a specjax.models.MedusaHead, got {type(head).__name__}")
    path = Path(path).absolute()  # orbax wants absolute paths
    import specjax

    metadata = {
        "kind": "medusa",
        "config": dataclasses.asdict(head.config),
        "target": head.target,
        "meta": head.meta,
        "specjax_version": specjax.__version__,
    }
    try:
        text = json.dumps(metadata, indent=2)
    except TypeError as e:
        raise ValueError(f"head.meta must hold JSON values only (numbers, strings, lists, dicts): {e}") from e
    path.mkdir(parents=True, exist_ok=True)
    arrays = {"w": np.asarray(head.params.w), "b": np.asarray(head.params.b)}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / "params", arrays, force=True)
    (path / HEAD_FILE).write_text(text + "\n")


def load_head(path: str | Path, target: Model | None = None) -> MedusaHead:
    """Read a head written by `save_head`; with `target`, refuse it unless it was trained for that
    model (`MedusaHead.check_target`)."""
    path = Path(path).absolute()
    meta_file = path / HEAD_FILE
    if not path.is_dir():
        raise ValueError(f"Medusa head path {str(path)!r} is not a directory (save one with save_head)")
    if not meta_file.is_file() or not (path / "params").is_dir():
        raise ValueError(f"{str(path)!r} is not a saved Medusa head: it has no {HEAD_FILE} and params/")
    try:
        metadata = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(meta_file)!r} is not valid JSON: {e}") from e
    kind = metadata.get("kind") if isinstance(metadata, dict) else None
    if kind != "medusa":
        raise ValueError(f"{str(path)!r} holds a head of kind {kind!r}, expected 'medusa'")
    try:
        config = MedusaConfig(**metadata["config"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{str(meta_file)!r} has no valid MedusaConfig: {e}") from e
    M, D = config.num_heads, config.hidden_size
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {
        "w": jax.ShapeDtypeStruct((M, D, D), jnp.float32, sharding=device),
        "b": jax.ShapeDtypeStruct((M, D), jnp.float32, sharding=device),
    }
    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(path / "params", abstract)
    head = MedusaHead(
        config,
        MedusaParams(w=arrays["w"], b=arrays["b"]),
        metadata.get("target", {}),
        metadata.get("meta", {}),
    )
    if target is not None:
        head.check_target(target)
    return head


class TrainingCheckpoints:
    """Params, optimizer state and step of a `train_medusa` run, every few steps."""

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
