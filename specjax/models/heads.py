"""Draft heads by path: `load_head(path, target)` reads a head from a folder, `save_head` writes
one. Beside `load(source)` for models: the host side reads both through this package.

The format read and written here is specjax's own (what `make heads` and the `specjax train-*`
commands write): a directory with `head.json` (its kind, "medusa" or "eagle", the config fields,
the target signature, how the head was made, the specjax version) and `params/`, an orbax
checkpoint of the params as a dict of arrays: for Medusa w [M, D, D] and b [M, D]; for EAGLE
fc [2D, D], fc_bias [D] and layer (the decoder layer's weights by checkpoint name, q, k and v
apart as in specjax.models.checkpoint; q_bias, k_bias, v_bias only with qkv_bias); and for both
vocab [W] int32, the draft vocabulary (Medusa heads saved before they had one lack it). MTP
layers trained here (kind "mtp", `MTPLayers`) hold per layer, under layers/{j}, enorm, hnorm,
eh_proj, head_norm and block (its decoder layer by checkpoint name); their shapes are their
target's (`mtp_layer_config`), so `load_head` reads them only with the target.

orbax is imported on first use: loading a model or generating needs none of it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax._version import __version__
from specjax.checks import is_int
from specjax.models.eagle import EagleConfig, EagleHead, EagleParams
from specjax.models.medusa import MedusaConfig, MedusaHead, MedusaParams
from specjax.models.model import Model
from specjax.models.mtp import TRAINER, MTPLayerParams, MTPLayers, mtp_layer_config
from specjax.models.params import checkpoint_layer_shapes, layer_from_checkpoint, layer_to_checkpoint
from specjax.models.signature import check_signature

HEAD_FILE = "head.json"
CONFIGS = {"medusa": MedusaConfig, "eagle": EagleConfig}  # by head.json's kind


def load_head(path: str | Path, target: Model | None = None):
    """The head in the directory `path`: one specjax saved (`save_head`: head.json), or a published
    one read as it was released (models/head_formats.py: the speculators format's EAGLE-3 and
    DFlash heads, EAGLE-1's and EAGLE-3's original releases, Medusa's, IBM's MLP speculators). With
    `target`, refuse a head that does not belong to it (the head's `check_target`: a head trained
    here, by its target's signature; a published one, by the widths it shares with the target)."""
    from specjax.models.head_formats import read_published_head

    path = Path(path).absolute()
    if not path.is_dir():
        raise ValueError(f"head path {str(path)!r} is not a directory (save one with save_head)")
    if not (path / HEAD_FILE).is_file():
        return read_published_head(path, target)
    head = _read_saved_head(path, target)
    if target is not None:
        head.check_target(target)
    return head


FORMATS = ("specjax", "speculators", "mlp_speculator")


def save_head(path: str | Path, head, format: str | None = None) -> None:
    """Write `head` to the directory `path` (created; an existing head there is replaced).

    format: "specjax" (an orbax checkpoint and head.json; Medusa and EAGLE heads, MTP layers), "speculators"
    (config.json and model.safetensors, which vLLM serves; EAGLE-3 and DFlash heads) or
    "mlp_speculator" (IBM's config.json and safetensors, which vLLM serves; MLP speculators).
    Default: a head's only format (speculators for EAGLE-3 and DFlash, mlp_speculator for MLP
    speculators, specjax for the others)."""
    from specjax.models.dflash import DFlashHead
    from specjax.models.eagle3 import Eagle3Head
    from specjax.models.head_formats import (
        write_mlp_speculator,
        write_speculators_dflash,
        write_speculators_eagle3,
    )
    from specjax.models.mlp_speculator import MLPSpeculatorHead

    if format is not None and format not in FORMATS:
        raise ValueError(f"save_head: format {format!r} is not supported; supported: {', '.join(FORMATS)}")
    is_mlp = isinstance(head, MLPSpeculatorHead)
    if (is_mlp and format not in (None, "mlp_speculator")) or (not is_mlp and format == "mlp_speculator"):
        raise ValueError(
            f"save_head: format {format!r} does not hold a {type(head).__name__}; an MLP speculator is "
            "saved in the mlp_speculator format only, and that format holds nothing else"
        )
    if is_mlp:
        return write_mlp_speculator(Path(path), head)
    if isinstance(head, Eagle3Head | DFlashHead):
        if format == "specjax":
            raise ValueError(f"save_head: a {type(head).__name__} is saved in the speculators format only")
        write = write_speculators_eagle3 if isinstance(head, Eagle3Head) else write_speculators_dflash
        return write(Path(path), head)
    if format == "speculators":
        raise ValueError(
            f"save_head: the speculators format has no {type(head).__name__}; use format='specjax'"
        )
    if isinstance(head, MedusaHead) and (head.config.num_layers > 1 or head.config.own_lm_heads):
        raise ValueError(
            "save_head: a released Medusa head (several blocks, LM heads of its own) is kept in its "
            "release's folder; load it from there"
        )
    _save_specjax(path, head)


def _save_specjax(path: str | Path, head: MedusaHead | EagleHead | MTPLayers) -> None:
    import orbax.checkpoint as ocp

    kinds = {MedusaHead: "medusa", EagleHead: "eagle", MTPLayers: "mtp"}
    kind = kinds.get(type(head))
    if kind is None:
        raise ValueError(
            "head must be a specjax.models.MedusaHead, EagleHead, Eagle3Head, DFlashHead, "
            f"MLPSpeculatorHead or MTPLayers, got {type(head).__name__}"
        )
    path = Path(path).absolute()  # orbax wants absolute paths
    # EAGLE's rope_scaling: a dict or None; MTP layers: their count (their shapes are the target's)
    config = {"num_layers": len(head.layers)} if kind == "mtp" else dataclasses.asdict(head.config)
    metadata = {
        "kind": kind,
        "config": config,
        "target": head.target,
        "meta": head.meta,
        "specjax_version": __version__,
    }
    try:
        text = json.dumps(metadata, indent=2)
    except TypeError as e:
        raise ValueError(f"head.meta must hold JSON values only (numbers, strings, lists, dicts): {e}") from e
    path.mkdir(parents=True, exist_ok=True)
    if kind == "mtp":
        arrays = _mtp_arrays(head)
    else:
        arrays = _eagle_arrays(head) if kind == "eagle" else {"w": head.params.w, "b": head.params.b}
    if kind != "mtp":  # Medusa and EAGLE heads draft over a vocabulary of their own
        arrays["vocab"] = np.asarray(head.vocab, np.int32)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / "params", jax.tree.map(np.asarray, arrays), force=True)
    (path / HEAD_FILE).write_text(text + "\n")


def _read_saved_head(path: Path, target: Model | None) -> MedusaHead | EagleHead | MTPLayers:
    """A head written by `save_head`, of any kind (MTP layers only with their `target`)."""
    import orbax.checkpoint as ocp

    meta_file = path / HEAD_FILE
    if not meta_file.is_file() or not (path / "params").is_dir():
        raise ValueError(f"{str(path)!r} is not a saved head: it has no {HEAD_FILE} and params/")
    try:
        metadata = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(meta_file)!r} is not valid JSON: {e}") from e
    kind = metadata.get("kind") if isinstance(metadata, dict) else None
    if kind == "mtp":
        return _read_mtp_layers(path, metadata, target)
    if kind not in CONFIGS:
        raise ValueError(f"{str(path)!r} holds a head of kind {kind!r}, expected 'medusa', 'eagle' or 'mtp'")
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
        return MedusaHead(config=config, params=MedusaParams(**arrays), **about)
    layer = layer_from_checkpoint(arrays["layer"], config.layer_config)
    return EagleHead(config=config, params=EagleParams(arrays["fc"], arrays["fc_bias"], layer), **about)


def _eagle_arrays(head: EagleHead) -> dict:
    params = head.params
    layer = layer_to_checkpoint(params.layer, head.config.layer_config)
    return {"fc": params.fc, "fc_bias": params.fc_bias, "layer": layer}


def _mtp_arrays(head: MTPLayers) -> dict:
    config = head.config
    own = ("enorm", "hnorm", "eh_proj", "head_norm")
    return {
        "layers": {
            str(j): {name: getattr(layer, name) for name in own}
            | {"block": layer_to_checkpoint(layer.block, config)}
            for j, layer in enumerate(head.layers)
        }
    }


def _read_mtp_layers(path: Path, metadata: dict, target: Model | None) -> MTPLayers:
    """MTP layers written by `save_head`, shaped as `target`'s MTP blocks (checked against it
    first: the shapes come from it)."""
    import orbax.checkpoint as ocp

    if target is None:
        raise ValueError(
            f"{str(path)!r} holds MTP layers: load them with their target, load_head(path, target)"
        )
    num_layers = metadata.get("config", {}).get("num_layers")
    if not is_int(num_layers) or num_layers < 1:
        raise ValueError(f"{str(path / HEAD_FILE)!r} has no valid num_layers, got {num_layers!r}")
    signature = metadata.get("target", {})
    check_signature("MTP", signature, target, TRAINER)
    config = mtp_layer_config(target.config)
    D, dtype = config.hidden_size, target.params.embed.dtype

    def like(shape):
        return _on_first_device(shape, dtype)

    block = {name: like(shape) for name, shape in checkpoint_layer_shapes(config).items()}
    one = {"enorm": like((D,)), "hnorm": like((D,)), "eh_proj": like((2 * D, D)), "head_norm": like((D,))}
    abstract = {"layers": {str(j): one | {"block": block} for j in range(num_layers)}}
    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(path / "params", abstract)["layers"]
    layers = []
    for j in range(num_layers):
        fields = dict(arrays[str(j)])
        fields["block"] = layer_from_checkpoint(fields["block"], config)
        layers.append(MTPLayerParams(**fields))
    return MTPLayers(config, tuple(layers), signature, metadata.get("meta", {}))


def _on_first_device(shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    """An array of `shape` and `dtype` on the first device, for orbax to restore into."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def _abstract_arrays(config: MedusaConfig | EagleConfig, has_vocab: bool) -> dict:
    """The shapes and dtypes `save_head` wrote for a head of `config`, on the first device."""
    like = _on_first_device

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
