"""Checkpoint loading against transformers: tiny random models saved to disk, loaded back by
`specjax.models.load`, must give the torch model's logits (prefill and cached decode)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import gguf
import numpy as np
import pytest
import torch
import transformers
from logit_check import compare_with_torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from specjax.models import load, loading
from specjax.models.checkpoint import flatten
from specjax.models.gguf_loader import unpermute_rotary_rows
from specjax.models.params import layer_from_checkpoint, layer_to_checkpoint

TOL = 1e-4  # relative float32 logit error (max abs diff / max abs logit)


def tiny_config(kind: str, vocab_size: int = 96):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if kind == "llama-untied-llama3-rope":
        rope = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=rope)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    raise ValueError(kind)


def tiny_model(config, seed: int = 0):
    """A random causal LM with weights scaled so that every weight (and a wrong layout) shows in
    the logits: unit-variance activations, peaky attention, norms and biases away from 1 and 0."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            elif "embed" in name or "lm_head" in name:
                param.copy_(noise)
            else:  # [out, in]
                param.copy_(2.0 * noise / math.sqrt(param.shape[1]))
    return model


def random_rows(vocab_size: int, seed: int = 0, lengths=(7, 12, 3), steps: int = 5):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab_size, n).tolist() for n in lengths]
    continuations = [rng.integers(3, vocab_size, steps).tolist() for _ in lengths]
    return prompts, continuations


@pytest.mark.parametrize("kind", ["llama", "llama-untied-llama3-rope", "qwen2"])
def test_hf_folder_matches_torch(tmp_path, kind):
    config = tiny_config(kind)
    torch_model = tiny_model(config)
    torch_model.save_pretrained(tmp_path)
    model = load(tmp_path)

    assert model.tokenizer is None  # the folder has no tokenizer files
    assert model.config.num_layers == 2 and model.config.num_kv_heads == 2
    assert model.config.tie_word_embeddings == config.tie_word_embeddings
    assert model.config.qkv_bias == (kind == "qwen2")
    assert (model.params.lm_head is None) == config.tie_word_embeddings
    assert (model.config.rope_scaling is not None) == ("rope" in kind)
    error = compare_with_torch(model, torch_model, *random_rows(config.vocab_size))
    assert error < TOL


def test_sharded_hf_folder(tmp_path):
    config = tiny_config("llama-untied-llama3-rope")
    torch_model = tiny_model(config, seed=1)
    torch_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    error = compare_with_torch(load(tmp_path), torch_model, *random_rows(config.vocab_size, seed=1))
    assert error < TOL


def test_qkv_fuses_kv_head_by_kv_head(tmp_path):
    """The params' qkv holds each kv head's query heads, key and value side by side; the
    checkpoint layout (q, k, v apart) converts to it and back exactly."""
    torch_model = tiny_model(tiny_config("qwen2"))  # 4 query / 2 kv heads of dim 8, with biases
    torch_model.save_pretrained(tmp_path)
    model = load(tmp_path)
    E, G = model.config.head_dim, model.config.num_heads // model.config.num_kv_heads
    attention = torch_model.model.layers[1].self_attn
    for name, qkv in (("weight", model.params.layers[1].qkv.T), ("bias", model.params.layers[1].qkv_bias)):
        q, k, v = (getattr(getattr(attention, f"{x}_proj"), name).detach().numpy() for x in "qkv")
        qkv = np.asarray(qkv)  # rows are output features
        for j in range(model.config.num_kv_heads):
            group = qkv[j * (G + 2) * E : (j + 1) * (G + 2) * E]
            np.testing.assert_array_equal(group[: G * E], q[j * G * E : (j + 1) * G * E])
            np.testing.assert_array_equal(group[G * E : (G + 1) * E], k[j * E : (j + 1) * E])
            np.testing.assert_array_equal(group[(G + 1) * E :], v[j * E : (j + 1) * E])
    layer = model.params.layers[1]
    fields = layer_to_checkpoint(layer, model.config)
    assert set(fields) == {
        "attn_norm",
        "q",
        "k",
        "v",
        "o",
        "mlp_norm",
        "gate",
        "up",
        "down",
        "q_bias",
        "k_bias",
        "v_bias",
    }
    np.testing.assert_array_equal(fields["k"], attention.k_proj.weight.detach().numpy().T)
    back = layer_from_checkpoint({name: np.asarray(x) for name, x in fields.items()}, model.config)
    for got, want in zip(flatten(back).values(), flatten(layer).values(), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))


# ---------------------------------------------------------------------------------------------
# Tokenizers


def tiny_byte_level_tokenizer() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, llama.cpp token types) of a small byte-level BPE with 3 control tokens."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "o r", "Ġ w", "Ġw or", "l d", "Ġwor ld"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + alphabet + merged
    return tokens, merges, [3] * len(specials) + [1] * (len(tokens) - len(specials))


CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)
TEXTS = [
    "the world and the other world",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "numbers 12345 and 3.14159; unicode: héllo wörld 日本語 🙂",
    "def f(x):\n    return x**2  # code\n",
]


def tiny_tokenizer_folder(tmp_path):
    """Save a PreTrainedTokenizerFast of the tiny vocabulary, as an HF folder would hold it."""
    tokens, merges, types = tiny_byte_level_tokenizer()
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=[t for t, k in zip(tokens, types, strict=True) if k == 3],
    )
    tokenizer.save_pretrained(tmp_path)
    return tokenizer


def test_hf_folder_tokenizer(tmp_path):
    config = tiny_config("llama", vocab_size=len(tiny_byte_level_tokenizer()[0]))
    tiny_model(config).save_pretrained(tmp_path)
    reference = tiny_tokenizer_folder(tmp_path)
    tokenizer = load(tmp_path).tokenizer
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.encode("<|im_start|>x") == [1, tokenizer.convert_tokens_to_ids("x")]
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == reference.apply_chat_template(
        chat, add_generation_prompt=True
    )


# ---------------------------------------------------------------------------------------------
# GGUF files written here, as llama.cpp's converter would write them


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's reorder of q/k rows: per head, rows (i, i + E/2) become neighbours."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(path, torch_model, *, arch="llama", quantize_embed=False, tokenizer=None, add_bos=False):
    """Write a torch Llama as a GGUF. With quantize_embed, the embedding is stored as Q8_0 and the
    torch model's embedding is replaced by its dequantized value, so the two stay comparable."""
    c = torch_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if tokenizer is not None:
        tokens, merges, types = tokenizer
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(add_bos)
        writer.add_chat_template(CHAT_TEMPLATE)

    state = {name: value.numpy() for name, value in torch_model.state_dict().items()}
    embed = state["model.embed_tokens.weight"]
    if quantize_embed:
        packed = gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor("token_embd.weight", packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        dequantized = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)
        assert 0 < np.abs(dequantized - embed).max() < 0.1
        with torch.no_grad():
            torch_model.model.embed_tokens.weight.copy_(torch.from_numpy(dequantized))
    else:
        writer.add_tensor("token_embd.weight", embed)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not c.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf, ours in names.items():
            writer.add_tensor(f"blk.{i}.{ours}.weight", state[prefix + hf + ".weight"])
        q = llama_cpp_permute(state[prefix + "self_attn.q_proj.weight"], c.num_attention_heads)
        k = llama_cpp_permute(state[prefix + "self_attn.k_proj.weight"], c.num_key_value_heads)
        writer.add_tensor(f"blk.{i}.attn_q.weight", q)
        writer.add_tensor(f"blk.{i}.attn_k.weight", k)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unpermute_inverts_llama_cpp_permute():
    weight = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)  # 6 heads of dim 8, 3 inputs
    permuted = llama_cpp_permute(weight, 6)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, 6), weight)
    # Head 0's rows after the permute: 0, 4, 1, 5, 2, 6, 3, 7 (halves interleaved).
    np.testing.assert_array_equal(permuted[:8, 0] // 3, [0, 4, 1, 5, 2, 6, 3, 7])


@pytest.mark.parametrize("kind", ["llama", "llama-untied-llama3-rope"])
def test_gguf_matches_torch_and_transformers(tmp_path, kind):
    if "rope" in kind:  # GGUF has no llama3 rope metadata (it stores factors); test untied only
        config = tiny_config("llama")
        config.tie_word_embeddings = False
    else:
        config = tiny_config(kind)
    torch_model = tiny_model(config, seed=2)
    write_gguf(tmp_path / "tiny.gguf", torch_model, quantize_embed=True)
    rows = random_rows(config.vocab_size, seed=2)

    model = load(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    assert model.name == "tiny" and model.tokenizer is None
    assert model.config.tie_word_embeddings == config.tie_word_embeddings
    assert compare_with_torch(model, torch_model, *rows) < TOL
    # transformers' own GGUF reader undoes the permutation independently of ours.
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    )
    assert compare_with_torch(model, reference.eval(), *rows) < TOL

    # The second load comes from the cache, with the same values.
    assert len(list((tmp_path / "cache").iterdir())) == 1
    again = load(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    assert again.config == model.config
    for name, value in flatten(model.params).items():
        np.testing.assert_array_equal(
            np.asarray(flatten(again.params)[name]), np.asarray(value), err_msg=name
        )


@pytest.mark.parametrize("add_bos", [False, True])
def test_gguf_tokenizer_matches_transformers(tmp_path, add_bos):
    vocab = tiny_byte_level_tokenizer()
    torch_model = tiny_model(tiny_config("llama", vocab_size=len(vocab[0])))
    write_gguf(tmp_path / "tok.gguf", torch_model, tokenizer=vocab, add_bos=add_bos)
    ours = load(tmp_path / "tok.gguf", cache_dir=tmp_path / "cache").tokenizer
    cached = load(tmp_path / "tok.gguf", cache_dir=tmp_path / "cache").tokenizer
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    for text in TEXTS:
        expected = reference.encode(text)
        assert ours.encode(text) == expected, text
        assert cached.encode(text) == expected, text
        assert ours.decode(expected) == reference.decode(expected)
    assert ours.encode("x")[0] == (1 if add_bos else ours.convert_tokens_to_ids("x"))
    chat = [{"role": "user", "content": "the world"}]
    assert ours.apply_chat_template(chat, tokenize=False) == reference.apply_chat_template(
        chat, tokenize=False
    )
    assert ours.eos_token == "<|im_end|>" and ours.bos_token == "<|im_start|>"


def test_gguf_unsupported_tokenizer_is_an_error_unless_one_is_given(tmp_path):
    torch_model = tiny_model(tiny_config("llama"))
    path = tmp_path / "bert.gguf"
    write_gguf(path, torch_model)
    # Rewrite with a WordPiece tokenizer declared, which specjax does not rebuild.
    writer_path = tmp_path / "bert2.gguf"
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(writer_path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("llama.") and len(field.types) == 1:
            writer.add_key_value(field.name, field.contents(), field.types[0])
    writer.add_tokenizer_model("bert")
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model 'bert'\) is not supported"):
        load(writer_path, cache_dir=tmp_path / "cache")
    given = tiny_tokenizer_folder(tmp_path / "tok")
    model = load(writer_path, cache_dir=tmp_path / "cache", tokenizer=given)
    assert model.tokenizer is given
    assert compare_with_torch(model, torch_model, *random_rows(96)) < TOL


def test_library_does_not_import_torch(tmp_path):
    vocab = tiny_byte_level_tokenizer()
    config = tiny_config("llama", vocab_size=len(vocab[0]))
    torch_model = tiny_model(config)
    write_gguf(tmp_path / "tiny.gguf", torch_model, tokenizer=vocab)
    torch_model.save_pretrained(tmp_path / "hf")
    tiny_tokenizer_folder(tmp_path / "hf")
    script = (
        "import sys\n"
        "from specjax.models import load\n"
        f"a = load({str(tmp_path / 'tiny.gguf')!r}, cache_dir={str(tmp_path / 'cache')!r})\n"
        f"b = load({str(tmp_path / 'hf')!r})\n"
        "assert a.tokenizer is not None and b.tokenizer is not None\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


# ---------------------------------------------------------------------------------------------
# Errors at the door


def test_unknown_name():
    with pytest.raises(ValueError, match=r"source 'no-such-model'.*smollm2-135m"):
        load("no-such-model")


def test_missing_path(tmp_path):
    with pytest.raises(ValueError, match="source .*missing.gguf.*smollm2-135m"):
        load(tmp_path / "missing.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load(tmp_path / "weights.bin")


@pytest.mark.parametrize("dtype", ["float64", "int8", "nonsense"])
def test_bad_dtype(dtype):
    with pytest.raises(
        ValueError, match=f"load: dtype '{dtype}' is not supported; supported: float32, bfloat16, float16"
    ):
        load("smollm2-135m", dtype=dtype)


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load(tmp_path)


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load(tmp_path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    tiny_model(tiny_config("llama")).save_pretrained(tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    hf_config["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    name = r"model.layers.0.mlp.gate_proj.weight \(layers.0.gate\)"
    with pytest.raises(ValueError, match=name + r": got \(64, 128\), expected \(64, 100\)"):
        load(tmp_path)


def test_gguf_unsupported_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'.*supported: llama"):
        load(tmp_path / "g.gguf", cache_dir=tmp_path / "cache")


def test_builtin_package_missing(monkeypatch):
    fake = loading.BuiltinModel(
        package="specjax_no_such_package", filename="x.gguf", install="pip install nope"
    )
    monkeypatch.setitem(loading.BUILTIN_MODELS, "fake-model", fake)
    with pytest.raises(ValueError, match="pip install nope"):
        load("fake-model")


def test_damaged_cache_is_rebuilt(tmp_path):
    torch_model = tiny_model(tiny_config("llama"))
    write_gguf(tmp_path / "tiny.gguf", torch_model)
    load(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    (folder,) = (tmp_path / "cache").iterdir()
    (folder / "params.safetensors").write_bytes(b"garbage")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    assert any("damaged" in str(w.message) for w in caught)
    assert compare_with_torch(model, torch_model, *random_rows(96)) < TOL
    assert (folder / "params.safetensors").stat().st_size > 1000  # rewritten
