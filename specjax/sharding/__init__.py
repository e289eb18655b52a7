"""Tensor and data parallelism: the ("data", "model") mesh, partition specs for params and KV
caches from one table of logical axes, and the model's forward under `jax.shard_map`.

    mesh = specjax.sharding.make_mesh(model=2, data=4)
    model = specjax.load("smollm2-135m", mesh=mesh)
    result = specjax.generate(model, prompts, mesh=mesh)

See docs/scaling.md for memory and traffic per device.
"""

from specjax.sharding.forward import (
    mesh_dense,
    mesh_entries_by_row,
    mesh_forward_hidden,
    mesh_move_slots,
    mesh_write,
)
from specjax.sharding.mesh import (
    AXES,
    DATA,
    MODEL,
    check_batch_split,
    check_mesh,
    check_model_split,
    data_degree,
    make_mesh,
    model_degree,
    row_mesh,
)
from specjax.sharding.processes import CallAgreement, mesh_fingerprint, spans_processes
from specjax.sharding.specs import (
    RULES,
    cache_specs,
    cache_specs_like,
    entry_blocks,
    fetch,
    logical_to_spec,
    param_placer,
    param_specs,
    place,
    replicate,
    row_spec,
    shard_params,
    shard_rows,
    slice_placer,
)

__all__ = [
    "AXES",
    "CallAgreement",
    "DATA",
    "MODEL",
    "RULES",
    "cache_specs",
    "cache_specs_like",
    "entry_blocks",
    "check_batch_split",
    "check_mesh",
    "check_model_split",
    "data_degree",
    "fetch",
    "logical_to_spec",
    "make_mesh",
    "mesh_dense",
    "mesh_entries_by_row",
    "mesh_fingerprint",
    "mesh_forward_hidden",
    "mesh_move_slots",
    "mesh_write",
    "model_degree",
    "param_placer",
    "place",
    "param_specs",
    "row_mesh",
    "row_spec",
    "replicate",
    "shard_params",
    "shard_rows",
    "slice_placer",
    "spans_processes",
]
