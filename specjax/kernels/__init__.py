"""CPU kernels for decoding: weight products over a few rows, and attention to a cache's slots.

A decoding step multiplies one row per sequence (or the k+1 rows of a verify pass) by every weight
matrix, so its speed is the speed at which the weights stream from memory. XLA:CPU, and the BLAS
libraries it can call, ran SmolLM2's products at 10-20 GB/s for one row and at half that for 2 to
16 rows, because they repack the weight for each product with several rows. `panel_matmul.cc`
reads a weight stored as column panels (`PanelWeight`) once, front to back, and multiplies every
value it reads into all the rows (measured here: 31-46 GB/s at one row and 30-32 GB/s at six).
`quant_matmul.cc` does the same for int8 and 4-bit weights (specjax.kernels.quantized), which are a
quarter and an eighth of the bytes.
XLA:CPU also computes a decoding step's attention over every slot of the static cache, committed
or not, at a fraction of the bandwidth; `cache_attention.cc` reads each row's committed slots only
(`cache_attention`; with a sliding window, only those inside it), and the model merges in the pass's
own fresh tokens (a one-token pass, whose token is already written, reads its slot too). The
products also take a layer's RMSNorm before them and its residual sum after (`around`), which XLA
would run as small ops between the calls.

The kernels are XLA FFI custom calls, compiled from source with the machine's C++ compiler on
first use (a few seconds) and kept under `$SPECJAX_CACHE/kernels` (default
`~/.cache/specjax/kernels`). A program lowered for the CPU alone uses them (the backend seam,
specjax/kernels/backend.py, decides): `generate` then stores float32 weights as panels
(specjax/kernels/layouts.py, `with_panel_weights`; a dense MLP's gate and up as one,
`GateUpPanels`, as each call costs a few microseconds beside its product), which the seam's
products send to `panel_matmul`, and attention reads the cache through `cache_attention`.
`SPECJAX_CPU_KERNEL=0` turns them off, and where they cannot be built a warning says why and
decoding keeps XLA's own products.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

PANEL = 16  # columns per panel: one 64-byte vector of float32 (kPanel in the source)
SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("panel_matmul.cc", "quant_matmul.cc", "cache_attention.cc")
)
HEADER = Path(__file__).with_name("kernels.h")  # what the sources include
TARGETS = {
    "specjax_panel_matmul": "PanelMatmul",
    # quantized weights in panels (specjax.kernels.quantized), with and without offsets
    "specjax_quant_matmul_int8": "QuantMatmulInt8",
    "specjax_quant_matmul_int8_offsets": "QuantMatmulInt8Offsets",
    "specjax_quant_matmul_int4": "QuantMatmulInt4",
    "specjax_quant_matmul_int4_offsets": "QuantMatmulInt4Offsets",
    "specjax_cache_attention": "CacheAttention",
    "specjax_cache_attention_window": "CacheAttentionWindow",  # with starts [N, R]
    "specjax_cache_attention_paged": "PagedCacheAttention",  # keys and values in pages
    "specjax_cache_attention_paged_window": "PagedCacheAttentionWindow",
}
ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)  # what cache_attention.cc is built for


@flax.struct.dataclass
class PanelWeight:
    """A weight [D_in, D_out] stored as column panels [P, D_in, 16], P = ceil(D_out / 16): panel p
    holds columns 16p .. 16p+15 (the last one zero-padded), one 16-float row per input feature."""

    panels: jax.Array  # [P, D_in, 16]
    d_out: int = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.panels.shape[1], self.d_out)


def pack(w) -> PanelWeight:
    """A weight [D_in, D_out] as panels (a copy; see PanelWeight)."""
    d_in, d_out = w.shape
    num_panels = -(-d_out // PANEL)
    w = jnp.pad(jnp.asarray(w, jnp.float32), ((0, 0), (0, num_panels * PANEL - d_out)))
    return PanelWeight(panels=w.reshape(d_in, num_panels, PANEL).transpose(1, 0, 2), d_out=d_out)


def unpack(w: PanelWeight) -> jax.Array:
    """The weight [D_in, D_out] back from its panels."""
    num_panels, d_in, _ = w.panels.shape
    return w.panels.transpose(1, 0, 2).reshape(d_in, num_panels * PANEL)[:, : w.d_out]


def panel_matmul(
    x: jax.Array,
    w: PanelWeight,
    norm: tuple[jax.Array, float] | None = None,
    residual: jax.Array | None = None,
) -> jax.Array:
    """x [..., D_in] @ w: [..., D_out] in float32, through the kernel. `norm` (weight [D_in], eps)
    and `residual` [..., D_out]: see `around`."""
    require()
    d_in = w.panels.shape[1]
    rows = x.reshape(-1, d_in).astype(jnp.float32)
    out_type = jax.ShapeDtypeStruct((rows.shape[0], w.panels.shape[0] * PANEL), jnp.float32)
    extra, eps = around(rows.shape[0], d_in, w.d_out, norm, residual)
    out = jax.ffi.ffi_call("specjax_panel_matmul", out_type, vmap_method="sequential")(
        rows, w.panels, *extra, eps=eps
    )
    return out[:, : w.d_out].reshape(*x.shape[:-1], w.d_out).astype(x.dtype)


# The norm forms `around` computes (models/norms.py, `rms_norm`): in float32 both are x times its
# inverse RMS, times the weight.
AROUND_NORMS = ("rms", "rms_float32")


def around(
    num_rows: int, d_in: int, d_out: int, norm: tuple[jax.Array, float] | None, residual: jax.Array | None
) -> tuple[list[jax.Array], np.float32]:
    """The operands with which a product kernel does a layer's work on either side of it (XLA
    would run them as small ops of about 1 us each, five a layer: kernels.h, `Around`): the norm
    weight [D_in] (or an empty array) and residual rows [N, D_out] (or an empty array), and the
    attribute eps. `norm` (weight, eps): the N input rows are RMS-normed first, Llama's form (x
    times 1/sqrt(mean(x^2) + eps), then times the weight, in float32: the forms AROUND_NORMS of
    `models.norms.rms_norm`); `residual` [..., D_out]: added to the product."""
    empty = jnp.zeros((0,), jnp.float32)
    weight, eps = (empty, 0.0) if norm is None else norm
    if norm is not None and jnp.shape(weight) != (d_in,):
        raise ValueError(
            f"norm: weight of shape {jnp.shape(weight)}; allowed: ({d_in},), the input's features"
        )
    if residual is not None and math.prod(jnp.shape(residual)) != num_rows * d_out:
        raise ValueError(
            f"residual of shape {jnp.shape(residual)}; allowed: {num_rows} rows of the product's {d_out} "
            "columns"
        )
    rows = empty if residual is None else residual.reshape(num_rows, d_out).astype(jnp.float32)
    return [weight.astype(jnp.float32), rows], np.float32(eps)


def cache_attention(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    lengths: jax.Array,
    starts: jax.Array | None = None,
    *,
    layer: None = None,
    pages: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of queries [N, R, E] (already scaled) to the first lengths[n] slots of cache
    entry n: keys [N, E, S], values [N, S, E] (the KVCache's layouts), lengths [N] int32.

    starts [N, R] int32 (a sliding window: a query at position p with window W starts at
    p - W + 1): query r of entry n sees only slots max(starts[n, r], 0) .. lengths[n] - 1. Slots
    below every row's start are never read; None (every row from slot 0) runs the kernel without
    the masking.

    Returns the output [N, R, E] and each query's log-sum-exp of its scores [N, R] (minus infinity
    where a query sees no slot, lengths[n] 0 or its start at or past lengths[n], with output 0), so
    that a caller can merge more keys into the same softmax. Float32; E one of
    ATTENTION_HEAD_DIMS. No gradient.

    layer: None only. The backend's Pallas kernels (specjax.kernels.attention) take a stacked
    cache and a layer; a CPU program never holds a stacked cache, and this kernel refuses a layer
    rather than ignore it.

    pages [B, W] int32 (a paged cache, models/cache.py KVCache.pages): keys [M, E, P] and values
    [M, P, E] are pools of pages, entry p*K + h page p's kv head h (K = N / B), and slot s of
    entry n (row n // K, head n % K) is slot s % P of page pages[n // K, s // P]. The kernel reads
    each page's visible slots where they are (a block per page); nothing is gathered.
    """
    if layer is not None:
        raise ValueError(
            f"cache_attention: layer is {layer!r}; allowed: None (the CPU kernel reads one layer's "
            "cache, keys [N, E, S] and values [N, S, E], not a stacked one)"
        )
    require()
    N, R, E = queries.shape
    if E not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"cache_attention: head_dim {E} is not one of {ATTENTION_HEAD_DIMS}")
    out_types = (
        jax.ShapeDtypeStruct((N, R, E), jnp.float32),
        jax.ShapeDtypeStruct((N, R), jnp.float32),
    )
    f32 = jnp.float32
    args = [queries.astype(f32), keys.astype(f32), values.astype(f32), lengths.astype(jnp.int32)]
    target = "specjax_cache_attention"
    if pages is not None:
        if jnp.ndim(pages) != 2 or N % jnp.shape(pages)[0]:
            raise ValueError(
                f"cache_attention: pages has shape {jnp.shape(pages)}, not [B, W] with N = {N} = B * K"
            )
        args.append(jnp.asarray(pages).astype(jnp.int32))
        target = "specjax_cache_attention_paged"
    if starts is not None:
        if jnp.shape(starts) != (N, R):
            raise ValueError(f"cache_attention: starts has shape {jnp.shape(starts)}, not [N, R] = {(N, R)}")
        args.append(jnp.asarray(starts).astype(jnp.int32))
        target += "_window"
    return jax.ffi.ffi_call(target, out_types, vmap_method="sequential")(*args)


def require() -> None:
    """Raise, at trace time, where the kernels cannot be loaded (rather than XLA's 'no FFI
    handler' when the program runs)."""
    if not available():
        raise RuntimeError(
            "specjax: the CPU kernels are not available (see the warning above); use plain weights "
            "(not specjax.kernels.layouts.with_panel_weights) on this machine"
        )


def enabled() -> bool:
    """Whether a CPU program may use the kernels: they load, and SPECJAX_CPU_KERNEL is not 0.
    Which programs are CPU programs is the backend seam's choice (specjax/kernels/backend.py)."""
    if os.environ.get("SPECJAX_CPU_KERNEL", "1") == "0":
        return False
    return available()


@functools.cache
def available() -> bool:
    """Build (once per source, jax version and CPU) and register the kernels; False, with a warning
    that says why, where that fails."""
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
        detail = getattr(error, "stderr", None) or error
        warnings.warn(
            f"specjax: the CPU decoding kernel could not be built or loaded ({detail}); decoding "
            "uses XLA's products, about half as fast on the CPU. Set CXX to a C++17 compiler to "
            "enable it, or SPECJAX_CPU_KERNEL=0 to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return True


def _build() -> Path:
    """The kernels' shared library, compiled into the cache folder unless already there. Built
    for this machine's instruction set (-march=native), so the key holds the CPU's feature flags
    too: a home folder shared by machines of different CPUs keeps one library for each."""
    key = hashlib.sha256()
    for source in (*SOURCES, HEADER):
        key.update(source.read_bytes())
    key.update(jax.__version__.encode() + _cpu_features().encode())
    root = Path(os.environ.get("SPECJAX_CACHE") or Path.home() / ".cache" / "specjax").expanduser()
    library = root / "kernels" / f"specjax_kernels-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    compiler = _compiler()
    # Built under a temporary name and renamed: concurrent first uses (test workers) never load
    # a half-written file.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        partial = Path(scratch) / library.name
        command = [compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]
        command += [f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(partial)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(partial, library)
    return library


def _compiler() -> str:
    """The C++ compiler the kernels are built with: $CXX, else g++ or c++ from the PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"


def _cpu_features() -> str:
    """The machine's architecture, with the CPU's model and feature flags where Linux reports them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return platform.machine() + "".join(sorted({line for line in lines if line.startswith(wanted)}))
