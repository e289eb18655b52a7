"""The CPU kernels' weight layouts: a model's projections stored as panels for decoding on the CPU
(`with_panel_weights`), and a gated MLP's gate and up as one panel weight (`GateUpPanels`).

`generate` on a CPU host stores a float32 model's weights this way once (specjax/api.py), and
the backend seam (specjax/kernels/backend.py) sends products with them to the kernels
(`panel_matmul`, `quantized_panel_matmul`). Model code never sees these layouts: it asks the seam
for products (`Backend.project`, `gated_projections`, `logits`).

The functions here take a model's params by their fields (`specjax.models.params`: a
`LlamaParams`, its `LayerParams`), without importing them: model code imports the seam, and the
seam imports no model code.

Einsum letters: D hidden, F ffw hidden, V vocab; D_in, D_out a weight's input and output features.
"""

from __future__ import annotations

from typing import TypeVar

import flax.struct
import jax
import jax.numpy as jnp

from specjax.kernels import PANEL, PanelWeight, pack
from specjax.kernels.quantized import (
    QuantizedPanelWeight,
    QuantizedWeight,
    dequantize,
    is_fp8,
    pack_quantized,
)

Params = TypeVar("Params")  # a LlamaParams (or a head's params holding LayerParams)
Layer = TypeVar("Layer")  # a LayerParams

# The projections of a decoder layer (LayerParams fields) that decoding on the CPU multiplies as
# panels. A mixture of experts' weights stay as they are (models/mlp.py, moe_mlp).
PANEL_FIELDS = ("qkv", "o", "gate", "up", "down")


def with_panel_weights(params: Params) -> Params:
    """The same model (a LlamaParams) with every layer's projection weights stored as panels
    (specjax.kernels), which the backend's products multiply with the CPU decoding kernel, and a
    panel copy of the LM head in `head_panels` (the [V, D] embedding stays for token lookups). For
    inference on the CPU only: the kernel has no gradient and no sharding rule, and it computes
    in float32 (`generate` packs float32 models only). Quantized weights (QuantizedWeight) become
    quantized panels, multiplied by the quantized kernel."""
    layers = tuple(panel_layer(layer) for layer in params.layers)
    head = params.embed.T if params.lm_head is None else params.lm_head
    return params.replace(layers=layers, head_panels=pack_panels(head))


def panel_layer(layer: Layer) -> Layer:
    """One layer (a LayerParams) with its projection weights as panels (see
    `with_panel_weights`); a trained head's layers take the same form for drafting on the CPU. A
    dense MLP's gate and up become one panel weight where they are stored alike (GateUpPanels, in
    `gate`; `up` is None)."""
    packed = {
        name: pack_panels(getattr(layer, name)) for name in PANEL_FIELDS if getattr(layer, name) is not None
    }
    if "gate" in packed and "up" in packed:
        fused = fuse_gate_up(packed["gate"], packed["up"])
        if fused is not None:
            packed.update(gate=fused, up=None)
    return layer.replace(**packed)


@flax.struct.dataclass
class GateUpPanels:
    """A gated MLP's gate and up weights [D, F] as one panel weight: gate's panels, then up's, so
    that the CPU kernel multiplies both in one call (`Backend.gated_projections`). Each kernel
    call costs a few microseconds beside its product (a [576, 64] product in cache took 3-3.5 us,
    an XLA elementwise op 1.2; running it on one thread instead of handing parts to the pool
    changed nothing), which a one-row 4-bit product of SmolLM2's shapes, 15-40 us, feels. Measured
    here (benchmarks/quantized_products.py's harness, one row): a 4-bit [576, 3072] product 39.5
    us against 2 x 28.1 for two [576, 1536] ones, float32 158 against 2 x 90; the built-in model's
    Q4_1 generate of 128 tokens, fused and unfused packings of the same weights timed in turn in
    one process, 6.5% faster fused (float32: the same, 1.009x; docs/benchmarks.md)."""

    # Columns [0, hidden): gate's; [up_start, up_start + hidden): up's.
    both: PanelWeight | QuantizedPanelWeight
    hidden: int = flax.struct.field(pytree_node=False)  # F
    up_start: int = flax.struct.field(pytree_node=False)  # gate's columns rounded up to whole panels

    def split(self, product: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The gate's and the up projection's outputs [..., F] of a product with `both`."""
        F = self.hidden
        return product[..., :F], product[..., self.up_start : self.up_start + F]


def fuse_gate_up(gate, up) -> GateUpPanels | None:
    """gate and up (panels of one kind, [D, F] each) as GateUpPanels; None where they are stored
    differently (float32 beside quantized, or other bits, groups or scale types, as a GGUF file
    may mix), which then stay two products."""
    if gate.shape != up.shape or type(gate) is not type(up):
        return None
    F = gate.shape[1]
    if isinstance(gate, PanelWeight):
        up_start = gate.panels.shape[0] * PANEL
        both = PanelWeight(panels=jnp.concatenate([gate.panels, up.panels]), d_out=up_start + F)
        return GateUpPanels(both=both, hidden=F, up_start=up_start)
    kinds = [(w.bits, w.group, w.scales.dtype, w.offsets is None) for w in (gate, up)]
    if kinds[0] != kinds[1]:
        return None
    offsets = None if gate.offsets is None else jnp.concatenate([gate.offsets, up.offsets])
    num_panels = gate.values.shape[0]
    both = gate.replace(
        values=jnp.concatenate([gate.values, up.values]),
        scales=jnp.concatenate([gate.scales, up.scales]),
        offsets=offsets,
        d_out=num_panels * PANEL + F,
    )
    return GateUpPanels(both=both, hidden=F, up_start=num_panels * PANEL)


def pack_panels(w) -> PanelWeight | QuantizedPanelWeight:
    """A weight [D_in, D_out] as the CPU kernels' panels: quantized ones for a QuantizedWeight,
    float32 ones for an array and for FP8 values, dequantized: FP8 has no CPU kernel, and int8
    panels would round its values again (see docs/models.md, "Quantized weights", for the
    measurement)."""
    if is_fp8(w):
        return pack(dequantize(w, jnp.float32))
    return pack_quantized(w) if isinstance(w, QuantizedWeight) else pack(w)
