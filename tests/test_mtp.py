"""specjax.MTP: the target's own MTP layers, read from a checkpoint as released, against
transformers' MtpModel on the same weights, and lossless in the loop with acceptance in a band."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from drafters import check_acceptance, layered_target
from families import hf_config, peaky_random_weights, prompts
from safetensors.numpy import load_file, save_file
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

import specjax
from specjax.models import Model
from specjax.models.cache import init_cache
from specjax.models.llama import forward_hidden, lm_head
from specjax.models.mtp import MTPLayerParams, mtp_features, mtp_layer_config


def _mtp_checkpoint(family: str, folder, num_mtp: int, seed: int = 0):
    """A tiny random `family` model saved with `num_mtp` MTP layers under their released names
    (model.layers.{L + j}.{enorm, hnorm, eh_proj, <block>, shared_head.norm}), and transformers'
    main model and MtpModel on the same weights. transformers' MtpModel.from_pretrained reads only
    the released models' layer numbers (model.layers.61 for DeepSeek-V3), so the MtpModel is built
    from the main model and given the weights by hand: its blocks are the extra layers of a model
    L + num_mtp deep, which save_pretrained writes in the checkpoint's layout."""
    config = hf_config(family)
    L = config.num_hidden_layers
    config.num_hidden_layers = L + num_mtp
    torch.manual_seed(seed)
    deep = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    peaky_random_weights(deep.float(), seed)
    deep.save_pretrained(folder)
    main_config = hf_config(family)
    main_config.num_mtp_layers = num_mtp
    main = transformers.AutoModelForCausalLM.from_config(main_config, attn_implementation="eager").float()
    main.load_state_dict(deep.state_dict(), strict=False)  # all but the deep model's last layers
    mtp = MtpModel(main, num_mtp).float()
    generator = torch.Generator().manual_seed(seed + 1)
    extra = {}
    with torch.no_grad():
        for j, layer in enumerate(mtp.layers):
            layer.mtp_block.load_state_dict(deep.model.layers[L + j].state_dict())
            for name in ("enorm", "hnorm", "post_norm"):
                weight = getattr(layer, name).weight
                weight.copy_(1.0 + 0.2 * torch.randn(weight.shape, generator=generator))
            weight = layer.eh_proj.weight
            weight.copy_(1.5 * torch.randn(weight.shape, generator=generator) / weight.shape[1] ** 0.5)
            released = {
                "enorm": "enorm",
                "hnorm": "hnorm",
                "eh_proj": "eh_proj",
                "post_norm": "shared_head.norm",
            }
            for ours, theirs in released.items():
                extra[f"model.layers.{L + j}.{theirs}.weight"] = getattr(layer, ours).weight.numpy().copy()
    tensors = load_file(folder / "model.safetensors")
    save_file(tensors | extra, folder / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((folder / "config.json").read_text())
    hf.update(num_hidden_layers=L, num_nextn_predict_layers=num_mtp)
    hf.pop("num_mtp_layers", None)
    (folder / "config.json").write_text(json.dumps(hf))
    return main.eval(), mtp.eval()


@pytest.mark.parametrize(
    "family, num_mtp",
    [("deepseek_v3", 2), pytest.param("glm4_moe", 1, marks=pytest.mark.slow)],
)
def test_draft_logits_match_transformers_mtp_model(tmp_path, family, num_mtp):
    """Each MTP layer's draft logits after a prompt equal transformers' MtpModel's within 1e-4:
    layer 0 fed the target's last hidden states and the next tokens, layer j > 0 the post-norm
    outputs of layer j - 1 and the tokens one further on, ending with the drafted ones."""
    main, mtp = _mtp_checkpoint(family, tmp_path, num_mtp)
    model = specjax.load(tmp_path)
    assert model.mtp is not None and len(model.mtp) == num_mtp
    prompt = prompts(lengths=(40,))[0]
    P = len(prompt)
    with torch.no_grad():
        out = main(torch.tensor([prompt]), output_hidden_states=True)
        first = int(out.logits[0, -1].argmax())
        ids = torch.tensor([prompt[1:] + [first]])
        positions = torch.arange(1, P + 1)[None]
        cache = MtpCache(config=main.config.get_mtp_config())
        drafted, want, _ = mtp(ids, out.hidden_states[-1], None, positions, cache)
    c = model.config
    tokens = jnp.asarray([prompt])
    cache = init_cache(c, 1, P + 8)
    hidden, _ = forward_hidden(model.params, c, tokens, jnp.arange(P)[None], cache, empty_cache=True)
    assert int(jnp.argmax(lm_head(model.params, hidden[:, -1], c))) == first
    layer_config = mtp_layer_config(c)
    next_tokens, feed = jnp.asarray([prompt[1:] + [first]]), hidden
    for j, layer in enumerate(model.mtp):  # layer j over positions j + 1 .. P + j
        g, _ = mtp_features(
            layer,
            layer_config,
            model.params.embed,
            feed,
            next_tokens,
            jnp.arange(j + 1, P + j + 1)[None],
            init_cache(layer_config, 1, P + 8),
            empty_cache=True,
        )
        logits = lm_head(model.params, g[:, -1], c)
        np.testing.assert_allclose(np.asarray(logits[0]), want[0, j].numpy(), atol=1e-4, rtol=1e-4)
        assert int(jnp.argmax(logits)) == int(drafted[0, j])
        next_tokens = jnp.concatenate([next_tokens[:, 1:], jnp.argmax(logits, -1)[:, None]], axis=1)
        feed = g


def _first_layer_mtp(target: Model, hidden_weight: float = 0.1) -> Model:
    """`target` with one MTP layer whose block is the target's first layer, fed the next token's
    embedding (through enorm, at the embeddings' mean scale) plus `hidden_weight` times the
    normed hidden state: it drafts about what SelfDraft(layers=1) drafts, so its drafts are
    accepted part of the time, and it reads both of its inputs."""
    embed = target.params.embed
    D = target.config.hidden_size
    scale = float(jnp.sqrt(jnp.mean(embed * embed)))
    layer = MTPLayerParams(
        enorm=jnp.full((D,), scale),
        hnorm=jnp.full((D,), scale),
        eh_proj=jnp.concatenate([jnp.eye(D), hidden_weight * jnp.eye(D)], axis=0),  # [2D, D]: (embed, hidden)
        block=target.params.layers[0],
        head_norm=target.params.final_norm,
    )
    return Model(target.config, target.params, name=f"{target.name}-mtp", mtp=(layer,))


@pytest.fixture(scope="module")
def with_mtp():
    return _first_layer_mtp(layered_target())


@pytest.mark.parametrize(
    "batch, proposer",
    [
        pytest.param(1, specjax.MTP(k=3), marks=pytest.mark.slow),
        (4, specjax.MTP(k=3)),
        pytest.param(4, specjax.MTP(tree=specjax.TokenTree.top_k((2, 2, 1))), marks=pytest.mark.slow),
        pytest.param(1, specjax.MTP(k=1), marks=pytest.mark.slow),
    ],
)
def test_mtp_greedy_equals_plain(with_mtp, batch, proposer):
    """Greedy drafting from the MTP layer emits plain decoding's tokens (batch 1, and 4 ragged
    rows), and its drafts are accepted part of the time."""
    rows = prompts(vocab_size=with_mtp.config.vocab_size, lengths=(23, 9, 17, 30)[:batch], seed=3)
    plain = specjax.generate(with_mtp, rows, max_new_tokens=24)
    spec = specjax.generate(with_mtp, rows, proposer=proposer, max_new_tokens=24)
    assert spec.tokens == plain.tokens
    check_acceptance(spec.metrics, 0.1, 0.9)


def test_mtp_errors_name_what_is_wrong(with_mtp):
    target = layered_target()
    with pytest.raises(ValueError, match="MTP: model 'layered-11-0.3' has no MTP layers: its 'llama' config"):
        specjax.generate(target, [[1, 2, 3]], proposer=specjax.MTP(k=2), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"MTP layers=\(1,\): model .* has 1 MTP layer"):
        specjax.generate(with_mtp, [[1, 2, 3]], proposer=specjax.MTP(layers=(1,)), max_new_tokens=2)
    with pytest.raises(ValueError, match="MTP layers must be None or a tuple"):
        specjax.MTP(layers="all")
    with pytest.raises(ValueError, match="MTP k must be an integer"):
        specjax.MTP(k=0)
