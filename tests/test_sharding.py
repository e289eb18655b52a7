"""Tensor and data parallelism on fake CPU devices (conftest.py asks XLA for 8 of them).

Every generation on a mesh is compared token for token with the same call on one device. The
forward under shard_map sums each layer's attention and MLP outputs in a different order (a psum
of per-device partial products instead of one dot product), so logits differ from one device's in
the last float bits. Greedy output can therefore only differ at an argmax near-tie, and sampled
output with the same key (the threefry bits do not depend on sharding) only where a uniform draw
lands within that rounding of a decision boundary: about 1e-6 per draw, far below one in the
hundreds of draws here. So both are checked for exact equality.

The default set covers a 2 x 2 mesh with every proposer, model degree 8, a tensor-parallel
draft, sampling, the compiled program's all-reduces, loading onto a mesh, the built-in model at
degree 3, and bad input; `make test-all` adds the whole grid of model degrees 1, 2, 4, 8 by data
degrees 1, 2.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import check_acceptance, first_layer_eagle, layered_target, noisy_copy, trained_medusa
from jax.sharding import NamedSharding
from test_loading import tiny_config as torch_tiny_config
from test_loading import tiny_model as torch_tiny_model
from tiny import tiny_config, tiny_model

import specjax
from specjax import sharding
from specjax.models import init_params
from specjax.speculate.loop import GenerationInputs, LoopSpec, generate_program
from specjax.speculate.sampling import SamplingParams, WarpSpec

if jax.device_count() < 8:  # conftest.py sets the flag; a jax imported earlier would miss it
    raise RuntimeError(
        f"tests/test_sharding.py needs 8 devices, found {jax.device_count()}: XLA_FLAGS="
        "--xla_force_host_platform_device_count=8 must be set before jax is imported (tests/conftest.py)"
    )

# 16 query / 8 kv heads of dim 8 and ffw 96: splits over model degrees 1, 2, 4 and 8. Its second
# layer adds small updates, so that SelfDraft(layers=1) drafts its next token part of the time; the
# draft model is the target with noise and a third layer (tests/drafters.py). At k = 3 they accept
# 45% and 67% of their drafts here, the same drafts on every mesh as on one device.
TARGET = layered_target(seed=11, late_scale=0.3, num_heads=16, num_kv_heads=8, head_dim=8)
DRAFT = noisy_copy(TARGET, noise=0.05, seed=0)  # replicated, or split like the target (tensor_parallel)
# 4 / 2 heads: splits over model degree 2 at most.
# The target with noise, its layers only: a draft whose cache starts as the target's over the prompt
# (prompt_from_target), replicated while the target's cache is split.
COPY = noisy_copy(TARGET, noise=0.05, seed=1, extra_layers=0)
SMALL_DRAFT = tiny_model(seed=12, num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2)
PROMPTS = [  # repeats for n-gram matches, different lengths in one batch
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [3, 9],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11, 12, 13],
    [40, 41, 42, 40, 41],
]
NEW_TOKENS = 20


# An EAGLE head built from the target's first layer, and two Medusa heads trained on its
# continuations (on first use: a few seconds), both of which draft right part of the time.
EAGLE = first_layer_eagle(TARGET)
medusa_heads = functools.cache(lambda: trained_medusa(TARGET, num_heads=2))


def make_proposer(name, k=3):
    tree = specjax.TokenTree.top_k((3, 2))
    return {
        "none": lambda: None,
        "ngram": lambda: specjax.NGram(k=k, n_max=3, n_min=1),
        "draft": lambda: specjax.DraftModel(DRAFT, k=k),
        "draft-tp": lambda: specjax.DraftModel(DRAFT, k=k, tensor_parallel=True),
        "draft-prompt": lambda: specjax.DraftModel(COPY, k=k, prompt_from_target=True),
        "draft-prompt-tp": lambda: specjax.DraftModel(
            COPY, k=k, tensor_parallel=True, prompt_from_target=True
        ),
        "self": lambda: specjax.SelfDraft(layers=1, k=k),
        "medusa-tree": lambda: specjax.Medusa(medusa_heads(), tree=tree),
        "medusa-chain": lambda: specjax.Medusa(medusa_heads()),  # one draft per head
        "eagle-tree": lambda: specjax.Eagle(EAGLE, tree=tree),
        "eagle-chain": lambda: specjax.Eagle(EAGLE, k=k),
        # per row, n-gram drafts where it has a match, else the EAGLE head's
        "hybrid": lambda: specjax.Hybrid(specjax.NGram(k=k, n_min=2), specjax.Eagle(EAGLE, k=k)),
        "dynamic": lambda: specjax.Dynamic(specjax.DraftModel(DRAFT, k=k)),  # each row's own k
    }[name]()


@pytest.fixture(scope="module")
def one_device_greedy():
    """Plain greedy on one device: what every proposer's greedy output must equal (lossless)."""
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=NEW_TOKENS).tokens


# Proposers built to accept part of the time (tests/drafters.py), and the band their greedy
# accepted fraction lies in (check_acceptance), on one device and on every mesh: 30% to 73% here.
ACCEPTING = (
    "draft",
    "draft-tp",
    "draft-prompt",
    "draft-prompt-tp",
    "self",
    "medusa-tree",
    "medusa-chain",
    "eagle-tree",
    "eagle-chain",
    "hybrid",
    "dynamic",
)
GREEDY_BAND = (0.2, 0.9)


def check_on_mesh(model, data, name, expected, prompts=PROMPTS, band=None, **kwargs):
    mesh = sharding.make_mesh(model=model, data=data)
    result = specjax.generate(
        TARGET, prompts, proposer=make_proposer(name), max_new_tokens=NEW_TOKENS, mesh=mesh, **kwargs
    )
    assert result.tokens == expected, (model, data, name)
    if band is not None:
        check_acceptance(result.metrics, *band)
    return result


# A replicated draft on 2 x 2 is in the default set through test_sampled_on_mesh_equals_one_device.
FAST = {
    (2, 2, "none"),
    (2, 2, "ngram"),
    (8, 1, "self"),  # on 2 x 2 with `make test-all`
    (2, 2, "draft-tp"),
    (2, 2, "draft-prompt"),
    (2, 2, "draft-prompt-tp"),
    (2, 2, "eagle-tree"),  # a chain is its one-branch case (eagle-chain: `make test-all`)
    (2, 2, "hybrid"),
    (2, 2, "dynamic"),  # a wrapped draft model's weights placed on the mesh (they once were not)
}
GRID = [
    pytest.param(model, data, name, marks=() if (model, data, name) in FAST else pytest.mark.slow)
    for model in (1, 2, 4, 8)
    for data in (1, 2)
    for name in ("none", "ngram", *ACCEPTING)
    if model * data <= 8
]


@pytest.fixture(scope="module")
def one_device_accepted():
    """name -> each row's accepted drafts when that proposer decodes greedily on one device."""

    @functools.cache
    def accepted(name):
        proposer = make_proposer(name.removesuffix("-tp"))  # one device: nothing to split
        result = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=NEW_TOKENS)
        return result.metrics.accepted.tolist()

    return accepted


@pytest.mark.parametrize("model, data, name", GRID)
def test_greedy_on_mesh_equals_one_device(one_device_greedy, one_device_accepted, model, data, name):
    band = GREEDY_BAND if name in ACCEPTING else None
    result = check_on_mesh(model, data, name, one_device_greedy, band=band)
    if name in ACCEPTING:  # the same drafts accepted: the mesh drafted what one device did
        assert result.metrics.accepted.tolist() == one_device_accepted(name)


@pytest.mark.parametrize(
    "name",
    [
        "draft",
        pytest.param("medusa-tree", marks=pytest.mark.slow),
        pytest.param("none", marks=pytest.mark.slow),
    ],
)
def test_sampled_on_mesh_equals_one_device(name):
    """Same key, same tokens (see the module docstring for why equality is the right test)."""
    sampling = specjax.Sampling(temperature=0.8, top_k=20, top_p=0.95)
    kwargs = dict(sampling=sampling, key=jax.random.key(3))
    expected = specjax.generate(
        TARGET, PROMPTS, proposer=make_proposer(name), max_new_tokens=NEW_TOKENS, **kwargs
    )
    # Sampled, the noisy draft accepts 83% of its drafts here; the Medusa heads, trained on greedy
    # continuations, under 5%.
    band = (0.2, 0.95) if name == "draft" else None
    result = check_on_mesh(2, 2, name, expected.tokens, band=band, **kwargs)
    assert result.metrics.accepted.tolist() == expected.metrics.accepted.tolist()


def compile_program(mesh, proposer=None, batch_size=2):
    """The jitted generation program for TARGET on `mesh`, lowered as `generate` lowers it."""
    warp = WarpSpec.of(specjax.Sampling())
    proposer_spec, proposer_params = specjax.speculate.proposers.resolve(proposer, TARGET, warp, mesh)
    spec = LoopSpec(TARGET.config, batch_size, 16, 128, warp, proposer_spec, mesh=mesh)
    inputs = GenerationInputs.simple(
        prompt_tokens=jnp.asarray([row[:16] + [0] * (16 - len(row[:16])) for row in PROMPTS[:batch_size]]),
        prompt_lengths=jnp.asarray([len(row) for row in PROMPTS[:batch_size]], jnp.int32),
        max_new_tokens=jnp.full((batch_size,), NEW_TOKENS, jnp.int32),
        sampling=SamplingParams.of(specjax.Sampling(), batch_size, TARGET.config.vocab_size),
        key=jax.random.key(0),
    )
    params = sharding.shard_params(TARGET.params, TARGET.config, mesh)
    inputs = sharding.shard_rows(inputs, mesh, batch_size)
    args = (spec, params, proposer_params, inputs)
    jaxpr = jax.make_jaxpr(generate_program, static_argnums=0)(*args)
    return jaxpr, jax.jit(generate_program, static_argnums=0).lower(*args).compile(), args[1:]


def test_one_loop_with_psums_after_attention_and_mlp(one_device_greedy):
    """Model degree 2, plain decoding: one top-level while_loop with the shard_map'd forward in its
    body; the compiled program all-reduces the [B, T, D] residual update twice per layer, in the
    prefill (T = 16) and in the loop (T = 1), and nothing else: no weight is ever gathered."""
    L, D, B = TARGET.config.num_layers, TARGET.config.hidden_size, 2
    mesh = sharding.make_mesh(model=2, data=1)
    jaxpr, compiled, args = compile_program(mesh, batch_size=B)

    top = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
    assert top.count("while") == 1 and "shard_map" in top  # the prefill's forward
    (loop,) = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "while"]
    assert "shard_map" in [eqn.primitive.name for eqn in loop.params["body_jaxpr"].jaxpr.eqns]

    hlo = compiled.as_text()
    reduced = re.findall(r"= (\S+) all-reduce\(", hlo)
    assert sorted(reduced) == sorted(
        [f"f32[{B},16,{D}]{{2,1,0}}"] * 2 * L + [f"f32[{B},1,{D}]{{2,1,0}}"] * 2 * L
    )
    assert not re.search(r"all-gather|all-to-all|collective-permute", hlo)

    state = compiled(*args)
    lengths = np.asarray(state.lengths)
    tokens = [np.asarray(state.tokens)[b, len(PROMPTS[b]) : lengths[b]].tolist() for b in range(B)]
    assert tokens == one_device_greedy[:B]
    cache = state.cache.k[0]  # [B*K, E, S], kv heads split: each device holds K/2 of them
    assert cache.sharding.is_equivalent_to(NamedSharding(mesh, sharding.cache_specs(1).k[0]), 3)
    assert cache.addressable_shards[0].data.shape == (B * TARGET.config.num_kv_heads // 2, 8, 128)


@pytest.mark.slow
def test_draft_psums_inside_the_loop():
    """A self-draft shares the target's split weights: its passes all-reduce too (k+1-token verify,
    two-token first draft, one-token later drafts), all inside the one loop."""
    L, D, B, k = TARGET.config.num_layers, TARGET.config.hidden_size, 2, 3
    _, compiled, _ = compile_program(sharding.make_mesh(model=4, data=1), specjax.SelfDraft(1, k), B)
    reduced = re.findall(r"= (\S+) all-reduce\(", compiled.as_text())
    for tokens, count in ((k + 1, 2 * L), (2, 2), (1, 2)):
        assert reduced.count(f"f32[{B},{tokens},{D}]{{2,1,0}}") >= count, (tokens, reduced)


def test_param_and_cache_specs_follow_the_table():
    P = jax.sharding.PartitionSpec
    specs = sharding.param_specs(specjax.models.LlamaConfig(qkv_bias=True, tie_word_embeddings=False))
    layer = specs.layers[0]
    assert (layer.qkv, layer.gate, layer.up) == (P(None, "model"),) * 3  # by column
    assert (layer.o, layer.down) == (P("model", None),) * 2  # by row
    assert (layer.qkv_bias, layer.attn_norm) == (P("model"), P(None))
    assert (specs.embed, specs.lm_head) == (P(None, None), P(None, None))  # replicated
    assert sharding.param_specs(TARGET.config).lm_head == P(None, None)
    assert sharding.param_specs(TARGET.config, tensor_parallel=False).layers[0].qkv == P(None, None)
    cache = sharding.cache_specs(2)
    assert cache.k[1] == P(("data", "model"), None, None) and cache.lengths == P("data")
    assert sharding.cache_specs(2, tensor_parallel=False).v[0] == P("data", None, None)


def test_load_places_each_weight_with_its_sharding(tmp_path, monkeypatch):
    torch_tiny_model(torch_tiny_config("qwen2")).save_pretrained(tmp_path)  # 4 / 2 heads, q/k/v biases
    mesh = sharding.make_mesh(model=2)  # data 4
    served = []  # every slice a device received while loading: (type, shape, full shape)
    real_make_array = jax.make_array_from_callback

    def make_array_from_callback(shape, sharding_, callback, *args, **kwargs):
        def recorded(index):
            data = callback(index)
            served.append((type(data), data.shape, shape))
            return data

        return real_make_array(shape, sharding_, recorded, *args, **kwargs)

    def no_default_device(name, array):
        raise AssertionError(f"{name} went to the default device first")

    monkeypatch.setattr(jax, "make_array_from_callback", make_array_from_callback)
    monkeypatch.setattr(specjax.models.checkpoint, "_put_on_default_device", no_default_device)
    model = specjax.load(tmp_path, mesh=mesh)
    monkeypatch.undo()
    assert {kind for kind, _, _ in served} == {np.ndarray}  # from host memory, never from a device
    split = [(shape, full) for _, shape, full in served if shape != full]
    assert split and all(shape[-1] * 2 == full[-1] or shape[0] * 2 == full[0] for shape, full in split)

    plain = specjax.load(tmp_path)
    specs = sharding.param_specs(model.config)
    for got, want, spec in zip(
        jax.tree.leaves(model.params), jax.tree.leaves(plain.params), jax.tree.leaves(specs), strict=True
    ):
        assert got.sharding == NamedSharding(mesh, spec)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    qkv = model.params.layers[0].qkv  # [D, K*(G+2)*E] split by column over 2 devices
    assert qkv.addressable_shards[0].data.shape == (qkv.shape[0], qkv.shape[1] // 2)
    # generate(..., mesh=mesh) uses these arrays as they are: placing them again is a no-op.
    again = sharding.shard_params(model.params, model.config, mesh)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model.params), strict=True))


# ---------------------------------------------------------------------------------------------
# The built-in model: 9 query / 3 kv heads, ffw 1536, so model degree 3 is its natural split.

BUILTIN_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "List three primary colors: red, blue and",
]


def builtin_mesh(data=1):
    return sharding.make_mesh(model=3, data=data, devices=jax.devices()[: 3 * data])


@pytest.fixture(scope="module")
def smollm2_on_mesh(smollm2_cache_dir, smollm2):
    """The built-in model loaded onto a model-degree-3 mesh (from the session's converted cache)."""
    model = specjax.load("smollm2-135m", cache_dir=smollm2_cache_dir, mesh=builtin_mesh())
    qkv = model.params.layers[0].qkv  # [576, 3 * (3 + 2) * 64]: one kv-head group per device
    assert qkv.addressable_shards[0].data.shape == (576, 320) and len(qkv.sharding.device_set) == 3
    return model


@pytest.fixture(scope="module")
def builtin_greedy(smollm2):
    return specjax.generate(smollm2, BUILTIN_PROMPTS, max_new_tokens=12).tokens


@pytest.mark.parametrize(
    "name, data",
    [
        pytest.param("self", 1, marks=pytest.mark.slow),
        pytest.param("none", 1, marks=pytest.mark.slow),
        pytest.param("ngram", 2, marks=pytest.mark.slow),
        pytest.param("draft", 1, marks=pytest.mark.slow),
        pytest.param("draft-tp", 2, marks=pytest.mark.slow),
    ],
)
def test_builtin_model_degree_3(request, smollm2, builtin_greedy, name, data):
    """With data degree 1 the model is loaded onto the mesh; with 2, generate() places it."""
    draft = specjax.Model(  # the target's first 4 layers: 9 / 3 heads, so it splits over 3 too
        dataclasses.replace(smollm2.config, num_layers=4),
        smollm2.params.replace(layers=smollm2.params.layers[:4]),
        smollm2.tokenizer,
    )
    proposer = {
        "none": None,
        "self": specjax.SelfDraft(layers=8, k=3),
        "ngram": specjax.NGram(k=4),
        "draft": specjax.DraftModel(draft, k=3),
        "draft-tp": specjax.DraftModel(draft, k=3, tensor_parallel=True),
    }[name]
    target = request.getfixturevalue("smollm2_on_mesh") if data == 1 else smollm2
    result = specjax.generate(
        target, BUILTIN_PROMPTS, proposer=proposer, max_new_tokens=12, mesh=builtin_mesh(data)
    )
    assert result.tokens == builtin_greedy


@pytest.mark.slow
def test_builtin_model_degree_3_sampled(smollm2):
    kwargs = dict(
        proposer=specjax.SelfDraft(layers=8, k=3),
        sampling=specjax.Sampling(temperature=0.7, top_p=0.9),
        max_new_tokens=16,
        key=jax.random.key(1),
    )
    expected = specjax.generate(smollm2, BUILTIN_PROMPTS, **kwargs).tokens
    assert specjax.generate(smollm2, BUILTIN_PROMPTS, mesh=builtin_mesh(), **kwargs).tokens == expected


# ---------------------------------------------------------------------------------------------
# Bad input: every message names the argument, the value and what is allowed.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(model=3),
            r"make_mesh: model=3 does not divide the 8 devices; use a model degree in \[1, 2, 4, 8\]",
        ),
        (dict(model=2, data=3), r"data \* model = 3 \* 2 = 6 does not divide the 8 devices"),
        (dict(model=0), "make_mesh: model must be an integer >= 1, got 0"),
        (dict(data=-1), "make_mesh: data must be an integer >= 1, got -1"),
    ],
)
def test_bad_mesh_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(**kwargs)


def test_mesh_sizes():
    assert dict(sharding.make_mesh(model=2).shape) == {"data": 4, "model": 2}
    assert dict(sharding.make_mesh().shape) == {"data": 8, "model": 1}
    assert sharding.make_mesh(model=4, data=1).devices.size == 4  # the first 4 devices


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(num_heads=6, num_kv_heads=2, head_dim=8),
            r"num_heads=6 does not divide over the mesh axis 'model' of size 4",
        ),
        (
            dict(num_heads=8, num_kv_heads=2),
            r"num_kv_heads=2 does not divide over the mesh axis 'model' of size 4",
        ),
        (dict(num_heads=8, num_kv_heads=4, intermediate_size=90), r"intermediate_size=90 does not divide"),
    ],
)
def test_model_that_does_not_split(overrides, message):
    config = tiny_config(**overrides)  # shapes suffice: the check comes before any compute
    model = specjax.Model(config, jax.eval_shape(lambda: init_params(config, jax.random.key(0))))
    mesh = sharding.make_mesh(model=4, data=2)
    with pytest.raises(ValueError, match=message + r".*in \[1, 2\]"):
        specjax.generate(model, PROMPTS[:2], max_new_tokens=4, mesh=mesh)


def test_batch_padded_to_split(one_device_greedy):
    """3 rows on data degree 2 pad to a batch of 4 (the program the 4 rows of PROMPTS use); a
    user's buckets must hold one that splits."""
    mesh = sharding.make_mesh(model=2, data=2)
    result = specjax.generate(TARGET, PROMPTS[:3], max_new_tokens=NEW_TOKENS, mesh=mesh)
    assert result.tokens == one_device_greedy[:3]
    assert result.metrics.emitted.tolist() == [NEW_TOKENS] * 3
    message = (
        r"batch_buckets: no bucket of \[3, 5\] that holds 3 prompts is a multiple of the mesh's "
        r"data-parallel degree 2 .*e\.g\. 4"
    )
    with pytest.raises(ValueError, match=message):
        specjax.generate(TARGET, PROMPTS[:3], max_new_tokens=4, mesh=mesh, batch_buckets=[3, 5])


def test_draft_that_does_not_split():
    mesh = sharding.make_mesh(model=4, data=2)
    with pytest.raises(ValueError, match=r"DraftModel\(tensor_parallel=True\) draft's num_kv_heads=2"):
        specjax.generate(
            TARGET,
            PROMPTS[:2],
            proposer=specjax.DraftModel(SMALL_DRAFT, k=3, tensor_parallel=True),
            max_new_tokens=4,
            mesh=mesh,
        )
    with pytest.raises(ValueError, match="DraftModel tensor_parallel must be a bool, got 'yes'"):
        specjax.DraftModel(SMALL_DRAFT, tensor_parallel="yes")


def test_bad_mesh_argument():
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh .*got str"):
        specjax.generate(TARGET, PROMPTS[:2], max_new_tokens=4, mesh="model=2")
    other = jax.make_mesh((2, 4), ("x", "y"))
    with pytest.raises(ValueError, match=r"mesh must have the axes \('data', 'model'\).*got \('x', 'y'\)"):
        specjax.generate(TARGET, PROMPTS[:2], max_new_tokens=4, mesh=other)


def test_load_onto_a_mesh_that_does_not_split(tmp_path):
    torch_tiny_model(torch_tiny_config("llama")).save_pretrained(tmp_path)  # 2 kv heads
    with pytest.raises(
        ValueError, match="num_kv_heads=2 does not divide over the mesh axis 'model' of size 4"
    ):
        specjax.load(tmp_path, mesh=sharding.make_mesh(model=4))
