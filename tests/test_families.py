"""Every supported family against transformers' own implementation, in float32: a tiny random
model built by transformers from a config, saved with `save_pretrained` and read by
`specjax.load(folder)` must give transformers' logits over a 64-token prompt (well past the
sliding windows of 16), its greedy continuation token for token, and every proposer's greedy
output must equal plain decoding (bfloat16: tests/test_families_bf16.py)."""

from __future__ import annotations

import dataclasses
import json

import families
import jax
import numpy as np
import pytest
import torch
from logit_check import compare_with_torch, prefill_and_decode, relative_error
from oracle import Oracle, references

import specjax
from specjax.models import EagleHead, MedusaHead
from specjax.models.checkpoint import flatten
from specjax.speculate.tree import TokenTree

TOL = 1e-4  # relative float32 logit error (max abs diff / max abs logit, worst position)
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (specjax model, torch model), each saved and loaded once."""
    cache, folders = {}, {}

    def get(family):
        if family not in cache:
            folders[family] = tmp_path_factory.mktemp(family)
            torch_model = families.save_folder(family, folders[family])
            cache[family] = (specjax.load(folders[family]), torch_model)
        return cache[family]

    get.folders = folders
    return get


EXPECTED = {  # what each family's config must turn into (a check on families.config_from_hf)
    "llama3": dict(rope_scaling=specjax.models.RopeScaling("llama3", 8.0, 1.0, 4.0, 32)),
    "qwen2": dict(qkv_bias=True),
    "mistral": dict(sliding_window=16, layer_types=None),
    "qwen3": dict(qk_norm=True, head_dim=32, tie_word_embeddings=True),
    "gemma3": dict(
        norm="gemma",
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=True,
        hidden_act="gelu_tanh",
        query_pre_attn_scalar=24.0,
        sliding_window=16,
        layer_types=("sliding_attention", "sliding_attention", "full_attention", "sliding_attention"),
        rope_theta=1e6,
        local_rope_theta=10000.0,
        rope_scaling=specjax.models.RopeScaling("linear", 4.0),
    ),
    "phi3": dict(rotary_dim=8, sliding_window=16),
    "mixtral": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, sliding_window=16),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, dense_layers=(1,)),
    "glm4_moe": dict(
        rotary_dim=16,
        qk_norm=True,
        qkv_bias=True,
        num_experts=8,
        num_experts_per_tok=3,
        dense_layers=(0,),
        router_scoring="sigmoid",
        router_score_bias=True,
        num_expert_groups=4,
        topk_expert_groups=2,
        routed_scaling_factor=2.5,
        shared_expert_size=64,
        num_mtp_layers=1,
    ),
    "deepseek_v3": dict(
        num_kv_heads=1,
        head_dim=24,
        rotary_dim=8,
        v_head_dim=24,
        kv_lora_rank=32,
        q_lora_rank=48,
        rope_interleave=True,
        rope_scaling=specjax.models.RopeScaling(
            "yarn", 4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.5
        ),
        router_scoring="sigmoid",
        num_expert_groups=4,
        topk_expert_groups=2,
        shared_expert_size=32,
        dense_layers=(0,),
        num_mtp_layers=1,
    ),
    "gpt_oss": dict(
        attention_sinks=True,
        qkv_bias=True,
        o_bias=True,
        moe_bias=True,
        norm="rms_float32",
        hidden_act="clamped_swiglu",
        swiglu_limit=2.0,
        sliding_window=16,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        rope_scaling=specjax.models.RopeScaling(
            "yarn", 4.0, original_max_position_embeddings=128, truncate=False
        ),
    ),
}


@pytest.mark.parametrize("family", families.FAMILIES)
def test_logits_match_transformers(built, family):
    """Prefill of two right-padded prompts (64 and 41 tokens) and four cached decoding steps."""
    model, torch_model = built(family)
    for name, value in EXPECTED[family].items():
        assert getattr(model.config, name) == value, name
    continuations = [[3, 4, 5, 6], [7, 8, 9, 10]]
    error = compare_with_torch(model, torch_model, families.prompts(), continuations)
    print(f"{family}: max relative logit error vs transformers {error:.1e}")
    assert error < TOL


@pytest.mark.parametrize("family", ["mistral", pytest.param("gemma3", marks=pytest.mark.slow), "gpt_oss"])
def test_the_window_matters(built, family):
    """The same weights with full attention everywhere are far from transformers past the window
    (so the comparison above does test the window), and equal within it."""
    model, torch_model = built(family)
    # A window longer than any sequence: the same layers (and Gemma's local rotary base), no window.
    full = specjax.Model(dataclasses.replace(model.config, sliding_window=10**6), model.params)
    within = families.prompts(lengths=(15, 9))  # with one more token: 16 positions, the window
    assert compare_with_torch(full, torch_model, within, [[3], [4]]) < TOL
    assert compare_with_torch(full, torch_model, families.prompts(), [[3], [4]]) > 1e-2


@pytest.mark.slow  # a proof that the comparisons test each piece: `make test-all`
def test_gpt_oss_pieces_matter(built):
    """Each of gpt-oss's own pieces changes its logits well past the tolerance when left out (its
    sinks, the SwiGLU's clamp, YaRN's frequencies and attention factor, the biases of o and of
    the experts), so the comparison with transformers tests each of them."""
    model, torch_model = built("gpt_oss")
    c, layers = model.config, model.params.layers
    without = {
        "sinks": (dataclasses.replace(c, attention_sinks=False), [lp.replace(sinks=None) for lp in layers]),
        "clamp": (dataclasses.replace(c, swiglu_limit=1e9), layers),
        "yarn": (dataclasses.replace(c, rope_scaling=None), layers),
        "o_bias": (dataclasses.replace(c, o_bias=False), [lp.replace(o_bias=None) for lp in layers]),
        "expert_down_bias": (c, [lp.replace(expert_down_bias=lp.expert_down_bias * 0) for lp in layers]),
    }
    for name, (config, changed) in without.items():
        other = specjax.Model(config, model.params.replace(layers=tuple(changed)))
        error = compare_with_torch(other, torch_model, families.prompts(), [[3], [4]])
        assert error > 1e-2, name


@pytest.mark.parametrize(
    "kernels", ["auto", "xla", "pallas:tpu", pytest.param("pallas:cuda", marks=pytest.mark.slow)]
)
def test_gpt_oss_greedy_through_every_kernel(built, kernels):
    """gpt-oss's sinks through every attention path of the loop: the CPU kernel ("auto": one-token
    passes read their own slot from the cache, the sink scaling the output), plain XLA (the
    write-first decoding pass over the whole cache) and each Pallas kernel in the interpreter (the
    blocked prefill, the decode kernel), against transformers' greedy tokens."""
    model, torch_model = built("gpt_oss")
    prompts = families.prompts(lengths=(20, 33), seed=1)
    ours = specjax.generate(model, prompts, max_new_tokens=24, kernels=kernels).tokens
    for row, prompt in zip(ours, prompts, strict=True):
        assert row == families.hf_greedy(torch_model, prompt, 24)[0]


# The default set generates with one family of each kind of attention and expert layer (windows and
# their own norms, a mixture, latent attention, sinks); every family with `make test-all`. The
# logits of every family stay in the default set.
GENERATE_FAST = {"gemma3", "qwen3_moe", "deepseek_v3", "gpt_oss"}
GENERATE_GRID = [
    pytest.param(f, marks=() if f in GENERATE_FAST else pytest.mark.slow) for f in families.FAMILIES
]


@pytest.mark.parametrize("family", GENERATE_GRID)
def test_greedy_equals_transformers_generate(built, family):
    """48 tokens from prompts of 20 and 33 tokens in one batch (the CPU kernels' path: panel
    weights, attention to the committed slots with a window), against transformers per row."""
    model, torch_model = built(family)
    prompts = families.prompts(lengths=(20, 33), seed=1)
    ours = specjax.generate(model, prompts, max_new_tokens=NEW_TOKENS).tokens
    for row, prompt in zip(ours, prompts, strict=True):
        assert row == families.hf_greedy(torch_model, prompt, NEW_TOKENS)[0]


def in_dtype(head, model: specjax.Model):
    """A head with its params in the model's dtype (heads are made in float32)."""
    params = jax.tree.map(lambda x: x.astype(model.params.dtype), head.params)
    return dataclasses.replace(head, params=params)


def proposers(model: specjax.Model, plain: list[list[int]], prompts) -> dict:
    """One of each proposer on random params in the model's dtype, and an oracle chain that drafts
    plain decoding's own tokens (every draft accepted: verify passes of k + 1 tokens across the window)."""
    medusa = in_dtype(MedusaHead.init(model, num_heads=3, key=jax.random.key(0), scale=0.5), model)
    eagle = in_dtype(EagleHead.init(model, jax.random.key(1), scale=0.5), model)
    reference = references(prompts, plain, width=len(prompts[0]) + NEW_TOKENS + 8)
    return {
        "ngram": specjax.NGram(k=4),
        "draft": specjax.DraftModel(families.smaller_draft(model), k=3),
        "self-draft": specjax.SelfDraft(layers=1, k=3),
        "medusa-tree": specjax.Medusa(medusa, tree=TokenTree.top_k((2, 2))),
        "eagle": specjax.Eagle(eagle, k=3),
        "oracle": Oracle(TokenTree.chain(5), reference),
    }


# Every family runs every proposer with `make test-all` only: in the default set the built-in model,
# a Llama, runs every proposer (tests/test_builtin_generate.py), a quantized model too
# (tests/test_quantized.py), and a mixture of experts speculates on a mesh below.
@pytest.mark.slow
@pytest.mark.parametrize("family", families.FAMILIES)
def test_every_proposer_greedy_equals_plain(built, family):
    model, _ = built(family)
    prompts = families.prompts(lengths=(33, 20), seed=2)
    plain = specjax.generate(model, prompts, max_new_tokens=NEW_TOKENS).tokens
    for name, proposer in proposers(model, plain, prompts).items():
        result = specjax.generate(model, prompts, proposer=proposer, max_new_tokens=NEW_TOKENS)
        assert result.tokens == plain, name
        if name == "oracle":  # every draft right: the verify passes ran their full width
            assert result.metrics.summary()["mean_acceptance_length"] > 5


def _moe_reference(config, h: np.ndarray, layer) -> np.ndarray:
    """A mixture of experts in float64 numpy, token by token: softmax of the router's logits, the
    top experts, renormalized (Qwen3-MoE with norm_topk_prob), each expert's SwiGLU, summed."""
    w = {
        name: np.asarray(getattr(layer, name), np.float64)
        for name in ("router", "expert_gate", "expert_up", "expert_down")
    }
    out = np.zeros(h.shape)
    for index in np.ndindex(h.shape[:-1]):
        x = h[index].astype(np.float64)
        logits = x @ w["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[: config.num_experts_per_tok]
        weights = probs[top] / probs[top].sum()
        for j, weight in zip(top, weights, strict=True):
            gate, up = x @ w["expert_gate"][j], x @ w["expert_up"][j]
            out[index] += weight * ((gate / (1 + np.exp(-gate)) * up) @ w["expert_down"][j])
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 5, 16])
def test_moe_equals_float64_and_reads_only_the_routed_experts(built, num_tokens):
    """Both forms of the experts (the CPU's loop over routed experts, the accelerators' ragged_dot
    over assignments grouped by expert) equal a float64 reference on 1 to 16 tokens; and with
    every expert no token was routed to replaced by NaN, the loop's output is the same bit for bit:
    it never reads an unrouted expert's weights."""
    from specjax.models.mlp import _experts_grouped, _experts_one_by_one, moe_mlp, route

    model, _ = built("qwen3_moe")
    c = model.config
    layer = model.params.layers[0]
    h = np.random.default_rng(num_tokens).standard_normal((1, num_tokens, c.hidden_size)).astype(np.float32)
    want = _moe_reference(c, h, layer)[0]
    x = jax.numpy.asarray(h[0])
    weights, experts = route(c, x, layer)
    for form in (_experts_one_by_one, _experts_grouped):
        np.testing.assert_allclose(
            np.asarray(form(c, x, weights, experts, layer)), want, rtol=1e-4, atol=1e-4
        )
    np.testing.assert_allclose(
        np.asarray(moe_mlp(c, jax.numpy.asarray(h), layer))[0], want, rtol=1e-4, atol=1e-4
    )
    unused = np.asarray(
        sorted(set(range(c.num_experts)) - set(np.asarray(experts).ravel().tolist())), np.int32
    )
    if not len(unused):
        return  # 16 tokens route to every expert
    poisoned = layer.replace(
        **{
            name: getattr(layer, name).at[unused].set(np.nan)
            for name in ("expert_gate", "expert_up", "expert_down")
        }
    )
    np.testing.assert_array_equal(
        np.asarray(_experts_one_by_one(c, x, weights, experts, poisoned)),
        np.asarray(_experts_one_by_one(c, x, weights, experts, layer)),
    )


def _gpt_oss_moe_reference(config, h: np.ndarray, layer) -> np.ndarray:
    """gpt-oss's mixture in float64 numpy, token by token: the router's biased logits, a softmax
    over the top k of them, each expert's biased gate and up, its clamped SwiGLU
    (gate * sigmoid(alpha * gate) * (up + 1)) and biased down projection, weighted and summed."""
    w = {name: np.asarray(value, np.float64) for name, value in flatten(layer).items()}
    limit, alpha = config.swiglu_limit, config.swiglu_alpha
    out = np.zeros(h.shape)
    for index in np.ndindex(h.shape[:-1]):
        x = h[index].astype(np.float64)
        logits = x @ w["router"] + w["router_bias"]
        top = np.argsort(-logits)[: config.num_experts_per_tok]
        weights = np.exp(logits[top] - logits[top].max())
        for j, weight in zip(top, weights / weights.sum(), strict=True):
            gate = np.minimum(x @ w["expert_gate"][j] + w["expert_gate_bias"][j], limit)
            up = np.clip(x @ w["expert_up"][j] + w["expert_up_bias"][j], -limit, limit)
            hidden = gate / (1 + np.exp(-alpha * gate)) * (up + 1)
            out[index] += weight * (hidden @ w["expert_down"][j] + w["expert_down_bias"][j])
    return out


@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_gpt_oss_experts_equal_float64(built, num_tokens):
    """Both forms of gpt-oss's experts (the CPU's loop, the accelerators' ragged_dot, whose biases
    follow the sorted assignments) equal a float64 reference, clamp and biases included."""
    from specjax.models.mlp import _experts_grouped, _experts_one_by_one, moe_mlp, route

    model, _ = built("gpt_oss")
    c, layer = model.config, model.params.layers[1]
    rng = np.random.default_rng(num_tokens)
    h = rng.standard_normal((1, num_tokens, c.hidden_size)).astype(np.float32)
    want = _gpt_oss_moe_reference(c, h, layer)[0]
    x = jax.numpy.asarray(h[0])
    weights, experts = route(c, x, layer)
    down_bias = np.einsum("nk,nkd->nd", np.asarray(weights), np.asarray(layer.expert_down_bias)[experts])
    for form in (_experts_one_by_one, _experts_grouped):  # without the down projection's biases
        got = np.asarray(form(c, x, weights, experts, layer)) + down_bias
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    got = np.asarray(moe_mlp(c, jax.numpy.asarray(h), layer))[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # proofs that the comparison with transformers tests each piece
@pytest.mark.parametrize(
    "change",
    [
        dict(topk_expert_groups=4),  # every group open: the group limit decides experts here
        dict(routed_scaling_factor=1.0),
        dict(rotary_dim=32),  # GLM turns the first half of each head only
        dict(router_score_bias=False),  # the correction bias moves the choice
    ],
)
def test_glm4_moe_routing_pieces_matter(built, change):
    """Each piece of GLM-4.5's routing and rotary that the match above rests on changes the
    logits when left out: the comparison does test them."""
    model, torch_model = built("glm4_moe")
    config, params = dataclasses.replace(model.config, **change), model.params
    if "router_score_bias" in change:  # the weights without the bias, as such a config has them
        params = params.replace(layers=tuple(lp.replace(router_score_bias=None) for lp in params.layers))
    changed = specjax.Model(config, params)
    assert compare_with_torch(changed, torch_model, families.prompts(), [[3], [4]]) > 1e-2


@pytest.mark.slow  # proofs that the comparison with transformers tests each piece
@pytest.mark.parametrize(
    "change",
    [
        dict(rope_interleave=False),
        dict(rope_scaling=None),  # yarn's frequencies past the original context of 32
        dict(rope_scaling=specjax.models.RopeScaling("yarn", 4.0, original_max_position_embeddings=32)),
        dict(
            rope_scaling=specjax.models.RopeScaling(
                "yarn", 4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0
            )
        ),
    ],
)
def test_deepseek_v3_rotary_pieces_matter(built, change):
    """Interleaved rotary pairs, yarn's frequencies, its attention factor (mscale against
    mscale_all_dim: the second yarn case has neither, the third makes the factor 1) and the
    softmax scale's mscale_all_dim each change the logits when left out."""
    model, torch_model = built("deepseek_v3")
    changed = specjax.Model(dataclasses.replace(model.config, **change), model.params)
    assert compare_with_torch(changed, torch_model, families.prompts(), [[3], [4]]) > 1e-3


def test_deepseek_v3_caches_the_latent(built):
    """The cache holds, per token and layer, the latent (kv_lora_rank) and the rotary key
    (qk_rope_head_dim) once, not per-head keys and values: 40 numbers here, against
    2 * 4 * 24 = 192 for a per-head cache of the same heads."""
    model, _ = built("deepseek_v3")
    c = model.config
    cache = specjax.models.init_cache(c, 2, 100)
    assert [tuple(k.shape) for k in cache.k] == [(2, 32 + 8, 100)] * c.num_layers
    assert [tuple(v.shape) for v in cache.v] == [(2, 100, 0)] * c.num_layers
    assert c.cache_token_size == 40
    assert specjax.models.cache_bytes(c, 2, 100) == c.num_layers * 2 * 100 * 40 * 4


@pytest.mark.slow  # a second DeepSeek-V3 config (V2-Lite's): `make test-all`
def test_deepseek_v3_without_a_query_latent(tmp_path):
    """q_lora_rank None (DeepSeek-V2-Lite's form): the queries straight from q_proj."""
    import transformers

    config = families.hf_config("deepseek_v3")
    config.q_lora_rank = None
    torch.manual_seed(0)
    torch_model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    families.peaky_random_weights(torch_model, seed=0)
    torch_model.eval().save_pretrained(tmp_path)
    model = specjax.load(tmp_path)
    assert model.config.q_lora_rank is None and model.params.layers[0].q_a is None
    assert compare_with_torch(model, torch_model, families.prompts(), [[3, 4], [5, 6]]) < TOL


def test_glm4_moe_reads_its_mtp_layers_apart(built, tmp_path):
    """A released GLM-4.5 carries num_nextn_predict_layers MTP layers after the decoder's
    (model.layers.{L + i}); they load into `model.mtp` and change nothing in the decoder. One
    with some of its tensors missing is refused naming them, and a layer past them too."""
    import shutil

    from safetensors.numpy import load_file, save_file

    model, _ = built("glm4_moe")
    folder = tmp_path / "with_mtp"
    shutil.copytree(built.folders["glm4_moe"], folder)
    tensors = load_file(folder / "model.safetensors")
    L, D = model.config.num_layers, model.config.hidden_size
    last = {  # the decoder's last layer (MoE) as the MTP layer's block
        name.replace(f"model.layers.{L - 1}.", f"model.layers.{L}."): value
        for name, value in tensors.items()
        if name.startswith(f"model.layers.{L - 1}.")
    }
    own = {
        f"model.layers.{L}.eh_proj.weight": np.ones((D, 2 * D), np.float32),
        f"model.layers.{L}.enorm.weight": np.ones((D,), np.float32),
        f"model.layers.{L}.hnorm.weight": np.ones((D,), np.float32),
        f"model.layers.{L}.shared_head.norm.weight": np.ones((D,), np.float32),
    }
    save_file(tensors | last | own, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = specjax.load(folder)
    for name, value in flatten(loaded.params).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(flatten(model.params)[name]))
    assert len(loaded.mtp) == 1
    np.testing.assert_array_equal(
        np.asarray(loaded.mtp[0].block.router), np.asarray(model.params.layers[-1].router)
    )
    assert loaded.mtp[0].eh_proj.shape == (2 * D, D)
    partial = {name: value for name, value in own.items() if "hnorm" not in name}
    save_file(tensors | last | partial, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"MTP layer 0 \\(model.layers.{L}\\) lacks 'hnorm'"):
        specjax.load(folder)
    beyond = {f"model.layers.{L + 1}.enorm.weight": np.ones((D,), np.float32)}
    save_file(tensors | last | own | beyond, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"model.layers.{L + 1}.enorm.weight"):
        specjax.load(folder)


@pytest.mark.parametrize(
    "config, field",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; supported: llama, mistral"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' needs original_max_position"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "rope_scaling type 'longrope'"),
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ({"attention_sink": True}, "attention_sink=True is not supported"),
        ({"model_type": "gemma3", "text_config": {}}, "multimodal Gemma 3"),
    ],
)
def test_unsupported_options_are_refused_at_load(tmp_path, config, field):
    families.save_folder("llama3", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    if "rope_parameters" in config or "rope_scaling" in config:
        hf.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(hf | config))
    with pytest.raises(ValueError, match=field):
        specjax.load(tmp_path)


def test_prefill_logits_do_not_depend_on_the_batch(built):
    """Rows of one padded prefill (different lengths past the window) give what each gets alone."""
    model, _ = built("gemma3")
    prompts = families.prompts(lengths=(64, 41, 17), seed=3)
    together, _ = prefill_and_decode(model, prompts, [[], [], []])
    for b, prompt in enumerate(prompts):
        alone, _ = prefill_and_decode(model, [prompt], [[]])
        assert relative_error(together[b], alone[0]) < 1e-5


# The default set keeps the mixture with q/k norms (its experts and router are what a mesh splits
# differently from a dense model, tests/test_sharding.py covers those); `make test-all` all three.
@pytest.mark.parametrize(
    "family",
    [
        pytest.param("gemma3", marks=pytest.mark.slow),
        pytest.param("mixtral", marks=pytest.mark.slow),
        "qwen3_moe",
        pytest.param("glm4_moe", marks=pytest.mark.slow),
        pytest.param("deepseek_v3", marks=pytest.mark.slow),
        pytest.param("gpt_oss", marks=pytest.mark.slow),  # 100 s here: sinks split by head, biases once
    ],
)
def test_on_a_mesh_equals_one_device(built, family):
    """Loaded straight onto a 2 x 2 mesh of fake CPU devices (each weight sent slice by slice:
    the experts split over F like an MLP, q/k norms and routers replicated), plain decoding and
    speculation give one device's tokens."""
    model, _ = built(family)
    mesh = specjax.sharding.make_mesh(model=2, data=2, devices=jax.devices()[:4])
    on_mesh = specjax.load(built.folders[family], mesh=mesh)
    for name, value in flatten(on_mesh.params).items():
        np.testing.assert_array_equal(
            np.asarray(value), np.asarray(flatten(model.params)[name]), err_msg=name
        )
    experts = on_mesh.params.layers[0].expert_gate
    if experts is not None:  # [X, D, F] split over F: each device holds every expert's half
        assert experts.sharding.shard_shape(experts.shape)[-1] == experts.shape[-1] // 2
    prompts = families.prompts(lengths=(33, 20), seed=2)
    for proposer in (None, specjax.SelfDraft(layers=1, k=3), specjax.NGram(k=4)):
        want = specjax.generate(model, prompts, proposer=proposer, max_new_tokens=24).tokens
        got = specjax.generate(on_mesh, prompts, proposer=proposer, max_new_tokens=24, mesh=mesh).tokens
        assert got == want, proposer


def test_estimate_memory_counts_what_is_placed(built):
    """estimate_memory's weights are the bytes each device of a 2 x 2 mesh holds once loaded, its
    cache the target's cache split over rows and kv heads; in bfloat16 both halve."""
    model, _ = built("qwen3_moe")
    mesh = specjax.sharding.make_mesh(model=2, data=2, devices=jax.devices()[:4])
    on_mesh = specjax.load(built.folders["qwen3_moe"], mesh=mesh)
    device = jax.devices()[0]
    held = sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(on_mesh.params)
        for shard in leaf.addressable_shards
        if shard.device == device
    )
    estimate = specjax.estimate_memory(model.config, 4, 100, "float32", mesh=mesh)
    assert estimate.weights == held
    cache = specjax.models.init_cache(model.config, 4, 100)
    assert estimate.kv_cache == sum(x.nbytes for x in cache.k + cache.v) // 4
    half = specjax.estimate_memory(model.config, 4, 100, "bfloat16", mesh={"data": 2, "model": 2})
    assert (half.weights, half.kv_cache) == (held // 2, estimate.kv_cache // 2)
    with pytest.raises(ValueError, match="mesh as a dict"):
        specjax.estimate_memory(model.config, 4, 100, mesh={"model": 0})
    with pytest.raises(ValueError, match="model degree of 3 does not divide"):
        specjax.estimate_memory(model.config, 4, 100, mesh={"model": 3})
