"""Saving and loading trained heads (Medusa, EAGLE), and the training checkpoints the trainers
resume from.

A saved head is a directory: `head.json` (its kind, "medusa" or "eagle", the config fields, the
target signature, how the head was made, the specjax version) and `params/`, an orbax checkpoint of
the params as a dict of arrays: for Medusa w [M, D, D] and b [M, D]; for EAGLE fc [2D, D],
fc_bias [D] and layer (the decoder layer's weights by checkpoint name, q, k and v apart as in
specjax.models.checkpoint; q_bias, k_bias, v_bias only with qkv_bias);
and for both vocab [W] int32, the draft vocabulary (Medusa heads saved before they had one lack
it). Training checkpoints are an orbax CheckpointManager
directory of params, optimizer state and step, with `train.json` recording the run's settings so a
resume cannot mix two runs.
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

from specjax.models.eagle import EagleConfig, EagleHead, EagleParams
from specjax.models.llama import checkpoint_layer_shapes, layer_from_checkpoint, layer_to_checkpoint
from specjax.models.medusa import MedusaConfig, MedusaHead, MedusaParams
from specjax.models.model import Model

HEAD_FILE = "head.json"
RUN_FILE = "train.json"
CONFIGS = {"medusa": MedusaConfig, "eagle": EagleConfig}  # by head.json's kind


def save_head(path: str | Path, head: MedusaHead | EagleHead) -> None:
    """Write `head` to the directory `path` (created; an existing head there is replaced)."""
    kind = "medusa" if isinstance(head, MedusaHead) else "eagle" if isinstance(head, EagleHead) else None
    if kind is None:
        raise ValueError(f"head must be a specjax.models.MedusaHead or EagleHead, got {type(head).__name__}")
    path = Path(path).absolute()  # orbax wants absolute paths
    import specjax

    metadata = {
        "kind": kind,
        "config": dataclasses.asdict(head.config),  # EAGLE's rope_scaling: a dict or None
        "target": head.target,
        "meta": head.meta,
        "specjax_version": specjax.__version__,
    }
    try:
        text = json.dumps(metadata, indent=2)
    except TypeError as e:
        raise ValueError(f"head.meta must hold JSON values only (numbers, strings, lists, dicts): {e}") from e
    path.mkdir(parents=True, exist_ok=True)
    arrays = _eagle_arrays(head) if kind == "eagle" else {"w": head.params.w, "b": head.params.b}
    if getattr(head, "vocab", None) is not None:
        arrays["vocab"] = np.asarray(head.vocab, np.int32)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / "params", jax.tree.map(np.asarray, arrays), force=True)
    (path / HEAD_FILE).write_text(text + "\n")


def _eagle_arrays(head: EagleHead) -> dict:
    params = head.params
    layer = layer_to_checkpoint(params.layer, head.config.layer_config)
    return {"fc": params.fc, "fc_bias": params.fc_bias, "layer": layer}


def _abstract_arrays(config: MedusaConfig | EagleConfig, has_vocab: bool) -> dict:
    """The shapes and dtypes `save_head` wrote for a head of `config`, on the first device."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def like(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=device)

    D = config.hidden_size
    if isinstance(config, MedusaConfig):
        arrays = {"w": like((config.num_heads, D, D)), "b": like((config.num_heads, D))}
    else:
        layer = checkpoint_layer_shapes(config.layer_config)
        arrays = {
            "fc": like((2 * D, D)),
            "fc_bias": like((D,)),
            "layer": {name: like(shape) for name, shape in layer.items()},
        }
    if has_vocab:
        arrays["vocab"] = like((config.draft_vocab_size,), jnp.int32)
    return arrays


def load_head(path: str | Path, target: Model | None = None) -> MedusaHead | EagleHead:
    """Read a head written by `save_head`, of either kind; with `target`, refuse it unless it was
    trained for that model (`check_target`)."""
    path = Path(path).absolute()
    meta_file = path / HEAD_FILE
    if not path.is_dir():
        raise ValueError(f"head path {str(path)!r} is not a directory (save one with save_head)")
    if not meta_file.is_file() or not (path / "params").is_dir():
        raise ValueError(f"{str(path)!r} is not a saved head: it has no {HEAD_FILE} and params/")
    try:
        metadata = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(meta_file)!r} is not valid JSON: {e}") from e
    kind = metadata.get("kind") if isinstance(metadata, dict) else None
    if kind not in CONFIGS:
        raise ValueError(f"{str(path)!r} holds a head of kind {kind!r}, expected 'medusa' or 'eagle'")
    config_class = CONFIGS[kind]
    try:
        config = config_class(**metadata["config"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{str(meta_file)!r} has no valid {config_class.__name__}: {e}") from e
    # every EAGLE head has a draft vocab; Medusa heads saved before theirs had one have neither
    # that array nor draft_vocab_size in head.json
    has_vocab = "draft_vocab_size" in metadata["config"]
    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(path / "params", _abstract_arrays(config, has_vocab))
    about = {"target": metadata.get("target", {}), "meta": metadata.get("meta", {})}
    if has_vocab:
        about["vocab"] = np.asarray(arrays.pop("vocab"))
    if kind == "medusa":
        head = MedusaHead(config=config, params=MedusaParams(**arrays), **about)
    else:
        layer = layer_from_checkpoint(arrays["layer"], config.layer_config)
        head = EagleHead(config=config, params=EagleParams(arrays["fc"], arrays["fc_bias"], layer), **about)
    if target is not None:
        head.check_target(target)
    return head


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
