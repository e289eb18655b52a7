"""Decoder layers run as loops over stacked weights (generate(scan_layers=True), the default on
GPUs and TPUs): the same tokens and acceptance counts as the unrolled layers, and a program whose
size does not grow with depth.

Scanning changes where every layer's weights and cache buffers come from (a LayerStack's slice,
a stacked buffer written in place), so each path that touches the layers one by one is checked
against the unrolled program on this CPU: a prefill and plain steps; ragged acceptance, which
writes each row at its own length; an early exit that ends inside a stack (SelfDraft); a draft
model's own stacked layers and cache; EAGLE-3's features captured between layers, with a tree's
accepted path moved in every layer; layers of two kinds interleaved (sliding windows, dense and
expert MLPs), which run as several stacks; and a mesh.
"""

from __future__ import annotations

import jax
import jax.extend
import numpy as np
import pytest
from drafters import layered_target, noisy_copy
from jax.sharding import PartitionSpec as P
from tiny import tiny_model

import specjax
from specjax import planner, sharding
from specjax.kernels.backend import Backend
from specjax.models import Eagle3Head
from specjax.models.cache import init_cache
from specjax.models.llama import stack_layers
from specjax.models.params import LayerStack
from specjax.speculate.loop import generate_program
from specjax.speculate.spec import memory_bytes
from specjax.speculate.tree import TokenTree

TARGET = layered_target(seed=31, num_layers=4)  # its first layers predict it part of the time
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]]
# Sliding layers between full ones, with their own rotary base (Gemma 3's pattern).
WINDOWED = tiny_model(
    seed=32,
    num_layers=5,
    sliding_window=6,
    local_rope_theta=1000.0,
    layer_types=("sliding_attention",) * 2 + ("full_attention",) + ("sliding_attention",) * 2,
)
# Experts in every layer but the second (Qwen3-MoE's mlp_only_layers).
MIXTURE = tiny_model(seed=33, num_layers=4, num_experts=4, num_experts_per_tok=2, dense_layers=(1,))


def proposer(name: str):
    if name == "plain":
        return None
    if name == "forced":  # n-gram drafts accepted at 60% a position: rows commit ragged counts
        return specjax.ForcedAcceptance(0.6, proposer=specjax.NGram(k=3), k=3)
    if name == "self_draft":  # 3 of 4 layers: the early exit ends inside the stack
        return specjax.SelfDraft(layers=3, k=2)
    if name == "draft":  # the target with noise and one more layer: accepted part of the time
        return specjax.DraftModel(noisy_copy(TARGET, noise=0.05), k=3)
    if name == "eagle3_tree":  # features captured entering layers 1 and 3 and after the last; a
        # random head's tree paths forced at 60% a level, so accepted paths move in every layer
        head = Eagle3Head.init(TARGET, jax.random.key(0), aux_layer_ids=(1, 3, 4), scale=1.0)
        return specjax.ForcedAcceptance(0.6, specjax.Eagle3(head, tree=TokenTree.top_k((2, 1))))
    raise ValueError(name)


def both(model, name, **options):
    """generate with the layers unrolled and scanned (plain XLA attention: this CPU's kernels
    want unrolled layers)."""
    run = dict(proposer=proposer(name), max_new_tokens=12, kernels="xla", **options)
    return (
        specjax.generate(model, PROMPTS, scan_layers=False, **run),
        specjax.generate(model, PROMPTS, scan_layers=True, **run),
    )


COUNTS = ("steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length_histogram")


def assert_same(unrolled, scanned):
    assert scanned.tokens == unrolled.tokens
    summary, want = scanned.metrics.summary(), unrolled.metrics.summary()
    assert {n: summary[n] for n in COUNTS} == {n: want[n] for n in COUNTS}


@pytest.mark.parametrize(
    "name",
    [
        "forced",
        pytest.param("plain", marks=pytest.mark.slow),
        pytest.param("self_draft", marks=pytest.mark.slow),
        pytest.param("draft", marks=pytest.mark.slow),
        pytest.param("eagle3_tree", marks=pytest.mark.slow),
    ],
)
def test_scanned_layers_equal_unrolled(name):
    unrolled, scanned = both(TARGET, name)
    assert_same(unrolled, scanned)
    if name != "plain":  # drafts accepted and rejected alike, so rows write at ragged lengths
        assert 0 < scanned.metrics.summary()["acceptance_rate"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("model", [WINDOWED, MIXTURE], ids=["windowed", "mixture"])
def test_layers_of_two_kinds_run_as_several_stacks(model):
    assert_same(*both(model, "forced"))


@pytest.mark.slow
def test_scanned_layers_on_a_mesh():
    mesh = sharding.make_mesh(data=2, model=2)
    assert_same(*both(TARGET, "forced", mesh=mesh))


def test_runs_of_one_shape_are_stacked():
    stacked = stack_layers(WINDOWED.params, WINDOWED.config).layers
    assert [e.count for e in stacked] == [5]  # sliding and full layers in one stack
    stacked = stack_layers(MIXTURE.params, MIXTURE.config).layers
    assert [getattr(e, "count", 1) for e in stacked] == [1, 1, 2]  # experts, dense, experts x2
    stack = stack_layers(TARGET.params, TARGET.config).layers[0]
    assert isinstance(stack, LayerStack) and stack.count == 4
    np.testing.assert_array_equal(stack.layers.qkv[2], TARGET.params.layers[2].qkv)


def test_a_cache_follows_its_params_layers():
    layers = stack_layers(MIXTURE.params, MIXTURE.config).layers
    cache = init_cache(MIXTURE.config, 2, 16, like=layers)
    assert cache.layout == (None, None, 2) and cache.num_layers == 4
    assert cache.k[2].shape == (2, 2 * 2, 16, 16) and cache.v[1].shape == (2 * 2, 16, 16)
    early = init_cache(MIXTURE.config, 2, 16, num_layers=3, like=layers)
    assert early.layout == (None, None, 1)  # an early exit after 3 layers ends inside the stack
    assert sharding.cache_specs(early.layout).k[2] == P(None, ("data", "model"), None, None)


def count_ops(jaxpr, name: str) -> int:
    """Equations named `name` in a jaxpr and every jaxpr nested in it (loops, conds)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += count_ops(sub, name)
    return total


def traced_products(num_layers: int, scan: bool, **config) -> int:
    model = tiny_model(seed=35, num_layers=num_layers, **config)
    prepared = planner.plan(model, PROMPTS, proposer=specjax.NGram(k=3), max_new_tokens=8, scan_layers=scan)
    args = (prepared.params, prepared.proposer_params, prepared.inputs)
    jaxpr = jax.make_jaxpr(generate_program, static_argnums=0)(prepared.spec, *args)
    return count_ops(jaxpr.jaxpr, "dot_general")


def test_a_scanned_program_does_not_grow_with_depth():
    assert traced_products(2, scan=True) == traced_products(12, scan=True)
    assert traced_products(12, scan=False) > traced_products(2, scan=False)  # unrolled: it does


def gemma_pattern(num_layers: int) -> dict:
    """Five sliding layers to one full one, each kind with its own rotary base (Gemma 3)."""
    types = tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(num_layers))
    return dict(sliding_window=6, local_rope_theta=1000.0, layer_types=types)


def test_interleaved_windows_do_not_grow_a_scanned_program():
    assert traced_products(6, True, **gemma_pattern(6)) == traced_products(24, True, **gemma_pattern(24))


def test_the_memory_check_counts_the_stacked_copy():
    # (one pass: a chunked prefill's workspace depends on which attention kernel the backend has)
    prepared = planner.plan(TARGET, PROMPTS, max_new_tokens=8, scan_layers=True, prefill_chunk=None)
    unrolled = planner.plan(TARGET, PROMPTS, max_new_tokens=8, scan_layers=False, prefill_chunk=None)
    layers = sum(w.nbytes for w in jax.tree.leaves(TARGET.params.layers))
    assert memory_bytes(prepared.spec) - memory_bytes(unrolled.spec) == layers


def test_bad_scan_layers():
    with pytest.raises(ValueError, match="scan_layers must be True, False or None, got 'yes'"):
        specjax.generate(TARGET, PROMPTS, max_new_tokens=2, scan_layers="yes")
    with pytest.raises(ValueError, match="scan_layers"):
        Backend(("cpu",), scan_layers=1)


@pytest.mark.slow
def test_scanned_bfloat16_speculation_equals_scanned_plain():
    """In bfloat16, scanned and unrolled programs may round differently (XLA fuses a loop's body
    and an unrolled stack differently): they can part at a near-tie (seen on a tiny Phi-3, top two
    logits 0.4% apart). What must hold is losslessness within one program form: speculative
    greedy equals plain greedy, both scanned."""
    params = jax.tree.map(lambda w: w.astype(jax.numpy.bfloat16), TARGET.params)
    model = specjax.Model(TARGET.config, params, name="layered-bf16")
    run = dict(max_new_tokens=12, kernels="xla", scan_layers=True)
    plain = specjax.generate(model, PROMPTS, **run)
    for drafter in (specjax.NGram(k=3), proposer("self_draft")):
        got = specjax.generate(model, PROMPTS, proposer=drafter, **run)
        assert got.tokens == plain.tokens, drafter
        assert got.metrics.summary()["num_accepted_tokens"] > 0
