"""How much device memory a model and its KV cache take, before anything is loaded: what a user
needs for an 8B or a 70B model with a given cache, per device of a mesh.

The figures follow from the same tables the library places and allocates with: every weight's
shape (`models.params.param_shapes`) divided over the mesh axes its PartitionSpec splits it on
(`sharding.param_specs`), and the cache's layout (`models.cache`), split by rows over "data" and
by kv heads over "model". docs/models.md calls `estimate_memory` for its tables. With
`quantization` ("int8", "int4", "fp8"), the projections and the LM head count at their quantized
size (models/quantized.py: the integers or FP8 values, and a float32 scale, and for int4 an
offset, per group).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax import sharding
from specjax.checks import check_int
from specjax.models.checkpoint import dtype_name, flatten
from specjax.models.config import LlamaConfig
from specjax.models.params import param_shapes
from specjax.models.quantized import FP8_BLOCK, PROJECTIONS, check_quantization
from specjax.sharding.mesh import DATA, MODEL
from specjax.sharding.specs import MODEL_AXES


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (the most loaded one)."""

    weights: int  # the model's weights
    kv_cache: int  # the target's KV cache for the batch
    logits: int  # one verify pass's float32 logits and probabilities (target and draft)
    data: int  # mesh degrees the estimate is for
    model: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.logits

    def summary(self) -> dict[str, float]:
        """The figures in GiB, for a table."""
        gib = 1 << 30
        return {
            "weights_gib": self.weights / gib,
            "kv_cache_gib": self.kv_cache / gib,
            "logits_gib": self.logits / gib,
            "total_gib": self.total / gib,
        }


def estimate_memory(
    config: LlamaConfig,
    batch_size: int,
    max_len: int,
    dtype: Any = "bfloat16",
    mesh: Any = None,
    cache_dtype: Any = None,
    num_speculative_tokens: int = 0,
    quantization: str | None = None,
    group_size: int | None = None,
) -> MemoryEstimate:
    """Device memory per device for `config` in `dtype` decoding `batch_size` rows of up to
    `max_len` tokens (prompt and output; the cache holds that many slots per row).

    mesh: None (one device), a jax Mesh from `specjax.sharding.make_mesh`, or the degrees as a
        dict {"data": d, "model": m}, to plan for devices this machine does not have.
    cache_dtype: default `dtype`. num_speculative_tokens: k, for the verify pass's logits.
    quantization: None, "int8", "int4" (groups of `group_size`, default 32) or "fp8" (an FP8
        checkpoint as released, or float weights quantized to its 128 x 128 blocks: 1 byte per
        weight and a float32 scale per 128 rows of a column), as `specjax.load(quantization=...)`
        makes them: the projections and the LM head quantized (a tied head adds its quantized copy
        beside the float embedding). A GGUF's own blocks ("gguf") are refused: a file mixes types
        per tensor (Q4_K_M keeps some in Q6_K; SmolLM2's Q4_1 file its head in Q8_0), so one named
        type would misstate it; load the file and count them (`specjax.models.quantized.nbytes`).
    """
    itemsize = jnp.dtype(dtype_name(dtype)).itemsize
    if quantization == "gguf":
        raise ValueError(
            "estimate_memory: quantization='gguf' depends on the file's own types, tensor by tensor; pass "
            "None, 'int8', 'int4' or 'fp8', or load the file and count its weights "
            "(specjax.models.quantized.nbytes)"
        )
    try:
        group = check_quantization(quantization, group_size)
    except ValueError as error:
        raise ValueError(f"estimate_memory: {error}") from None
    cache_size = jnp.dtype(dtype_name(cache_dtype or dtype)).itemsize
    for name, value in (("batch_size", batch_size), ("max_len", max_len)):
        check_int(f"estimate_memory: {name}", value, 1)
    degrees = _degrees(mesh)
    data, model = degrees[DATA], degrees[MODEL]
    split_kv = not config.kv_lora_rank  # a latent cache is whole on every device of a model group
    if model > 1 and ((split_kv and config.num_kv_heads % model) or config.num_heads % model):
        raise ValueError(
            f"estimate_memory: a model degree of {model} does not divide the {config.num_heads} query "
            f"and {config.num_kv_heads} kv heads"
        )
    shapes, specs = flatten(param_shapes(config)), flatten(sharding.param_specs(config))
    if quantization is not None and config.tie_word_embeddings:  # the head's quantized copy
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
        specs["lm_head"] = sharding.logical_to_spec(MODEL_AXES["lm_head"])
    weights = 0
    for name, shape in shapes.items():
        short = name.rsplit(".", 1)[-1]
        if quantization is not None and (short in PROJECTIONS or name == "lm_head"):
            weights += _quantized_bytes(shape, quantization, group, specs[name], degrees)
        else:
            weights += math.prod(shape) // _split(specs[name], degrees) * itemsize
    rows = -(-batch_size // data)
    per_token = config.cache_token_size // (model if split_kv else 1)
    kv_cache = config.num_layers * rows * per_token * max_len * cache_size
    logits = 3 * rows * (num_speculative_tokens + 1) * config.vocab_size * 4
    return MemoryEstimate(weights, kv_cache, logits, data, model)


def _quantized_bytes(shape, kind: str, group: int | None, spec: P, degrees: dict[str, int]) -> int:
    """Bytes per device of a weight [..., D_in, D_out] quantized `kind`: int8, FP8 or 4-bit values
    split as the weight, float32 scales (and int4's offsets) per group, replicated along D_in where
    one group spans the rows (int8) split over devices (sharding.specs.quantized_spec)."""
    *lead, d_in, d_out = shape
    bits, group, fields = {
        "int8": (8, d_in, 1),
        "int4": (4, group, 2),
        "fp8": (8, math.gcd(d_in, FP8_BLOCK[1]), 1),  # models/quantized.py, `from_fp8`
    }[kind]
    values = math.prod(shape) * bits // 8 // _split(spec, degrees)
    groups = math.prod(lead) * (d_in // group) * d_out * fields
    rows = tuple(spec)[len(lead)] if len(tuple(spec)) > len(lead) else None
    row_parts = _split(P(rows), degrees) if rows is not None else 1
    scale_split = (
        _split(spec, degrees) if d_in // group % row_parts == 0 else _split(spec, degrees) // row_parts
    )
    return values + groups * 4 // scale_split


def _degrees(mesh) -> dict[str, int]:
    if mesh is None:
        return {DATA: 1, MODEL: 1}
    if isinstance(mesh, dict):
        unknown = set(mesh) - {DATA, MODEL}
        if unknown or not all(isinstance(v, int) and v >= 1 for v in mesh.values()):
            raise ValueError(
                f"estimate_memory: mesh as a dict gives positive degrees for {DATA!r} and {MODEL!r}, "
                f"got {mesh!r}"
            )
        return {DATA: mesh.get(DATA, 1), MODEL: mesh.get(MODEL, 1)}
    sharding.check_mesh(mesh)
    return {DATA: sharding.data_degree(mesh), MODEL: sharding.model_degree(mesh)}


def _split(spec: P, degrees: dict[str, int]) -> int:
    """How many devices share one copy of a weight with this PartitionSpec."""
    parts = 1
    for axis in jax.tree.leaves(tuple(spec)):
        parts *= degrees.get(axis, 1)
    return parts
