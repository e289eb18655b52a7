"""`export_generate`: the whole generation program lowered for CUDA and TPU from this CPU host.

Every proposer and (in make test-all) every family in float32 and bfloat16 lowers for both
platforms; the modules hold no CPU custom call (`specjax_*`, built for this host) and their
attention goes through the Pallas kernels on both (`tpu_custom_call` for TPU, a Mosaic GPU or
Triton custom call for CUDA). A program exported for the CPU, serialized and read back, gives
`generate`'s tokens: the export path runs the same program.
"""

from __future__ import annotations

import re

import families
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

import specjax
from specjax.models import DFlashHead, Eagle3Head, EagleHead, MedusaHead, MLPSpeculatorHead, init_params
from specjax.models.families import config_from_hf
from specjax.models.mtp import init_mtp_layer
from specjax.models.quantized import quantize_params
from specjax.speculate.tree import TokenTree

# Head dim 64: a size the accelerators' kernels are built for (tiny_model's default is 16).
TARGET = tiny_model(seed=3, hidden_size=128, num_heads=2, num_kv_heads=1, num_layers=4)
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 7]]
GPU_KERNELS = ("mosaic_gpu", "mosaic_gpu_v2", "__gpu$xla.gpu.triton")


def custom_calls(exported: jax.export.Exported) -> set[str]:
    """The custom-call targets in an exported module (never print the module: megabytes)."""
    text = exported.mlir_module()
    named = re.findall(r"stablehlo\.custom_call @([\w.$]+)", text)
    return set(named) | set(re.findall(r'call_target_name = "([^"]+)"', text))


def assert_accelerator_program(exported: jax.export.Exported) -> None:
    calls = custom_calls(exported)
    assert not {c for c in calls if c.startswith("specjax_")}, calls
    assert "tpu_custom_call" in calls, calls
    assert calls & set(GPU_KERNELS), calls


def proposers():
    key = jax.random.key(0)
    eagle3 = Eagle3Head.init(TARGET, key, aux_layer_ids=(0, 2, 4), scale=1.0)
    dflash = DFlashHead.init(TARGET, key, block_size=4, num_layers=1, aux_layer_ids=(1, 3), scale=1.0)
    medusa = MedusaHead.init(TARGET, num_heads=2, key=key)
    return {
        "ngram": specjax.NGram(k=3),
        "draft": specjax.DraftModel(tiny_model(seed=4, hidden_size=128, num_heads=2, num_kv_heads=1), k=3),
        "self_draft": specjax.SelfDraft(layers=1, k=2),
        # the target's int8 copy, its cache started from the target's over the prompt
        "draft_prompt": specjax.DraftModel(
            specjax.Model(TARGET.config, quantize_params(TARGET.params, "int8")), k=3, prompt_from_target=True
        ),
        "medusa_tree": specjax.Medusa(medusa, tree=TokenTree.top_k((2, 2))),
        "eagle": specjax.Eagle(EagleHead.init(TARGET, key), k=3),
        "eagle3_tree": specjax.Eagle3(eagle3, tree=TokenTree.top_k((2, 1))),
        "dflash": specjax.DFlash(dflash),
        "mlp_speculator": specjax.MLPSpeculator(
            MLPSpeculatorHead.init(TARGET, n_predict=3, inner_dim=64, tie_weights=True, scale_input=True)
        ),
        "hybrid": specjax.Hybrid(specjax.NGram(k=3, n_min=2), specjax.Eagle3(eagle3, k=3)),
        "dynamic": specjax.Dynamic(specjax.NGram(k=3)),
    }


PROPOSERS = proposers()


@pytest.mark.parametrize("name", ["plain", *PROPOSERS])
def test_every_proposer_lowers_for_cuda_and_tpu(name):
    exported = specjax.export_generate(
        TARGET, PROMPTS, proposer=PROPOSERS.get(name), max_new_tokens=8, platforms=("cuda", "tpu")
    )
    assert exported.platforms == ("cuda", "tpu")
    assert_accelerator_program(exported)


def test_a_paged_generation_lowers_with_the_kernels_reading_pages():
    """On pages of 128 slots (a block of either kernel) the program lowers for cuda and tpu with
    each platform's Pallas kernel reading the pools through the tables, its prefill packed, and
    no CPU kernel: an EAGLE tree's verify passes and moves through the tables."""
    backend = specjax.kernels.backend.Backend(("cuda", "tpu"), "auto")
    assert backend.cache_attention_reads_pages(TARGET.config.head_dim, "float32", 128)
    tree = TokenTree.top_k((2, 1))
    exported = specjax.export_generate(
        TARGET,
        PROMPTS,
        proposer=specjax.Eagle(EagleHead.init(TARGET, jax.random.key(0)), tree=tree),
        max_new_tokens=8,
        page_size=128,
    )
    assert_accelerator_program(exported)


def test_sampled_generation_with_a_tree_lowers():
    exported = specjax.export_generate(
        TARGET,
        PROMPTS,
        proposer=PROPOSERS["medusa_tree"],
        sampling=specjax.Sampling(temperature=0.8, top_p=0.9),
        key=jax.random.key(1),
        max_new_tokens=8,
    )
    assert_accelerator_program(exported)


def test_a_data_2_model_2_mesh_lowers():
    mesh = specjax.sharding.make_mesh(data=2, model=2)
    model = tiny_model(seed=3, hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=2)
    exported = specjax.export_generate(
        model, PROMPTS, proposer=specjax.NGram(k=3), max_new_tokens=8, mesh=mesh
    )
    assert exported.nr_devices == 4
    assert_accelerator_program(exported)


def test_a_replicated_draft_from_the_targets_split_cache_lowers():
    """DraftModel(prompt_from_target=True), replicated on a data 2 x model 2 mesh: the target's
    split cache reordered into the draft's rows (sharding.mesh_entries_by_row) in the program."""
    mesh = specjax.sharding.make_mesh(data=2, model=2)
    model = tiny_model(seed=3, hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=2)
    proposer = specjax.DraftModel(model, k=3, prompt_from_target=True)
    exported = specjax.export_generate(model, PROMPTS, proposer=proposer, max_new_tokens=8, mesh=mesh)
    assert exported.nr_devices == 4
    assert_accelerator_program(exported)


# The default suite lowers Gemma 3 in bfloat16 (windows, interleaved rotary bases; the proposers'
# tests above lower Llama in float32); make test-all lowers every family in both dtypes.
def with_mtp_layers(model: specjax.Model, num_layers: int = 1) -> specjax.Model:
    keys = jax.random.split(jax.random.key(5), num_layers)
    layers = tuple(init_mtp_layer(model.config, key, model.params.dtype) for key in keys)
    return specjax.Model(model.config, model.params, name=model.name, mtp=layers)


@pytest.mark.parametrize(
    "family, num_layers, proposer, sampling",
    [
        (None, 1, specjax.MTP(tree=TokenTree.top_k((2, 1))), None),
        # two layers in turn (step 2 runs layer 0 again), drafts sampled from the warped MTP logits
        (None, 2, specjax.MTP(k=3), specjax.Sampling(temperature=0.8, top_k=5)),
        (None, 1, specjax.WithNGram(specjax.MTP(k=1), specjax.NGram(k=2)), None),  # FastDeploy's with_ngram
        pytest.param(
            "deepseek_v3", 1, specjax.MTP(k=2), None, marks=pytest.mark.slow
        ),  # latent-attention MoE
    ],
)
def test_mtp_lowers_for_cuda_and_tpu(family, num_layers, proposer, sampling):
    model = with_mtp_layers(TARGET if family is None else family_model(family, "float32"), num_layers)
    exported = specjax.export_generate(
        model,
        PROMPTS,
        proposer=proposer,
        sampling=sampling,
        key=None if sampling is None else jax.random.key(0),
        max_new_tokens=8,
        platforms=("cuda", "tpu"),
    )
    assert exported.platforms == ("cuda", "tpu")
    calls = custom_calls(exported)
    assert not {c for c in calls if c.startswith("specjax_")}, calls
    if family is None:
        assert_accelerator_program(exported)


DEFAULT_FAMILIES = {("gemma3", "bfloat16"), ("gpt_oss", "float32")}  # gpt-oss: sinks in the Pallas kernels
# DeepSeek-V3's latent attention has no Pallas kernel yet (it attends with XLA on every platform):
# test_latent_attention_lowers_for_cuda_and_tpu checks what holds for it.
LATENT_FAMILIES = ("deepseek_v3",)
FAMILY_CASES = [
    pytest.param(family, dtype, marks=() if (family, dtype) in DEFAULT_FAMILIES else pytest.mark.slow)
    for family in families.FAMILIES
    if family not in LATENT_FAMILIES
    for dtype in ("float32", "bfloat16")
]


def family_model(family: str, dtype: str) -> specjax.Model:
    """A random model of `family` (its tiny test config, tests/families.py) with head dim 64."""
    hf = families.hf_config(family)
    hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim = 128, 2, 1, 64
    config = config_from_hf(hf.to_dict())
    return specjax.Model(config, init_params(config, jax.random.key(0), getattr(jnp, dtype)))


@pytest.mark.parametrize("family, dtype", FAMILY_CASES)
def test_every_family_lowers_for_cuda_and_tpu(family, dtype):
    model = family_model(family, dtype)
    exported = specjax.export_generate(model, PROMPTS, proposer=specjax.NGram(k=2), max_new_tokens=6)
    assert_accelerator_program(exported)


@pytest.mark.parametrize("family", LATENT_FAMILIES)
def test_latent_attention_lowers_for_cuda_and_tpu(family):
    """Latent attention over the accelerators' stacked layers and cache (which once indexed a
    layer of the stacked latent cache with keepdims left on) lowers for CUDA and TPU, with no
    CPU kernel in the program."""
    model = family_model(family, "float32")
    exported = specjax.export_generate(model, PROMPTS, proposer=specjax.NGram(k=2), max_new_tokens=6)
    assert exported.platforms == ("cuda", "tpu")
    calls = custom_calls(exported)
    assert not {c for c in calls if c.startswith("specjax_")}, calls


def test_a_float32_model_exports_float32_products():
    """A float32 model's products are float32 on every platform (HIGHEST precision on every
    dot); matmul_precision="default" leaves the platform's default."""
    exported = specjax.export_generate(TARGET, PROMPTS, max_new_tokens=4, platforms=("cuda",))
    dots = re.findall(r"stablehlo\.dot_general.*", exported.mlir_module())
    assert dots and all("HIGHEST" in dot for dot in dots), [d for d in dots if "HIGHEST" not in d][:2]
    loose = specjax.export_generate(
        TARGET, PROMPTS, max_new_tokens=4, platforms=("cuda",), matmul_precision="default"
    )
    assert not any("HIGHEST" in dot for dot in re.findall(r"stablehlo\.dot_general.*", loose.mlir_module()))


@pytest.mark.parametrize("proposer", [None, "eagle3_tree"])
def test_a_cpu_export_read_back_gives_generates_tokens(proposer):
    proposer = PROPOSERS.get(proposer)
    options = dict(proposer=proposer, max_new_tokens=10, platforms=("cpu",))
    exported = specjax.export_generate(TARGET, PROMPTS, **options)
    assert not {c for c in custom_calls(exported) if c.startswith("specjax_")}
    program = jax.export.deserialize(exported.serialize())
    tokens, lengths = program.call(*specjax.export_arguments(TARGET, PROMPTS, **options))
    want = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=10).tokens
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    got = [tokens[b, len(p) : lengths[b]].tolist() for b, p in enumerate(PROMPTS)]
    assert got == want


@pytest.mark.parametrize(
    "platforms, match",
    [((), "platforms must be"), (("gpu",), "platforms must be"), (("tpu", "tpu"), "distinct")],
)
def test_bad_platforms_are_refused(platforms, match):
    with pytest.raises(ValueError, match=match):
        specjax.export_generate(TARGET, PROMPTS, platforms=platforms)


def test_bad_kernel_choices_are_refused():
    with pytest.raises(ValueError, match="kernels must be one of"):
        specjax.generate(TARGET, PROMPTS, kernels="triton", max_new_tokens=2)
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        specjax.generate(TARGET, PROMPTS, matmul_precision="fp8", max_new_tokens=2)


def test_heads_the_device_kernels_do_not_take_attend_with_xla_under_auto():
    """A tiny model's heads (16 wide) are not a size the Pallas kernels are built for on a device:
    kernels="auto" lowers its attention as plain XLA (the same program "xla" gives, no Pallas
    call), where an explicit "pallas:cuda" names the head dim and what is allowed."""
    tiny = tiny_model(seed=3)
    assert tiny.config.head_dim == 16
    auto = specjax.export_generate(tiny, PROMPTS, max_new_tokens=4, platforms=("cuda", "tpu"))
    calls = custom_calls(auto)
    assert "tpu_custom_call" not in calls and not calls & set(GPU_KERNELS), calls
    xla = specjax.export_generate(tiny, PROMPTS, max_new_tokens=4, platforms=("cuda", "tpu"), kernels="xla")

    def code(exported):  # the module without its source locations (the two calls' lines differ)
        lines = exported.mlir_module().splitlines()
        return [re.sub(r" loc\(#loc\d*\)", "", line) for line in lines if not line.startswith("#loc")]

    assert code(auto) == code(xla)
    with pytest.raises(
        ValueError, match=r"head dim \(last axis of queries\) is 16; allowed for implementation 'cuda'"
    ):
        specjax.export_generate(tiny, PROMPTS, max_new_tokens=4, platforms=("cuda",), kernels="pallas:cuda")


def test_bfloat16_keeps_the_platforms_default_precision():
    model = specjax.Model(TARGET.config, jax.tree.map(lambda x: x.astype(jnp.bfloat16), TARGET.params))
    exported = specjax.export_generate(model, PROMPTS, max_new_tokens=4, platforms=("cuda",))
    assert not any("HIGHEST" in d for d in re.findall(r"stablehlo\.dot_general.*", exported.mlir_module()))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_the_engines_chunk_lowers_for_gpu_and_tpu(scan_layers):
    """The continuous batch's chunk (`resume_program`, specjax/serve/engine.py) exports for CUDA
    and TPU like `generate`'s program: Pallas attention, no CPU kernel, layers scanned or not."""
    from specjax.kernels.backend import Backend
    from specjax.speculate.loop import GenerationInputs, LoopSpec, prefill, program_params, resume_program
    from specjax.speculate.proposers import resolve
    from specjax.speculate.sampling import SamplingParams, WarpSpec

    warp = WarpSpec()
    proposer, proposer_params = resolve(specjax.Dynamic(specjax.NGram(k=3)), TARGET, warp, None)
    backend = Backend(("cuda", "tpu"), "auto", "highest", portable=True, scan_layers=scan_layers)
    spec = LoopSpec(TARGET.config, 2, 16, 128, warp, proposer, backend=backend)
    inputs = GenerationInputs.simple(
        prompt_tokens=jnp.zeros((2, 16), jnp.int32),
        prompt_lengths=jnp.asarray([7, 3], jnp.int32),
        max_new_tokens=jnp.asarray([20, 20], jnp.int32),
        sampling=SamplingParams.of(specjax.Sampling(), 2, TARGET.config.vocab_size),
        key=jax.random.key(0),
    )

    def first_state(params, proposer_params, inputs):
        with backend.tracing():
            params, proposer_params = program_params(spec, params, proposer_params)
            return params, proposer_params, prefill(spec, params, proposer_params, inputs)

    params, proposer_params, state = jax.eval_shape(first_state, TARGET.params, proposer_params, inputs)

    def chunk(params, proposer_params, state, inputs, max_steps, reported):
        return resume_program(spec, params, proposer_params, state, inputs, max_steps, reported, 9)

    max_steps = jax.ShapeDtypeStruct((), jnp.int32)
    reported = jax.ShapeDtypeStruct((2,), jnp.int32)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # as export_generate
    exported = jax.export.export(jax.jit(chunk), platforms=("cuda", "tpu"), disabled_checks=[triton])(
        params, proposer_params, state, inputs, max_steps, reported
    )
    assert_accelerator_program(exported)


@pytest.mark.parametrize("proposer", ["grammar_draft", "eagle_tree"])
def test_constrained_generation_lowers_for_cuda_and_tpu(proposer):
    """A JSON-schema row beside a free one: the automaton's tables, the masks along chain and tree
    paths and GrammarDraft's forced drafts lower with the rest (test_structured.py's tiny model,
    which has a tokenizer to compile the constraint over)."""
    from test_structured import SCHEMA
    from test_structured import TARGET as WITH_TOKENIZER

    drafting = {
        "grammar_draft": specjax.GrammarDraft(k=4),
        "eagle_tree": specjax.Eagle(
            EagleHead.init(WITH_TOKENIZER, jax.random.key(0)), tree=TokenTree.top_k((2, 2))
        ),
    }[proposer]
    exported = specjax.export_generate(
        WITH_TOKENIZER,
        [[10, 11, 12], [13, 14]],
        proposer=drafting,
        sampling=[specjax.Sampling(json_schema=SCHEMA, temperature=0.8), specjax.Sampling(temperature=0.8)],
        key=jax.random.key(1),
        max_new_tokens=8,
    )
    assert exported.platforms == ("cuda", "tpu")
    # (no CPU kernel in it; this model's head size takes XLA's attention, not the Pallas kernels)
    assert not {c for c in custom_calls(exported) if c.startswith("specjax_")}
