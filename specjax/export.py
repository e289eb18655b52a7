"""`export_generate`: the whole generation program lowered for other platforms (a GPU, a TPU) from
any host, to serialize here and run there.

The program is the one `generate` compiles on the accelerator itself (specjax/planner.py `plan`):
the same loop, with the kernels the backend seam (specjax/kernels/backend.py) gives those platforms, so
Pallas attention on "cuda" and "tpu" and never the CPU's FFI kernels, which are built for this
host. Lowered for several platforms at once, the program holds each platform's kernels and picks
by where it runs.

Its arguments are flat: the leaves of (params, proposer params, inputs) as `export_arguments`
makes them, so that a serialized program needs no pytree registrations to be read back. It
returns (tokens [B, S] int32: each row's prompt then its new tokens, lengths [B] int32: where
each row's tokens end); a row's new tokens are tokens[b, len(prompt_b) : lengths[b]]. B is the
batch padded to its bucket (`generate`'s batch_buckets): rows past the prompts are padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from specjax import planner
from specjax.kernels.backend import PLATFORMS
from specjax.speculate.loop import generate_program


def export_generate(
    model,
    prompts,
    *,
    platforms: Sequence[str] = ("cuda", "tpu"),
    proposer=None,
    sampling=None,
    max_new_tokens: int = 128,
    key: jax.Array | None = None,
    chat: bool = False,
    mesh=None,
    cache_dtype=None,
    kernels: str = "auto",
    matmul_precision: str | None = None,
    batch_buckets=None,
    scan_layers: bool | None = None,
    page_size: int | None = None,
) -> jax.export.Exported:
    """The generation `generate(model, prompts, ...)` would run, lowered for `platforms` (names
    jax.export knows: "cpu", "cuda", "rocm", "tpu"). Every other argument is `generate`'s. Run
    the program with the jax version that exported it (its CUDA kernels are Triton calls, whose
    serialized form jax keeps no compatibility for).

    Run it on a machine of one of those platforms with the arguments `export_arguments` makes
    from the same model, prompts and options::

        exported = specjax.export_generate(model, prompts, platforms=("cuda",), max_new_tokens=64)
        blob = exported.serialize()                    # bytes: save them, send them
        ...                                            # on the GPU machine:
        program = jax.export.deserialize(blob)
        tokens, lengths = program.call(*specjax.export_arguments(model, prompts, max_new_tokens=64))
    """
    platforms = _check_platforms(platforms)
    prepared = _prepare(model, prompts, platforms, locals())
    leaves, treedef = jax.tree.flatten((prepared.params, prepared.proposer_params, prepared.inputs))
    spec = prepared.spec

    def program(*leaves):
        params, proposer_params, inputs = jax.tree.unflatten(treedef, leaves)
        state = generate_program(spec, params, proposer_params, inputs)
        return state.tokens, state.lengths

    # The Pallas kernels for CUDA are Triton custom calls, which jax.export refuses by default: it
    # promises no compatibility of their serialized form across jax versions. Run the program
    # with the jax version that exported it.
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    return jax.export.export(jax.jit(program), platforms=platforms, disabled_checks=[triton])(*leaves)


def export_arguments(
    model,
    prompts,
    *,
    platforms: Sequence[str] = ("cuda", "tpu"),
    proposer=None,
    sampling=None,
    max_new_tokens: int = 128,
    key: jax.Array | None = None,
    chat: bool = False,
    mesh=None,
    cache_dtype=None,
    kernels: str = "auto",
    matmul_precision: str | None = None,
    batch_buckets=None,
    scan_layers: bool | None = None,
    page_size: int | None = None,
) -> list[jax.Array]:
    """The flat arguments of the program `export_generate` made with the same arguments."""
    platforms = _check_platforms(platforms)
    prepared = _prepare(model, prompts, platforms, locals())
    return jax.tree.leaves((prepared.params, prepared.proposer_params, prepared.inputs))


_OPTIONS = (
    "proposer",
    "sampling",
    "max_new_tokens",
    "key",
    "chat",
    "mesh",
    "cache_dtype",
    "kernels",
    "matmul_precision",
    "batch_buckets",
    "scan_layers",
    "page_size",
)


def _prepare(model, prompts, platforms, arguments: dict) -> planner.Plan:
    return planner.plan(model, prompts, **{name: arguments[name] for name in _OPTIONS}, platforms=platforms)


def _check_platforms(platforms) -> tuple[str, ...]:
    if isinstance(platforms, str):
        platforms = (platforms,)
    platforms = tuple(platforms)
    if not platforms or any(p not in PLATFORMS for p in platforms) or len(set(platforms)) < len(platforms):
        raise ValueError(
            f"platforms must be a non-empty sequence of distinct names from {PLATFORMS}, got {platforms!r}"
        )
    return platforms
