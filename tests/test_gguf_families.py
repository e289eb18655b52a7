"""GGUF files of the families whose architecture llama.cpp's format names: llama (Llama, Mistral,
Mixtral), qwen2, qwen3, qwen3moe, gemma3, glm4moe (GLM-4.5), deepseek2 (DeepSeek-V3) and gpt-oss.
Each is written here from a tiny random HF folder (tests/families.py) the way llama.cpp's converter
(convert_hf_to_gguf.py) writes it: its metadata keys, gguf-py's own tensor name map, q/k rows
reordered for llama only, Gemma's norms stored as 1 + w, DeepSeek's kv_b_proj split per head into
attn_k_b (transposed) and attn_v_b, gpt-oss's interleaved gate_up_proj split into gate and up.
`specjax.load` must read from the .gguf the config and weights it reads from the folder, and give
transformers' logits over 64-token prompts (past the sliding windows of 16)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import families
import gguf
import numpy as np
import pytest
import torch
import transformers
from logit_check import compare_with_torch, prefill_and_decode, relative_error

import specjax
from specjax.models import gguf_loader
from specjax.models.checkpoint import flatten
from specjax.models.tensors import open_safetensors

TOL = 1e-4  # relative float32 logit error (max abs diff / max abs logit, worst position)
# Config fields the two loads may differ in: model_type, as GGUF's llama architecture holds Llama
# and Mistral alike. The other fields a GGUF may lack are compared: bos/eos ids come with a
# tokenizer (these tiny configs have none either), max_position_embeddings as context_length.
IGNORED_FIELDS = ("model_type",)
LLAMA_CPP_ARCH = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # tests/families.py
    arch: str  # general.architecture
    # Changes to the family's tiny config that the format needs (see the cases below).
    overrides: tuple[tuple[str, object], ...] = ()
    # Write {arch}.attention.sliding_window, which llama.cpp's converter leaves out for llama: the
    # format can hold Mistral's window, the converter just does not write it (llama.cpp runs
    # Mistral with full attention).
    window_key: bool = False


# The converter drops DeepSeek's MTP layers and stores mscale_all_dim alone (as
# yarn_log_multiplier): mscale is taken equal to it, as in DeepSeek-V3's own config.
DEEPSEEK_AS_CONVERTED = (
    ("num_nextn_predict_layers", 0),
    (
        "rope_parameters",
        dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=32,
            mscale=0.5,
            mscale_all_dim=0.5,
        ),
    ),
)
CASES = {
    "mistral": Case("mistral", "llama", window_key=True),
    "mixtral": Case("mixtral", "llama", window_key=True),
    "qwen2": Case("qwen2", "qwen2"),
    "qwen3": Case("qwen3", "qwen3"),
    # qwen3moe has no dense-MLP tensor names: mlp_only_layers cannot be written.
    "qwen3_moe": Case("qwen3_moe", "qwen3moe", overrides=(("mlp_only_layers", []),)),
    # query_pre_attn_scalar is not stored; llama.cpp takes head_dim (32 here), as Gemma 3's 1B-12B do.
    "gemma3": Case("gemma3", "gemma3", overrides=(("query_pre_attn_scalar", 32),)),
    "glm4_moe": Case("glm4_moe", "glm4moe"),
    "deepseek_v3": Case("deepseek_v3", "deepseek2", overrides=DEEPSEEK_AS_CONVERTED),
    # Queries straight from the hidden state (no q_lora_rank): DeepSeek's attn_q.
    "deepseek_v3_direct_q": Case(
        "deepseek_v3", "deepseek2", overrides=(*DEEPSEEK_AS_CONVERTED, ("q_lora_rank", None))
    ),
    # swiglu_limit is not stored: llama.cpp's constant 7 (the family's tiny config clamps at 2).
    "gpt_oss": Case("gpt_oss", "gpt-oss", overrides=(("swiglu_limit", 7.0),)),
}
# The cases run by default (the others are slow): one of the three families added together.
DEFAULT_CASES = ("mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "glm4_moe")


def build_folder(case: Case, folder: Path) -> torch.nn.Module:
    """The family's tiny random float32 model with the case's overrides, saved to `folder`."""
    config = families.hf_config(case.family)
    for name, value in case.overrides:
        setattr(config, name, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    families.peaky_random_weights(model.float(), seed=0)
    model.eval().save_pretrained(folder)
    return model


# ---------------------------------------------------------------------------------------------
# A GGUF written from an HF folder as llama.cpp's converter writes it


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The converter's reorder of llama's q/k rows: per head, rows (i, i + E/2) become neighbours."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@dataclasses.dataclass(frozen=True)
class Raw:
    """A tensor's bytes in a quantized GGML type (gguf.quants.quantize's output)."""

    data: np.ndarray
    kind: gguf.GGMLQuantizationType


def write_gguf(
    path: Path,
    folder: Path,
    case: Case,
    *,
    window_pattern: object = "layer_types",
    f16: bool = False,
    edit=None,
    extra: dict | None = None,
) -> None:
    """Write the folder's model as a GGUF of `case.arch`.

    window_pattern: gemma3's attention.sliding_window_pattern: "layer_types" writes config.json's
        layer_types as a bool per layer (which llama.cpp reads; its converter writes none), None
        writes nothing, an int writes that int.
    f16: store matrices as F16 (the converter's default outtype), vectors as F32.
    edit: `edit(tensors)` changes the {GGUF name: array} dict before it is written; a `Raw`
        value is written as its bytes of a quantized type.
    extra: more metadata, {key: (value, GGUFValueType)}.
    """
    hp = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), case.arch)
    _write_metadata(writer, hp, case, window_pattern)
    for key, (value, kind) in (extra or {}).items():
        writer.add_key_value(key, value, kind)
    tensors = _converted_tensors(hp, folder, case.arch)
    if edit is not None:
        edit(tensors)
    for name, array in tensors.items():
        if isinstance(array, Raw):
            writer.add_tensor(name, array.data, raw_dtype=array.kind)
        else:
            writer.add_tensor(name, array.astype(np.float16) if f16 and array.ndim >= 2 else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_metadata(writer, hp: dict, case: Case, window_pattern) -> None:
    """The keys TextModel.set_gguf_parameters and the architecture's model class write."""
    arch = case.arch
    # GLM-4.5's MTP layers are blocks too (transformers' save_pretrained drops their weights).
    writer.add_block_count(hp["num_hidden_layers"] + (hp.get("num_nextn_predict_layers") or 0))
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(1 if arch == "deepseek2" else hp["num_key_value_heads"])
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    full = rope.get("full_attention", rope)  # Gemma 3: one entry per layer type
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if full.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if "beta_fast" in full:
            writer.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
        if arch == "deepseek2" and full.get("mscale_all_dim"):
            writer.add_rope_scaling_yarn_log_mul(0.1 * full["mscale_all_dim"])
    writer.add_rope_freq_base(full.get("rope_theta", hp.get("rope_theta")))
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(local)
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    experts = hp.get("num_local_experts") or hp.get("num_experts") or hp.get("n_routed_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim") is not None and arch != "deepseek2":
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    if arch in ("glm4moe", "deepseek2"):
        _write_sigmoid_experts(writer, hp, arch)
    if arch == "gpt-oss":
        writer.add_sliding_window(hp["sliding_window"])
        writer.add_expert_feed_forward_length(hp["intermediate_size"])
    if arch == "llama":
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if arch == "gemma3":
        if hp.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
        writer.add_sliding_window(hp["sliding_window"])
        if window_pattern == "layer_types":
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in hp["layer_types"]])
        elif window_pattern is not None:
            writer.add_sliding_window_pattern(window_pattern)
    if case.window_key and hp.get("sliding_window"):
        writer.add_sliding_window(hp["sliding_window"])


def _write_sigmoid_experts(writer, hp: dict, arch: str) -> None:
    """Glm4MoeModel's and DeepseekV2Model's keys (with the base class's expert groups and, from
    the released configs' scoring_func, the sigmoid gating): the mixture, GLM's partial rotary,
    DeepSeek's latent attention as one kv head with the heads' sizes apart."""
    writer.add_expert_group_count(hp["n_group"])
    writer.add_expert_group_used_count(hp["topk_group"])
    writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    writer.add_expert_shared_count(hp["n_shared_experts"])
    writer.add_leading_dense_block_count(hp["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(hp["routed_scaling_factor"])
    writer.add_expert_weights_norm(hp["norm_topk_prob"])
    if arch == "glm4moe":
        rope = hp.get("rope_parameters") or {}
        writer.add_rope_dimension_count(int(hp["head_dim"] * rope.get("partial_rotary_factor", 0.5)))
        writer.add_nextn_predict_layers(hp["num_nextn_predict_layers"])
        return
    rank, rope_dim = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    writer.add_vocab_size(hp["vocab_size"])
    if hp["q_lora_rank"]:
        writer.add_q_lora_rank(hp["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    writer.add_key_length(rank + rope_dim)
    writer.add_value_length(rank)
    writer.add_key_length_mla(hp["qk_nope_head_dim"] + rope_dim)
    writer.add_value_length_mla(hp["v_head_dim"])
    writer.add_rope_dimension_count(rope_dim)


def _converted_tensors(hp: dict, folder: Path, arch: str) -> dict[str, np.ndarray]:
    """{GGUF name: array in HF's layout} as the converter's modify_tensors yields them: experts
    stacked [X, out, in], llama's q/k rows reordered, Gemma's norms plus 1, names from gguf-py's
    tensor map (a name it cannot map is an error there too)."""
    hf = {name: tensor.read() for name, tensor in open_safetensors(folder / "model.safetensors").items()}
    names = gguf.get_tensor_name_map(LLAMA_CPP_ARCH[arch], hp["num_hidden_layers"])
    heads, kv_heads = hp["num_attention_heads"], hp["num_key_value_heads"]
    stacked = re.compile(r"model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.experts\.0\.(\w+)\.weight")
    if arch == "gpt-oss":
        hf = _gpt_oss_split(hf)
    if arch == "deepseek2":
        hf = _deepseek_split(hf, hp)
    out = {}
    for name in sorted(hf):
        array = hf[name]
        if name.endswith("e_score_correction_bias"):  # the converter's rename, for its name map
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if re.search(r"\.experts\.\d+\.", name):  # one expert's (gpt-oss's come stacked)
            match = stacked.fullmatch(name)
            if not match:
                continue  # stacked with expert 0
            layer, block, weight = match.groups()
            count = hp.get("num_local_experts") or hp.get("num_experts") or hp["n_routed_experts"]
            array = np.stack([hf[name.replace(".experts.0.", f".experts.{j}.")] for j in range(count)])
            # The converter's merged names: Mixtral's feed_forward.experts.w1, Qwen's mlp.experts.gate_proj.
            name = (
                f"layers.{layer}.feed_forward.experts.{weight}.weight"
                if block == "block_sparse_moe"
                else f"model.layers.{layer}.mlp.experts.{weight}.weight"
            )
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = llama_cpp_permute(array, heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = llama_cpp_permute(array, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + np.float32(1)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"the converter cannot map {name} for {arch}")
        out[gguf_name] = np.ascontiguousarray(array, np.float32)
    return out


def _gpt_oss_split(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GptOssModel.modify_tensors on float experts: gate_up_proj [X, D, 2F] transposed to
    [X, 2F, D] and split by row parity into gate and up (biases likewise), down_proj transposed;
    sinks named as weights."""
    out = {}
    for name, array in hf.items():
        if name.endswith("self_attn.sinks"):
            out[name + ".weight"] = array
        elif name.endswith("gate_up_proj"):
            rows = array.swapaxes(1, 2)
            base = name.removesuffix("gate_up_proj")
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = rows[:, ::2], rows[:, 1::2]
        elif name.endswith("gate_up_proj_bias"):
            base = name.removesuffix("gate_up_proj_bias")
            out[base + "gate_proj.bias"], out[base + "up_proj.bias"] = array[..., ::2], array[..., 1::2]
        elif name.endswith("down_proj"):
            out[name + ".weight"] = array.swapaxes(1, 2)
        elif name.endswith("down_proj_bias"):
            out[name.replace("down_proj_bias", "down_proj.bias")] = array
        else:
            out[name] = array
    return out


def _deepseek_split(hf: dict[str, np.ndarray], hp: dict) -> dict[str, np.ndarray]:
    """DeepseekV2Model.modify_tensors' split of kv_b_proj [H * (nope + v), R] into k_b_proj
    [H, R, nope] (the key rows, transposed) and v_b_proj [H, v, R]."""
    nope, v, heads = hp["qk_nope_head_dim"], hp["v_head_dim"], hp["num_attention_heads"]
    out = {}
    for name, array in hf.items():
        if not name.endswith("kv_b_proj.weight"):
            out[name] = array
            continue
        per_head = array.reshape(heads, nope + v, array.shape[-1])
        out[name.replace("kv_b_proj", "k_b_proj")] = per_head[:, :nope].swapaxes(1, 2)
        out[name.replace("kv_b_proj", "v_b_proj")] = per_head[:, nope:]
    return out


# ---------------------------------------------------------------------------------------------
# The same model from the .gguf and from the folder


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case name -> (folder holding hf/ and <name>.gguf, the torch model), each built once."""
    cache = {}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            torch_model = build_folder(CASES[name], root / "hf")
            write_gguf(root / f"{name}.gguf", root / "hf", CASES[name])
            cache[name] = (root, torch_model)
        return cache[name]

    return get


def comparable(config) -> dict:
    fields = dataclasses.asdict(config)
    return {name: value for name, value in fields.items() if name not in IGNORED_FIELDS}


@pytest.mark.parametrize(
    "name", [name if name in DEFAULT_CASES else pytest.param(name, marks=pytest.mark.slow) for name in CASES]
)
def test_gguf_matches_folder_and_transformers(built, name):
    root, torch_model = built(name)
    from_gguf = specjax.load(root / f"{name}.gguf", cache_dir=root / "cache")
    from_folder = specjax.load(root / "hf")
    assert comparable(from_gguf.config) == comparable(from_folder.config)
    assert from_gguf.config.model_type == {"mistral": "llama"}.get(name, from_folder.config.model_type)

    ours, reference = flatten(from_gguf.params), flatten(from_folder.params)
    assert ours.keys() == reference.keys()
    for leaf, value in ours.items():
        # Gemma's norms went through 1 + w and back in float32: within half an ulp of 1 + w.
        atol = 1e-6 if from_gguf.config.norm == "gemma" and leaf.endswith("norm") else 0.0
        np.testing.assert_allclose(
            np.asarray(value), np.asarray(reference[leaf]), rtol=0, atol=atol, err_msg=leaf
        )

    continuations = [[3, 4, 5, 6], [7, 8, 9, 10]]
    error = compare_with_torch(from_gguf, torch_model, families.prompts(), continuations)
    print(f"{name}: max relative logit error vs transformers {error:.1e}")
    assert error < TOL


def test_f16_tensors_dequantize(built, tmp_path):
    """The converter's default outtype: matrices F16, vectors F32. The loaded weights are the
    folder's rounded to float16, exactly."""
    root, _ = built("qwen2")
    path = tmp_path / "f16.gguf"
    write_gguf(path, root / "hf", CASES["qwen2"], f16=True)
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert kinds["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert kinds["blk.0.attn_q.bias"] == gguf.GGMLQuantizationType.F32
    ours = flatten(specjax.load(path, cache_dir=tmp_path / "cache").params)
    for leaf, value in flatten(specjax.load(root / "hf").params).items():
        value = np.asarray(value)
        expected = value.astype(np.float16).astype(np.float32) if value.ndim >= 2 else value
        np.testing.assert_array_equal(np.asarray(ours[leaf]), expected, err_msg=leaf)


# ---------------------------------------------------------------------------------------------
# What the format leaves unsaid


def test_mistral_as_converted_has_no_window(built, tmp_path):
    """llama.cpp's converter writes no window for Mistral: the file loads with full attention."""
    root, _ = built("mistral")
    path = tmp_path / "m.gguf"
    write_gguf(path, root / "hf", dataclasses.replace(CASES["mistral"], window_key=False))
    config = gguf_loader.read_gguf(path)[0]
    assert config.sliding_window is None and config.model_type == "llama"


@pytest.mark.parametrize(
    "pattern, sliding",
    [
        (None, [True, True, True, True]),  # llama.cpp's default: every sixth layer global
        (2, [True, False, True, False]),
        (3, [True, True, False, True]),
    ],
)
def test_gemma3_window_pattern(built, tmp_path, pattern, sliding):
    root, _ = built("gemma3")
    path = tmp_path / "g.gguf"
    write_gguf(path, root / "hf", CASES["gemma3"], window_pattern=pattern)
    config = gguf_loader.read_gguf(path)[0]
    assert [config.layer_window(i) == families.WINDOW for i in range(4)] == sliding
    assert config.query_pre_attn_scalar == 32.0 and config.local_rope_theta == 10000.0


# ---------------------------------------------------------------------------------------------
# Errors at the door


def test_missing_tensor_is_named(built, tmp_path):
    root, _ = built("mistral")
    path = tmp_path / "missing.gguf"
    write_gguf(path, root / "hf", CASES["mistral"], edit=lambda tensors: tensors.pop("blk.1.attn_k.weight"))
    with pytest.raises(ValueError, match=r"lacks tensors .*\['blk\.1\.attn_k\.weight'\]"):
        specjax.load(path, cache_dir=tmp_path / "cache")


def test_missing_glm_norm_is_named_as_glm_names_it(built, tmp_path):
    """GLM-4.5's MLP input norm is its post_attention_norm (Gemma 3's norm of the attention output)."""
    root, _ = built("glm4_moe")
    path = tmp_path / "missing.gguf"
    write_gguf(path, root / "hf", CASES["glm4_moe"], edit=lambda t: t.pop("blk.1.post_attention_norm.weight"))
    with pytest.raises(ValueError, match=r"lacks tensors .*\['blk\.1\.post_attention_norm\.weight'\]"):
        gguf_loader.read_gguf(path)


def test_misshapen_tensor_is_named(built, tmp_path):
    root, _ = built("mistral")
    path = tmp_path / "misshapen.gguf"

    def edit(tensors):
        tensors["blk.0.attn_v.weight"] = tensors["blk.0.attn_v.weight"][:-1]  # one row short

    write_gguf(path, root / "hf", CASES["mistral"], edit=edit)
    match = r"blk\.0\.attn_v\.weight \(layers\.0\.v\): got \(64, 31\), expected \(64, 32\)"
    with pytest.raises(ValueError, match=match):
        specjax.load(path, cache_dir=tmp_path / "cache")


def test_unsupported_key_is_named(built, tmp_path):
    root, _ = built("qwen3")
    path = tmp_path / "capped.gguf"
    extra = {"qwen3.attn_logit_softcapping": (50.0, gguf.GGUFValueType.FLOAT32)}
    write_gguf(path, root / "hf", CASES["qwen3"], extra=extra)
    with pytest.raises(ValueError, match="qwen3.attn_logit_softcapping = 50.0"):
        specjax.load(path, cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------------------------------------
# GLM-4.5, DeepSeek-V3 and gpt-oss: what their files may hold besides the tests above


@pytest.mark.slow
def test_gpt_oss_mxfp4_experts(built, tmp_path):
    """The converter keeps gpt-oss's experts in GGML's MXFP4: they read as gguf-py dequantizes
    them, bit for bit (and with quantization="gguf" too, dequantized with a warning naming them)."""
    root, _ = built("gpt_oss")
    path = tmp_path / "mxfp4.gguf"
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    stored = {}

    def edit(tensors):
        for name in [name for name in tensors if name.endswith("_exps.weight")]:
            stored[name] = gguf.quants.quantize(tensors[name], mxfp4)
            tensors[name] = Raw(stored[name], mxfp4)

    write_gguf(path, root / "hf", CASES["gpt_oss"], edit=edit)
    ours = flatten(specjax.load(path, cache_dir=tmp_path / "cache").params)
    for name, data in stored.items():
        layer, kind = re.fullmatch(r"blk\.(\d+)\.ffn_(\w+)_exps\.weight", name).groups()
        expected = gguf.quants.dequantize(data, mxfp4).swapaxes(1, 2)  # [X, out, in] -> ours
        np.testing.assert_array_equal(
            np.asarray(ours[f"layers.{layer}.expert_{kind}"]), expected, err_msg=name
        )
    with pytest.warns(UserWarning, match=r"blk\.0\.ffn_down_exps\.weight is MXFP4"):
        kept = specjax.load(path, quantization="gguf")
    np.testing.assert_array_equal(
        np.asarray(kept.params.layers[0].expert_down), np.asarray(ours["layers.0.expert_down"])
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3", "gpt_oss"])
def test_kept_q8_0_blocks(built, tmp_path, name):
    """quantization="gguf" on a Q8_0 file of these families: the projections and experts kept as
    blocks (shared experts, latent attention's projections and the router dequantized, as an FP8
    checkpoint's are), giving the logits of the file dequantized."""
    root, _ = built(name)
    path = tmp_path / "q8_0.gguf"
    q8_0 = gguf.GGMLQuantizationType.Q8_0

    def edit(tensors):
        for key, array in tensors.items():
            if array.ndim >= 2 and array.shape[-1] % 32 == 0 and key != "token_embd.weight":
                tensors[key] = Raw(gguf.quants.quantize(array, q8_0), q8_0)

    write_gguf(path, root / "hf", CASES[name], edit=edit)
    kept = specjax.load(path, quantization="gguf")
    assert type(kept.params.layers[1].expert_gate).__name__ == "QuantizedWeight"
    dequantized = specjax.load(path, cache_dir=tmp_path / "cache")
    prompts, continuations = families.prompts(), [[3, 4, 5], [6, 7, 8]]
    ours, reference = (prefill_and_decode(m, prompts, continuations) for m in (kept, dequantized))
    for b in range(len(prompts)):
        for part in range(2):
            assert relative_error(np.asarray(ours[part][b]), np.asarray(reference[part][b])) < TOL


@pytest.mark.slow
def test_deepseek_kv_b_as_older_converters_wrote_it(built, tmp_path):
    """Older converters kept kv_b_proj whole (attn_kv_b): the same weights as from the halves."""
    root, _ = built("deepseek_v3")
    path = tmp_path / "kv_b.gguf"
    hp = json.loads((root / "hf" / "config.json").read_text())
    nope, rank = hp["qk_nope_head_dim"], hp["kv_lora_rank"]

    def edit(tensors):
        for layer in range(hp["num_hidden_layers"]):
            k_b = tensors.pop(f"blk.{layer}.attn_k_b.weight")  # [H, R, nope]
            v_b = tensors.pop(f"blk.{layer}.attn_v_b.weight")  # [H, v, R]
            rows = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
            tensors[f"blk.{layer}.attn_kv_b.weight"] = rows.reshape(-1, rank)
        assert nope == k_b.shape[-1]

    write_gguf(path, root / "hf", CASES["deepseek_v3"], edit=edit)
    ours = flatten(specjax.load(path, cache_dir=tmp_path / "cache").params)
    reference = flatten(specjax.load(root / "hf").params)
    for leaf in ("layers.0.kv_b", "layers.2.kv_b"):
        np.testing.assert_array_equal(np.asarray(ours[leaf]), np.asarray(reference[leaf]), err_msg=leaf)


def test_fused_gate_up_experts(built, tmp_path):
    """The converter's --fuse-gate-up-exps: one ffn_gate_up_exps [X, 2F, D], gate's rows then
    up's, read as the two it joins."""
    root, _ = built("qwen3_moe")
    path = tmp_path / "fused.gguf"

    def edit(tensors):
        for layer in range(3):
            gate, up = (tensors.pop(f"blk.{layer}.ffn_{part}_exps.weight") for part in ("gate", "up"))
            tensors[f"blk.{layer}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)

    write_gguf(path, root / "hf", CASES["qwen3_moe"], edit=edit)
    ours = flatten(specjax.load(path, cache_dir=tmp_path / "cache").params)
    for leaf, value in flatten(specjax.load(root / "hf").params).items():
        np.testing.assert_array_equal(np.asarray(ours[leaf]), np.asarray(value), err_msg=leaf)


def test_softmax_routing_is_refused(built, tmp_path):
    """llama.cpp routes by softmax where expert_gating_func says 1 (or, for deepseek2, where it is
    absent: DeepSeek-V2's files); the sigmoid mixture's files say 2."""
    root, _ = built("glm4_moe")
    path = tmp_path / "softmax.gguf"
    extra = {"glm4moe.expert_gating_func": (1, gguf.GGUFValueType.UINT32)}
    write_gguf(path, root / "hf", CASES["glm4_moe"], extra=extra)
    with pytest.raises(ValueError, match=r"glm4moe\.expert_gating_func = 1 .*only sigmoid"):
        gguf_loader.read_gguf(path)


def test_glm_mtp_layers_read(built, tmp_path):
    """GLM-4.5's converter writes its MTP layers as the last blocks (nextn_predict_layers of them):
    the decoder is the blocks before; an MTP block's tensors load into `model.mtp` as from the HF
    folder (its nextn.* own tensors; the copies of the embedding and the head are not read)."""
    root, _ = built("glm4_moe")
    path = tmp_path / "mtp.gguf"
    rng = np.random.default_rng(0)
    own = {
        "eh_proj.weight": rng.standard_normal((64, 128)).astype(np.float32),  # [D, 2D] as HF's
        "enorm.weight": rng.standard_normal(64).astype(np.float32),
        "hnorm.weight": rng.standard_normal(64).astype(np.float32),
        "shared_head_norm.weight": rng.standard_normal(64).astype(np.float32),
        "embed_tokens.weight": np.zeros((256, 64), np.float32),
        "shared_head_head.weight": np.zeros((256, 64), np.float32),
    }

    def edit(tensors):  # the MTP block: a copy of the decoder's last (MoE) layer
        for name in [name for name in tensors if name.startswith("blk.2.")]:
            tensors[name.replace("blk.2.", "blk.3.")] = tensors[name]
        tensors |= {f"blk.3.nextn.{name}": value for name, value in own.items()}

    write_gguf(path, root / "hf", CASES["glm4_moe"], edit=edit)
    model = specjax.load(path, cache_dir=tmp_path / "cache")
    assert (model.config.num_layers, model.config.num_mtp_layers, len(model.mtp)) == (3, 1, 1)
    layer = model.mtp[0]
    np.testing.assert_array_equal(np.asarray(layer.eh_proj), own["eh_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(layer.head_norm), own["shared_head_norm.weight"])
    block, last = flatten(layer.block), flatten(model.params.layers[2])
    assert block.keys() == last.keys()
    for leaf, value in block.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(last[leaf]), err_msg=leaf)
