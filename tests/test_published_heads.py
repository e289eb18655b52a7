"""Heads in the layouts their authors released, read as they are (torch pickles read without
torch), against the authors' own model definitions from PyPI: EAGLE-1 (`eagle-llm`: fc over
[embedding, feature] with a bias, a decoder layer without an input norm), EAGLE-3's original
layout (`midlayer.*`, checked against speculators' definition with the same weights) and Medusa
(`medusa-llm`: residual blocks and an LM head per head). Then each drafts losslessly in the loop,
and `specjax.load_head` reads every format, refusing a target of another shape."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_eagle3 import our_logits, reference_logits, speculators_head
from tiny import tiny_model

import specjax
from specjax.models import init_cache
from specjax.models.eagle import eagle_features
from specjax.models.head_formats import (
    read_eagle1_release,
    read_eagle3,
    read_medusa_release,
)
from specjax.models.medusa import medusa_hidden, medusa_logits
from specjax.models.torch_checkpoint import load_torch_checkpoint
from specjax.speculate.tree import TokenTree

TOL = 1e-4
D, V, T = 64, 97, 10
TARGET = tiny_model(seed=11, hidden_size=D, vocab_size=V)  # 4 heads of 16, 2 kv heads, ffw 96


def peaky(module, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else noise / np.sqrt(param.shape[-1]))


def eagle1_release(folder, seed=0):
    """eagle-llm's own EAGLE-1 draft model, random, saved as its authors' releases are."""
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig

    config = EConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        pad_token_id=0,
    )
    config.rope_scaling = None  # eagle-llm predates transformers 5's rope dicts
    model = Model(config).eval()
    peaky(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    hf = config.to_dict()
    hf.update(model_type="llama", rope_scaling=None, rope_theta=10000.0)
    (folder / "config.json").write_text(json.dumps(hf))
    return model


def test_eagle1_release_equals_eagle_llm(tmp_path):
    model = eagle1_release(tmp_path)
    head = read_eagle1_release(tmp_path)
    assert not head.config.input_norm
    rng = np.random.default_rng(1)
    features = rng.standard_normal((1, T, D)).astype(np.float32)
    tokens = rng.integers(0, V, (1, T))
    embed = model.embed_tokens.weight.detach()
    with torch.no_grad():
        out, past = model(torch.from_numpy(features), torch.from_numpy(tokens), use_cache=True)
        step = model(out[:, -1:], torch.tensor([[5]]), past_key_values=past, use_cache=True)[0]
    want = [out[0].numpy(), step[0].numpy()]
    c, p = head.config, head.params
    cache = init_cache(c.layer_config, 1, 32)
    got, cache = eagle_features(
        p,
        c,
        jnp.asarray(embed.numpy()),
        jnp.asarray(features),
        jnp.asarray(tokens),
        jnp.arange(T)[None],
        cache,
        empty_cache=True,
    )
    cache = cache.advance(jnp.asarray([T]))
    step_got, _ = eagle_features(
        p, c, jnp.asarray(embed.numpy()), got[:, -1:], jnp.asarray([[5]]), jnp.asarray([[T]]), cache
    )
    for a, b in zip([np.asarray(got)[0], np.asarray(step_got)[0]], want, strict=True):
        assert np.abs(a - b).max() / np.abs(b).max() < TOL


def test_eagle3_release_layout_equals_speculators(tmp_path):
    """The same weights as speculators' model, written as EAGLE-3's authors released theirs:
    pytorch_model.bin with midlayer.*, d2t and t2d, and a Llama-like config.json."""
    model = speculators_head(tmp_path / "speculators")
    release = tmp_path / "release"
    release.mkdir()
    state = {
        k.replace("layers.0.", "midlayer."): v
        for k, v in model.state_dict().items()
        if not k.startswith(("verifier_", "embed_tokens"))
    }
    torch.save(state, release / "pytorch_model.bin")
    layer = model.config.transformer_layer_config.to_dict()
    layer.update(
        draft_vocab_size=model.config.draft_vocab_size,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
    )
    (release / "config.json").write_text(json.dumps(layer))
    head = read_eagle3(release)
    assert head.meta["format"] == "eagle3-release"
    rng = np.random.default_rng(1)
    embed = rng.standard_normal((256, 64)).astype(np.float32)
    aux = rng.standard_normal((1, 12, 192)).astype(np.float32)
    tokens = rng.integers(0, 256, (1, 12))
    with torch.no_grad():
        want = reference_logits(
            model, torch.from_numpy(embed), torch.from_numpy(aux), torch.from_numpy(tokens), 2
        )
    for a, b in zip(our_logits(head, jnp.asarray(embed), aux, tokens, 2), want, strict=True):
        assert np.abs(a - b).max() / np.abs(b).max() < TOL


def medusa_release(folder, num_heads=3, num_layers=2, seed=0):
    """medusa-llm's own heads (ResBlocks, then an LM head each), saved as its releases are."""
    from medusa.model.medusa_model import ResBlock

    heads = torch.nn.ModuleList(
        [
            torch.nn.Sequential(*[ResBlock(D) for _ in range(num_layers)], torch.nn.Linear(D, V, bias=False))
            for _ in range(num_heads)
        ]
    )
    peaky(heads, seed)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(heads.state_dict(), folder / "medusa_lm_head.pt")
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": "x"}
    (folder / "config.json").write_text(json.dumps(config))
    return heads


@pytest.mark.parametrize("num_layers", [1, 2])
def test_medusa_release_equals_medusa_llm(tmp_path, num_layers):
    heads = medusa_release(tmp_path, num_layers=num_layers)
    head = read_medusa_release(tmp_path)
    hidden = np.random.default_rng(2).standard_normal((5, D)).astype(np.float32)
    with torch.no_grad():
        want = np.stack([h(torch.from_numpy(hidden)).numpy() for h in heads], axis=1)  # [5, M, V]
    got = np.asarray(medusa_logits(head.params, medusa_hidden(head.params, jnp.asarray(hidden))))
    assert np.abs(got - want).max() / np.abs(want).max() < TOL


def test_torch_checkpoints_are_read_without_running_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("this must not run",))

    torch.save({"x": Payload()}, tmp_path / "evil.bin")
    with pytest.raises(Exception, match="refusing to load"):
        load_torch_checkpoint(tmp_path / "evil.bin")
    values = {"a": torch.randn(3, 4), "b": torch.randn(4, 3).t(), "c": torch.randn(5, dtype=torch.bfloat16)}
    torch.save(values, tmp_path / "ok.bin")
    got = load_torch_checkpoint(tmp_path / "ok.bin")
    for name, value in values.items():
        np.testing.assert_array_equal(got[name].astype(np.float32), value.float().numpy())


@pytest.fixture(scope="module")
def plain_greedy():
    return specjax.generate(TARGET, [[5, 6, 7, 8, 5, 6], [3, 9, 4]], max_new_tokens=20).tokens


def test_published_heads_draft_losslessly(tmp_path, plain_greedy):
    prompts = [[5, 6, 7, 8, 5, 6], [3, 9, 4]]
    eagle1_release(tmp_path / "eagle1")
    medusa_release(tmp_path / "medusa", num_layers=2)
    eagle = specjax.load_head(tmp_path / "eagle1", TARGET)
    medusa = specjax.load_head(tmp_path / "medusa", TARGET)
    for proposer in (
        specjax.Eagle(eagle, k=3),
        specjax.Eagle(eagle, tree=TokenTree.top_k((2, 2))),
        specjax.Medusa(medusa),
        specjax.Medusa(medusa, tree=TokenTree.top_k((2, 2))),
    ):
        assert specjax.generate(TARGET, prompts, proposer=proposer, max_new_tokens=20).tokens == plain_greedy


def test_load_head_refuses_another_target(tmp_path):
    eagle1_release(tmp_path / "eagle1")
    medusa_release(tmp_path / "medusa")
    other = tiny_model(seed=1, hidden_size=32, vocab_size=V)
    with pytest.raises(ValueError, match="EAGLE head has hidden size 64"):
        specjax.load_head(tmp_path / "eagle1", other)
    with pytest.raises(ValueError, match="Medusa head is for hidden size 64"):
        specjax.load_head(tmp_path / "medusa", other)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a head specjax reads"):
        specjax.load_head(tmp_path / "empty")
