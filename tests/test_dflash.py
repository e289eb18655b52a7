"""DFlash heads against the speculators package's torch definition: random weights saved by
speculators are read by specjax, and a block's draft logits (the context's keys and values
injected from the target's features, the block non-causal) equal the reference's, for several
anchors; a head written by specjax reads back exactly and speculators reads it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.models import init_cache
from specjax.models.dflash import dflash_block, dflash_context, dflash_logits
from specjax.models.head_formats import read_dflash, write_speculators_dflash

TOL = 1e-4
D, V, BLOCK, T = 64, 256, 4, 20


def speculators_dflash(folder, draft_vocab=V, seed=0):
    import transformers
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = transformers.Qwen3Config(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
    )
    layer._attn_implementation = "eager"
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab,
        block_size=BLOCK,
        aux_hidden_state_layer_ids=[1, 3],
        mask_token_id=V - 1,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    model = DFlashDraftModel(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else noise / np.sqrt(param.shape[-1]))
        if draft_vocab != V:
            vocab = np.sort(np.random.default_rng(seed).permutation(V)[:draft_vocab])
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[torch.from_numpy(vocab)] = True
            model.load_vocab_mappings(t2d, torch.from_numpy(vocab) - torch.arange(draft_vocab))
    model.save_pretrained(folder)
    return model


def reference_block_logits(model, embed, head_matrix, aux, tokens, anchor):
    """The reference's logits for the block anchored at `anchor`: the context is positions
    0..anchor-1, the block [x_anchor, mask x (BLOCK-1)] at positions anchor.. ."""
    context = model.hidden_norm(model.fc(aux[:, :anchor]))
    block_ids = torch.full((1, BLOCK), model.config.mask_token_id)
    block_ids[0, 0] = tokens[0, anchor]
    block = torch.nn.functional.embedding(block_ids, embed)
    positions = torch.arange(anchor + BLOCK)[None]
    embeddings = model.rotary_emb(block, positions)
    mask = torch.zeros(1, 1, BLOCK, anchor + BLOCK)  # every context slot and the whole block
    for layer in model.layers:
        block = layer(
            hidden_states=block, target_hidden=context, attention_mask=mask, position_embeddings=embeddings
        )
    hidden = model.norm(block)
    logits = model.lm_head(hidden) if model.use_draft_vocab else hidden @ head_matrix
    return logits[0].detach().numpy()


def our_block_logits(head, embed, head_matrix, aux, tokens, anchor):
    from specjax.models.params import LlamaParams

    c, p = head.config, head.params
    cache = init_cache(c.layer_config, 1, 64)
    cache = dflash_context(p, c, jnp.asarray(aux[:, :anchor]), jnp.arange(anchor)[None], cache)
    cache = cache.advance(jnp.asarray([anchor], jnp.int32))
    block = np.full((1, BLOCK), c.mask_token_id, np.int32)
    block[0, 0] = tokens[0, anchor]
    out = dflash_block(p, c, embed, jnp.asarray(block), anchor + jnp.arange(BLOCK)[None], cache)
    target = LlamaParams(embed=embed, layers=(), final_norm=None, lm_head=jnp.asarray(head_matrix))
    return np.asarray(dflash_logits(p, c, target, out))[0]


@pytest.mark.parametrize("draft_vocab", [V, 100], ids=["target-head", "draft-vocab"])
def test_block_logits_equal_speculators(tmp_path, draft_vocab):
    model = speculators_dflash(tmp_path, draft_vocab)
    head = read_dflash(tmp_path)
    assert head.config.aux_layer_ids == (1, 3) and head.config.block_size == BLOCK
    rng = np.random.default_rng(1)
    embed = rng.standard_normal((V, D)).astype(np.float32)
    head_matrix = (rng.standard_normal((D, V)) / np.sqrt(D)).astype(np.float32)  # the target's head
    aux = rng.standard_normal((1, T, 2 * D)).astype(np.float32)
    tokens = rng.integers(0, V, (1, T))
    for anchor in (1, 7, T - 1):
        with torch.no_grad():
            want = reference_block_logits(
                model,
                torch.from_numpy(embed),
                torch.from_numpy(head_matrix),
                torch.from_numpy(aux),
                tokens,
                anchor,
            )
        got = our_block_logits(head, jnp.asarray(embed), head_matrix, aux, tokens, anchor)
        assert np.abs(got - want).max() / np.abs(want).max() < TOL, anchor


def test_speculators_round_trip_is_exact(tmp_path):
    speculators_dflash(tmp_path / "theirs", draft_vocab=100)
    head = read_dflash(tmp_path / "theirs")
    write_speculators_dflash(tmp_path / "ours", head)
    again = read_dflash(tmp_path / "ours")
    assert again.config == head.config
    np.testing.assert_array_equal(again.vocab, head.vocab)
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(head.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    from safetensors.torch import load_file
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(tmp_path / "ours")
    theirs = DFlashDraftModel(config)
    missing, unexpected = theirs.load_state_dict(
        load_file(tmp_path / "ours" / "model.safetensors"), strict=False
    )
    assert unexpected == [] and set(missing) == {
        "embed_tokens.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
