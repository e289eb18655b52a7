"""EAGLE-3 heads against the speculators package's own torch definition (the format vLLM reads):
random weights saved by speculators are read by specjax, and the draft logits of a prefill block
and of several chained draft steps must equal the reference's; a head written by specjax reads
back exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.models import init_cache
from specjax.models.eagle3 import eagle3_features, eagle3_logits, fuse_features
from specjax.models.head_formats import read_eagle3, write_speculators_eagle3

TOL = 1e-4
D, V, W, T = 64, 256, 100, 12


def speculators_head(folder, layer_type="llama", seed=0, **options):
    """A random speculators Eagle3DraftModel saved to `folder`; returns the torch model."""
    import transformers
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer_class = transformers.Qwen3Config if layer_type == "qwen3" else transformers.LlamaConfig
    layer = layer_class(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
    )
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=W,
        eagle_aux_hidden_state_layer_ids=[1, 3, 5],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
        **options,
    )
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else noise / np.sqrt(param.shape[-1]))
        vocab = np.sort(np.random.default_rng(seed).permutation(V)[:W])
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.from_numpy(vocab)] = True
        model.load_vocab_mappings(t2d, torch.from_numpy(vocab) - torch.arange(W))
    model.save_pretrained(folder)
    return model


def reference_logits(model, embed, aux, tokens, steps: int):
    """The reference's draft logits: a block of T pairs (fc(aux_t), x_{t+1}) at positions 1..T,
    then `steps` chained steps from the last, each feeding the layer's own output and its greedy
    token (mapped through d2t) through the layer's cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    n = tokens.shape[1]
    embeds = torch.nn.functional.embedding(tokens, embed)
    if model.input_norm is not None:  # as Eagle3DraftModel.forward does before fc
        aux = model.input_norm(aux)
    if model.fc_norm is not None:
        aux = torch.cat(
            [norm(c) for norm, c in zip(model.fc_norm, aux.chunk(len(model.fc_norm), -1), strict=True)], -1
        )
    hidden = torch.cat([embeds, model.fc(aux)], dim=-1)
    positions = torch.arange(1, n + 1)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = model.layers[0](
        hidden,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        position_embeddings=model.rotary_emb(hidden, positions),
    )
    normed = model.config.norm_output

    def read(out):  # (logits, the feature fed back)
        return (
            (model.lm_head(model.norm(out))[0], model.norm(out))
            if normed
            else (model.lm_head(model.norm(out))[0], out)
        )

    first, out = read(out)
    logits = [first]
    feature, position = out[:, -1:], n
    for _ in range(steps):
        token = (logits[-1][-1].argmax() + model.d2t[logits[-1][-1].argmax()])[None, None]
        position += 1
        hidden = torch.cat([torch.nn.functional.embedding(token, embed), feature], dim=-1)
        ids = torch.tensor([[position]])
        out = model.layers[0](
            hidden,
            attention_mask=torch.zeros(1, 1, 1, position),
            position_ids=ids,
            past_key_values=cache,
            position_embeddings=model.rotary_emb(hidden, ids),
        )
        step_logits, feature = read(out)
        logits.append(step_logits)
    return [x.detach().numpy() for x in logits]


def our_logits(head, embed, aux, tokens, steps: int):
    c, p = head.config, head.params
    cache = init_cache(c.layer_config, 1, 64)
    positions = jnp.arange(1, T + 1)[None]
    features = fuse_features(p, c, jnp.asarray(aux))
    out, cache = eagle3_features(
        p, c, embed, features, jnp.asarray(tokens), positions, cache, empty_cache=True
    )
    cache = cache.advance(jnp.asarray([T], jnp.int32))
    logits = [np.asarray(eagle3_logits(p, c, out))[0]]
    feature, position = out[:, -1:], T
    for _ in range(steps):
        token = head.vocab[int(np.argmax(logits[-1][-1]))]
        position += 1
        out, cache = eagle3_features(
            p, c, embed, feature, jnp.asarray([[token]]), jnp.asarray([[position]]), cache
        )
        cache = cache.advance(jnp.asarray([1], jnp.int32))
        logits.append(np.asarray(eagle3_logits(p, c, out))[0])
        feature = out
    return logits


@pytest.mark.parametrize(
    "layer_type, options",
    [
        ("llama", {}),
        ("qwen3", {}),
        ("llama", {"norm_before_residual": True, "fc_norm": True}),
        ("qwen3", {"norm_before_fc": True, "norm_output": True}),
    ],
    ids=["llama", "qwen3", "norm-before-residual+fc-norm", "norm-before-fc+norm-output"],
)
def test_draft_logits_equal_speculators(tmp_path, layer_type, options):
    model = speculators_head(tmp_path, layer_type, **options)
    head = read_eagle3(tmp_path)
    assert head.config.aux_layer_ids == (1, 3, 5) and head.config.qk_norm == (layer_type == "qwen3")
    rng = np.random.default_rng(1)
    embed = rng.standard_normal((V, D)).astype(np.float32)
    aux = rng.standard_normal((1, T, 3 * D)).astype(np.float32)
    tokens = rng.integers(0, V, (1, T))
    with torch.no_grad():
        want = reference_logits(
            model, torch.from_numpy(embed), torch.from_numpy(aux), torch.from_numpy(tokens), 3
        )
    got = our_logits(head, jnp.asarray(embed), aux, tokens, 3)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        error = np.abs(a - b).max() / np.abs(b).max()
        assert error < TOL, (step, error)


def test_speculators_round_trip_is_exact(tmp_path):
    speculators_head(tmp_path / "theirs", "qwen3", norm_output=True)
    head = read_eagle3(tmp_path / "theirs")
    write_speculators_eagle3(tmp_path / "ours", head)
    again = read_eagle3(tmp_path / "ours")
    assert again.config == head.config
    np.testing.assert_array_equal(again.vocab, head.vocab)
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(head.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and speculators reads what specjax wrote (its config, every weight), drafting as specjax does
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "ours")
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = Eagle3DraftModel(config).float().eval()
    missing, unexpected = theirs.load_state_dict(
        load_file(tmp_path / "ours" / "model.safetensors"), strict=False
    )
    assert unexpected == [] and set(missing) == {
        "embed_tokens.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
    rng = np.random.default_rng(2)
    embed = rng.standard_normal((V, D)).astype(np.float32)
    aux = rng.standard_normal((1, T, 3 * D)).astype(np.float32)
    tokens = rng.integers(0, V, (1, T))
    with torch.no_grad():
        want = reference_logits(
            theirs, torch.from_numpy(embed), torch.from_numpy(aux), torch.from_numpy(tokens), 2
        )
    got = our_logits(head, jnp.asarray(embed), aux, tokens, 2)
    for a, b in zip(got, want, strict=True):
        assert np.abs(a - b).max() / np.abs(b).max() < TOL
