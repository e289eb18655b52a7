"""The backend seam: which kernels and which tuning a program runs, chosen by the platforms it is
lowered for.

A generation program is traced once for the platforms it will run on: the CPU (`generate` on a
CPU host), a GPU or a TPU (`generate` there), or several at once (`export_generate`, which lowers
for CUDA and TPU from any host). This module is the one place that knows what each platform
gets; model code asks it (`active()`) and holds no platform checks of its own. What model code
asks is the section "what model code asks" of `Backend`: its products (`project`,
`gated_projections`, `logits`, through models/products.py), the attention kernels of a pass
(`cache_attention`, `prefill_attention`, asked once per pass by models/passes.py, `plan_pass`),
how a mixture runs its experts (`experts_one_by_one`) and how the cache writes
(`unrolled_cache_writes`). The platforms get:

- "cpu": the C++ FFI kernels of specjax.kernels (weights stored as panels, attention to each
  row's committed slots) where they load, and the XLA:CPU tuning measured on this project's
  machine (products split into halves, per-row cache writes, a barrier on the tied head, experts
  one by one).
- "cuda" and "tpu": Pallas kernels for attention (specjax.kernels.attention: decoding reads only
  each row's filled KV blocks, prefill is blocked flash attention) and for the products of int8
  and 4-bit weights (specjax.kernels.pallas_quantized: the integers unpacked in registers), plain
  XLA for the other products; FP8 weights as XLA's FP8 products where the GPU has them
  (`fp8_products`).
- kernels="xla": plain XLA attention and products on every platform, the fallback anything can
  run.

The choice is a `Backend`, a frozen value: `LoopSpec` carries it, so equal programs share one
compilation, and `Backend.tracing()` makes it the active one while a program is traced. Its
context is a jax user context, part of jit's cache key: a function jitted under two backends is
traced for each. With no program being traced under one (a model called directly, training) the
active backend is plain XLA on the default platform.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator

import jax
import jax.extend
import jax.interpreters.mlir
import jax.numpy as jnp

from specjax import kernels as cpu_kernels
from specjax.kernels import layouts
from specjax.kernels.quantized import (
    QuantizedPanelWeight,
    QuantizedWeight,
    fp8_product,
    is_fp8,
    quantized_panel_matmul,
    xla_product,
)

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # names jax.export lowers for
ACCELERATORS = ("cuda", "tpu")  # the platforms with Pallas kernels here
# kernels=: "auto" (each platform's own), "xla" (plain XLA everywhere), or "pallas:tpu" /
# "pallas:cuda": that accelerator's Pallas kernels, in interpret mode where the program does not
# run on that accelerator (how their numerics are checked on a CPU host).
KERNEL_CHOICES = ("auto", "xla", "pallas:tpu", "pallas:cuda")
PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")

_ACTIVE = jax.make_user_context(default_value=None)


@dataclasses.dataclass(frozen=True)
class Backend:
    """How a program computes: for which platforms it is lowered, which kernels it uses and at
    which precision float32 products run."""

    platforms: tuple[str, ...] = ("cpu",)
    kernels: str = "auto"  # one of KERNEL_CHOICES
    # jax's matmul precision for the program's products ("highest": float32 products in float32
    # on every platform; None leaves jax's default, e.g. TF32 or bfloat16 passes on accelerators).
    matmul_precision: str | None = None
    # A program that leaves this process (`export_generate`): no CPU FFI kernels, which are built
    # for this host's processor and registered in this process only.
    portable: bool = False
    # A program over a mesh (its forward under shard_map): the CPU kernels stay off there, as the
    # panel weights have no sharding rule.
    sharded: bool = False
    # Whether the decoder layers run as a loop over stacked weights (models/params.py, LayerStack)
    # rather than unrolled; None: unrolled (see `scans_layers`).
    scan_layers: bool | None = None
    # FP8 weights multiply as FP8 products (`quantized.fp8_product`: XLA's f8 dot, which cuBLASLt
    # runs on FP8 tensor cores), for GPUs that have them (compute capability 8.9 and later:
    # `for_devices` sets it); elsewhere they are converted inside XLA's product, as other weights.
    fp8_products: bool = False

    def __post_init__(self):
        if not self.platforms or any(p not in PLATFORMS for p in self.platforms):
            raise ValueError(f"platforms must be a non-empty tuple of {PLATFORMS}, got {self.platforms!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if self.matmul_precision is not None and self.matmul_precision not in PRECISIONS:
            raise ValueError(
                f"matmul_precision must be one of {PRECISIONS} or None, got {self.matmul_precision!r}"
            )
        if self.scan_layers is not None and not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be True, False or None, got {self.scan_layers!r}")
        if not isinstance(self.fp8_products, bool):
            raise ValueError(f"fp8_products must be True or False, got {self.fp8_products!r}")

    @property
    def cpu_only(self) -> bool:
        """Whether the program runs on the CPU alone (where the CPU tuning applies)."""
        return self.platforms == ("cpu",)

    @property
    def scans_layers(self) -> bool:
        """Whether the decoder layers run as one loop per run of layers of one shape over stacked
        weights and a stacked cache: the program, and its compile time, then stay the same size
        whatever the depth. Off unless asked for (scan_layers=True), on every platform, because
        XLA copies each layer's slice of a stacked weight (dynamic or static) out of the stack
        before multiplying, so a decoding step writes and reads every weight once more: on the
        CPU a SmolLM2-135M step ran 1.8x slower (95 ms against 52 ms per token, measured here;
        and the FFI kernels want each layer's weights as panels), on an H200 a bfloat16
        Llama-3.1-8B-shaped step 11.9 ms scanned against 4.8 ms unrolled (docs/benchmarks.md,
        "The accelerator path on a GPU"). The price of unrolling is compile time and program size
        that grow with depth: scanning is for programs whose size or compile time matters more
        than their speed (an export of a very deep model)."""
        return False if self.scan_layers is None else self.scan_layers

    @property
    def cpu_kernels(self) -> bool:
        """Whether the C++ FFI kernels run: a CPU program with kernels "auto" where they load
        (and SPECJAX_CPU_KERNEL is not 0), its layers unrolled."""
        if not self.cpu_only or self.kernels != "auto" or self.portable or self.sharded:
            return False
        return not self.scans_layers and cpu_kernels.enabled()

    def pallas_platforms(self, head_dim: int | None = None) -> tuple[str, ...]:
        """The platforms whose attention runs Pallas kernels, each by its own kernel, for heads of
        `head_dim` (None: whatever the head dim). With kernels "auto", heads the device kernels are
        not built for (a tiny test model's 16 or 32, outside PALLAS_HEAD_DIMS) attend with plain
        XLA on every platform, as "xla" would; an explicit "pallas:..." keeps the kernels, which
        take such heads in interpret mode only and raise on the device."""
        if self.kernels == "auto":
            accelerators = tuple(p for p in self.platforms if p in ACCELERATORS)
            if (
                accelerators
                and head_dim is not None
                and head_dim not in _attention_kernels().PALLAS_HEAD_DIMS
            ):
                return ()
            return accelerators
        if self.kernels.startswith("pallas:"):
            return self.platforms
        return ()

    def _pallas_kernel_for(self, platform: str) -> tuple[str, bool]:
        """(whose Pallas kernel, interpret?) for a program lowered for `platform`."""
        if self.kernels == "auto":
            return platform, False
        accelerator = self.kernels.removeprefix("pallas:")
        return accelerator, platform != accelerator

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Make this the active backend, with its matmul precision, while a program is traced."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(_ACTIVE(self))
            if self.matmul_precision is not None:
                stack.enter_context(jax.default_matmul_precision(self.matmul_precision))
            yield

    # -- what model code asks ---------------------------------------------------------------

    def project(self, x: jax.Array, w, norm=None, residual=None, reduce=None) -> jax.Array:
        """residual + reduce(norm(x) @ w): a layer's projection of x [..., D_in] by w [D_in, D_out]
        with what comes on either side of it, each part optional. `norm` a models.norms.Norm (its
        weight, eps and form, callable on x); `residual` [..., D_out]; `reduce` the sum of a
        tensor-parallel split's partial products (specjax/sharding), None where there is none.

        Where the product's kernel can do the norm and the residual inside its call (panels,
        `_kernel_takes_around`), they go in: as XLA ops they were five of a one-row step's 24 small
        ops a layer (a norm alone four), about 1 us each. Not with a `reduce`: the residual joins
        the sum, not one slice's product. Elsewhere they are XLA's, as written."""
        if reduce is None and _kernel_takes_around(x, w, norm):
            kernel_norm = None if norm is None else (norm.weight, norm.eps)
            return self.matmul(x, w, norm=kernel_norm, residual=residual)
        if norm is not None:
            x = norm(x)
        out = self.matmul(x, w)
        if reduce is not None:
            out = reduce(out)
        return out if residual is None else residual + out

    def gated_projections(self, x: jax.Array, gate, up, norm=None) -> tuple[jax.Array, jax.Array]:
        """(norm(x) @ gate, norm(x) @ up), a gated MLP's two products over x [..., D] (`norm` as in
        `project`): one kernel call where the weights are stored as one (layouts.GateUpPanels, in
        `gate`; `up` is None then), else two products."""
        if isinstance(gate, layouts.GateUpPanels):
            return gate.split(self.project(x, gate.both, norm=norm))
        return self.project(x, gate, norm=norm), self.project(x, up, norm=norm)

    def logits(self, rows: jax.Array, params) -> jax.Array:
        """rows [N, D] @ the LM head of `params` (a models.params.LlamaParams) -> [N, V] float32:
        its panel copy where `layouts.with_panel_weights` made one, its own head (an array or
        quantized), else the tied embedding (`head_product`)."""
        if params.head_panels is not None:
            return self.product_f32(rows, params.head_panels)
        if params.lm_head is None:
            return self.head_product(rows, params.embed)
        return self.product_f32(rows, params.lm_head)

    def matmul(self, x: jax.Array, w, norm=None, residual=None) -> jax.Array:
        """x [..., D_in] @ w [D_in, D_out] (`w` an array, panels for the CPU kernels: float32 ones
        or quantized ones, or a QuantizedWeight: its integers dequantized inside the product,
        `quantized.xla_product`). `norm` (weight [D_in], eps) and `residual` [..., D_out]: for
        panels only (`project` decides), see `specjax.kernels.around`.

        On the CPU, one or two rows (a batch of one decoding, or a verify pass with k = 1) go as
        two half-products over the two halves of D_in, summed, one row at a time: XLA:CPU runs
        that batched product on both cores where it ran the plain 1-row product on one (measured
        here: a [576, 576] product 65 -> 40 us; SmolLM2's plain step at 760 cached tokens 26.7 ->
        24.0 ms; a k = 1 verify step 36.6-41.5 -> 28.7-31.6 ms). From three rows on it gained
        nothing. Elsewhere, and in bfloat16 (the sum of halves would round twice), the plain
        product.
        """
        if isinstance(w, cpu_kernels.PanelWeight):
            return cpu_kernels.panel_matmul(x, w, norm, residual)
        if isinstance(w, QuantizedPanelWeight):
            return quantized_panel_matmul(x, w, norm, residual).astype(x.dtype)
        if norm is not None or residual is not None:
            raise ValueError(f"matmul: norm and residual are for panel weights only, not {type(w).__name__}")
        if isinstance(w, QuantizedWeight):
            return self.quantized_product(x, w)
        rows = math.prod(x.shape[:-1])
        d_in, d_out = w.shape
        if not self.cpu_only or not 0 < rows <= 2 or d_in % 2 or w.dtype != jnp.float32:
            return x @ w
        w_halves = w.reshape(2, d_in // 2, d_out)
        flat = x.reshape(rows, 2, 1, d_in // 2)
        out = [jnp.einsum("hre,hed->hrd", flat[r], w_halves).sum(0) for r in range(rows)]
        return jnp.concatenate(out, 0).reshape(*x.shape[:-1], d_out)

    @property
    def quantized_product_form(self) -> str:
        """How a QuantizedWeight's product is written for XLA (`quantized.xla_product`): its
        integers converted inside the product on accelerators, where XLA:GPU fuses that and not
        the whole dequantization (an int8 [4096, 14336] product at one row 159 -> 78 us, int4 244
        -> 143 us on an H200); dequantized first on the CPU, the faster there."""
        return "dequantize" if self.cpu_only else "in_product"

    def product_f32(self, x: jax.Array, w) -> jax.Array:
        """x [N, D_in] @ w [D_in, D_out] accumulated and returned in float32 (an LM head's
        logits): panels through the CPU kernels, a QuantizedWeight through `xla_product`, else one
        plain product."""
        if isinstance(w, cpu_kernels.PanelWeight):
            return cpu_kernels.panel_matmul(x, w)
        if isinstance(w, QuantizedPanelWeight):
            return quantized_panel_matmul(x, w)
        if isinstance(w, QuantizedWeight):
            return self.quantized_product(x, w, jnp.float32)
        return jnp.matmul(x, w, preferred_element_type=jnp.float32)

    def quantized_product(self, x: jax.Array, w: QuantizedWeight, out_dtype=None) -> jax.Array:
        """x [..., D_in] @ a QuantizedWeight [D_in, D_out], in `out_dtype` (default x's dtype),
        accumulated in float32: on each platform the program is lowered for, its Pallas kernel
        (`quantized_kernel_for`) where it has one for the weight, else XLA's form
        (`quantized.xla_product`, `quantized_product_form`); FP8 weights as FP8 products where
        `fp8_products`. In a program over a mesh, the kernels run inside its shard_map only."""
        if self.fp8_products and is_fp8(w):
            return fp8_product(x, w, out_dtype)

        # Over a mesh, a Pallas call needs its operands local: inside the forward's shard_map.
        # Outside it (the LM head, which XLA partitions over the vocab) XLA's form runs.
        local = not self.sharded or bool(jax.sharding.get_abstract_mesh().manual_axes)

        def on(platform):
            kernel = self.quantized_kernel_for(platform, w) if local else None
            if kernel is None:
                return functools.partial(xla_product, out_dtype=out_dtype, form=self.quantized_product_form)
            accelerator, interpret = kernel
            return functools.partial(
                _quantized_kernels().quantized_matmul,
                implementation=accelerator,
                interpret=interpret,
                out_dtype=out_dtype,
            )

        runs = {p: on(p) for p in self.platforms}
        if len(set(map(_kernel_key, runs.values()))) == 1:
            return runs[self.platforms[0]](x, w)
        return per_platform(runs, x, w)

    def quantized_kernel_for(self, platform: str, w) -> tuple[str, bool] | None:
        """(whose Pallas kernel, interpret?) that multiplies QuantizedWeight w in a program lowered
        for `platform`, or None for XLA's form: with kernels "auto" the accelerator's own kernel
        on "cuda" and "tpu"; with "pallas:..." that accelerator's, in interpret mode off it; none
        with "xla", and none for a weight the kernel has no tile for
        (`pallas_quantized.unsupported`: a tiny weight on Triton, FP8 values)."""
        if self.kernels == "xla" or (self.kernels == "auto" and platform not in ACCELERATORS):
            return None
        accelerator, interpret = self._pallas_kernel_for(platform)
        if _quantized_kernels().unsupported(w, accelerator, interpret) is not None:
            return None
        return accelerator, interpret

    def head_product(self, rows: jax.Array, embed: jax.Array) -> jax.Array:
        """rows [N, D] @ embed.T (a tied LM head, embed [V, D]) -> [N, V] float32.

        On the CPU, several rows are computed as [V, D] @ [D, N], the embedding's stored layout,
        and transposed after, with a barrier that keeps XLA from folding the transpose back into
        the product, whose [N, V] form ran slower (6 rows of SmolLM2's head: 8.0 -> 6.7 ms, a
        6-token verify step 45.7 -> 42.1 ms, measured here)."""
        if self.cpu_only and rows.shape[0] > 1:
            product = jnp.matmul(embed, rows.T, preferred_element_type=jnp.float32)
            return jax.lax.optimization_barrier(product).T
        return jnp.matmul(rows, embed.T, preferred_element_type=jnp.float32)

    def unrolled_cache_writes(self, batch_size: int, max_rows: int) -> bool:
        """Whether a cache write goes row by row (one dynamic_update_slice per row, which XLA:CPU
        does in place) rather than as one vmapped write (a scatter): on the CPU up to `max_rows`
        rows; elsewhere never (2 x layers x batch small writes per pass cost launches there)."""
        return self.cpu_only and batch_size <= max_rows

    def experts_one_by_one(self) -> bool:
        """Whether a mixture of experts loops over its routed experts (XLA:CPU lowers ragged_dot
        to a masked product over every expert) rather than grouping them with ragged_dot."""
        return self.cpu_only

    def cache_attention(self, head_dim: int, dtype) -> Callable | None:
        """The function that attends to each row's committed cache slots, with the contract of
        `specjax.kernels.cache_attention` (queries [N, R, E], keys [N, E, S], values [N, S, E],
        lengths [N], starts [N, R] or None -> out [N, R, E], lse [N, R]); None where this backend
        has no such kernel and the model attends over the whole cache with XLA, masked.

        Its keyword `layer` (an int or an int32 scalar, traced or not) takes a stacked cache, keys
        [L, N, E, S] and values [L, N, S, E], of which the Pallas kernels read that layer in place
        (`specjax.kernels.attention.cache_attention`); the CPU kernel refuses it."""
        if self.cpu_kernels:
            # The C++ kernel computes in float32: for other dtypes it would convert the cache.
            ok = head_dim in cpu_kernels.ATTENTION_HEAD_DIMS and jnp.dtype(dtype) == jnp.float32
            return cpu_kernels.cache_attention if ok else None
        platforms = self.pallas_platforms(head_dim)
        if not platforms:
            return None
        return functools.partial(_by_platform, self, "cache_attention", platforms)

    def cache_attention_reads_pages(self, head_dim: int, dtype, page_size: int) -> bool:
        """Whether `cache_attention`'s kernel takes a paged cache's pools of pages of `page_size`
        slots and its page tables (keyword `pages`) and reads each row's pages in place: the CPU
        kernel, and the Pallas kernels on every platform the program is lowered for where the page
        is a block they take (a multiple of 128 slots on tpu, a power of two >= 16 on cuda). Where
        it does not, a paged cache's rows are gathered for it."""
        if self.cache_attention(head_dim, dtype) is None:
            return False
        if self.cpu_kernels:
            return True
        power_of_two = page_size >= 16 and page_size & (page_size - 1) == 0
        fits = {"tpu": page_size % 128 == 0, "cuda": power_of_two}
        return all(fits[self._pallas_kernel_for(p)[0]] for p in self.pallas_platforms(head_dim))

    def prefill_attention(self, head_dim: int | None = None) -> Callable | None:
        """The blocked attention of a prefill into an empty cache for heads of `head_dim`, with
        the contract of `specjax.kernels.attention.prefill_attention`, or None where the model's
        own chunked XLA form runs (the CPU, tuned for it)."""
        if self.cpu_only and self.kernels in ("auto", "xla"):
            return None
        platforms = self.pallas_platforms(head_dim)
        if not platforms:
            return functools.partial(_attention_kernels().prefill_attention, implementation="xla")
        return functools.partial(_by_platform, self, "prefill_attention", platforms)


def _kernel_takes_around(x: jax.Array, w, norm) -> bool:
    """Whether the product kernel for weight `w` does a layer's norm before it (a models.norms.Norm,
    or None) and its residual sum after it inside its call: panels (float32 or quantized; see
    specjax.kernels.around) multiplying float32 rows, with a norm of a form the kernels compute."""
    panels = isinstance(w, (cpu_kernels.PanelWeight, QuantizedPanelWeight))
    return panels and x.dtype == jnp.float32 and (norm is None or norm.form in cpu_kernels.AROUND_NORMS)


def _kernel_key(run: functools.partial):
    """What a product of `Backend.quantized_product` runs, to tell whether every platform runs
    the same."""
    return run.func, tuple(sorted(run.keywords.items(), key=lambda item: item[0]))


def _quantized_kernels():
    """specjax.kernels.pallas_quantized, imported when first needed (it imports Pallas)."""
    from specjax.kernels import pallas_quantized

    return pallas_quantized


def _attention_kernels():
    """specjax.kernels.attention, imported when first needed (it imports Pallas)."""
    from specjax.kernels import attention

    return attention


def _by_platform(backend: Backend, name: str, platforms: tuple[str, ...], *args, **kwargs):
    """Kernel `name` of specjax.kernels.attention, each platform the program is lowered for
    running its own Pallas kernel."""
    kernel = getattr(_attention_kernels(), name)

    # Arrays are the kernel's operands (a traced layer among them); the rest (a numpy mask, a
    # window, a Python int layer) shape the kernel itself.
    arrays = {name: value for name, value in kwargs.items() if isinstance(value, jax.Array)}
    static = {name: value for name, value in kwargs.items() if name not in arrays}

    def on(platform):
        accelerator, interpret = backend._pallas_kernel_for(platform)

        def run(args, arrays):
            return kernel(*args, implementation=accelerator, interpret=interpret, **static, **arrays)

        return run

    if len(platforms) == 1:
        return on(platforms[0])(args, arrays)
    return per_platform({p: on(p) for p in platforms}, args, arrays)


# A program lowered for several platforms (export_generate's CUDA and TPU) holds each platform's
# kernel and picks by where it runs. lax.platform_dependent cannot do that for Pallas kernels: it
# lowers every branch for every platform, and a TPU kernel does not lower for CUDA. A primitive
# whose lowering rule is registered per platform is lowered, for each platform, with its own rule
# only (jax emits the switch on the platform).
_per_platform_p = jax.extend.core.Primitive("specjax_per_platform")
_per_platform_p.multiple_results = True


def per_platform(implementations: dict[str, Callable], *args):
    """implementations[p](*args) on platform p (args and results pytrees, the results of the same
    shapes on every platform)."""
    leaves, in_tree = jax.tree.flatten(args)
    out_tree = None

    def on_leaves(function):
        def run(*leaves):
            nonlocal out_tree
            out, out_tree = jax.tree.flatten(function(*jax.tree.unflatten(in_tree, leaves)))
            return out

        return run

    table = tuple(sorted((p, on_leaves(f)) for p, f in implementations.items()))
    out_avals = tuple(jax.eval_shape(table[0][1], *leaves))
    results = _per_platform_p.bind(*leaves, implementations=table, out_avals=out_avals)
    return jax.tree.unflatten(out_tree, results)


def _per_platform_abstract(*args, implementations, out_avals):
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in out_avals]


def _per_platform_lowering(ctx, *args, implementations, out_avals, platform):
    function = dict(implementations).get(platform)
    if function is None:
        raise ValueError(f"no kernel for platform {platform!r}: have {[p for p, _ in implementations]}")
    return jax.interpreters.mlir.lower_fun(function, multiple_results=True)(ctx, *args)


_per_platform_p.def_abstract_eval(_per_platform_abstract)
for _platform in PLATFORMS:
    jax.interpreters.mlir.register_lowering(
        _per_platform_p, functools.partial(_per_platform_lowering, platform=_platform), platform=_platform
    )


def active() -> Backend:
    """The backend of the program being traced (`Backend.tracing`), else plain XLA on the default
    platform."""
    return _ACTIVE.value or _default()


@functools.cache
def _default() -> Backend:
    return Backend(platforms=(default_platform(),), kernels="xla")


def platform_of(device: jax.Device) -> str:
    """The name jax.export uses for a device's platform ("gpu" devices are "cuda" or "rocm")."""
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"


def default_platform() -> str:
    return platform_of(jax.devices()[0])


def for_devices(
    devices,
    kernels: str = "auto",
    matmul_precision: str | None = None,
    sharded: bool = False,
    scan_layers: bool | None = None,
) -> Backend:
    """The backend of a program that runs on `devices` (one platform; `sharded`: over a mesh)."""
    platforms = {platform_of(d) for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"mesh: devices of one platform are needed, got {sorted(platforms)}")
    fp8 = kernels != "xla" and all(has_fp8_products(d) for d in devices)
    return Backend(
        tuple(platforms),
        kernels,
        matmul_precision,
        sharded=sharded,
        scan_layers=scan_layers,
        fp8_products=fp8,
    )


FP8_COMPUTE_CAPABILITY = (8, 9)  # Ada and Hopper on: FP8 tensor cores (cuBLASLt's FP8 matmuls)


def has_fp8_products(device: jax.Device) -> bool:
    """Whether `device` multiplies FP8 matrices natively: an NVIDIA GPU of compute capability 8.9
    or later."""
    if platform_of(device) != "cuda":
        return False
    capability = getattr(device, "compute_capability", None)
    try:
        major, minor = (int(part) for part in str(capability).split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= FP8_COMPUTE_CAPABILITY


def default_precision(dtype: str, matmul_precision: str | None) -> str | None:
    """The matmul precision a generation runs at: the user's, else "highest" for a float32 model
    (its products in float32 on every platform, so that float32 results match the CPU's and
    transformers'), else jax's default for its dtype."""
    if matmul_precision is not None:
        if matmul_precision not in PRECISIONS:
            allowed = f"one of {PRECISIONS} or None"
            raise ValueError(f"matmul_precision must be {allowed}, got {matmul_precision!r}")
        return matmul_precision
    return "highest" if dtype == "float32" else None
