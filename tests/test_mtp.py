"""specjax.MTP: the target's own MTP layers, read from a checkpoint as released, against
transformers' MtpModel on the same weights, and lossless in the loop with acceptance in a band."""

import functools
import json

import by_hand
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from drafters import check_acceptance, check_part_acceptance, first_layer_mtp, layered_target
from families import hf_config, peaky_random_weights, prompts
from safetensors.numpy import load_file, save_file
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

import specjax
from specjax.models.cache import init_cache
from specjax.models.llama import forward_hidden, lm_head
from specjax.models.mtp import mtp_features, mtp_layer_config
from specjax.speculate.proposers.mtp import MTPSpec
from specjax.speculate.sampling import SamplingParams


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


def _hf_draft_logits(main, mtp, sequence) -> np.ndarray:
    """transformers' MtpModel's draft logits [n, V] after `sequence` (its last token not yet seen by
    the target), from scratch: layer 0 fed the target's last hidden states and the next tokens,
    layer j > 0 the post-norm outputs of layer j - 1 and the tokens one further on, ending with the
    drafted ones."""
    with torch.no_grad():
        out = main(torch.tensor([sequence[:-1]]), output_hidden_states=True)
        positions = torch.arange(1, len(sequence))[None]
        cache = MtpCache(config=main.config.get_mtp_config())
        _, logits, _ = mtp(torch.tensor([sequence[1:]]), out.hidden_states[-1], None, positions, cache)
    return logits[0].numpy()


def _hidden(model, sequence, width: int = 64):
    """The target's final-normed hidden states [1, T, D] over `sequence` (T tokens), in a program
    for `width` tokens (padding after them changes nothing before it), compiled once."""
    tokens = jnp.zeros((1, width), jnp.int32).at[0, : len(sequence)].set(jnp.asarray(sequence))
    return _forward_hidden(model.params, model.config, tokens)[:, : len(sequence)]


@functools.partial(jax.jit, static_argnums=1)
def _forward_hidden(params, config, tokens):
    positions, cache = jnp.arange(tokens.shape[1])[None], init_cache(config, 1, tokens.shape[1])
    return forward_hidden(params, config, tokens, positions, cache, empty_cache=True)[0]


@pytest.mark.parametrize(
    "family, num_mtp",
    [("deepseek_v3", 2), pytest.param("glm4_moe", 1, marks=pytest.mark.slow)],
)
def test_draft_logits_match_transformers_mtp_model(tmp_path, monkeypatch, family, num_mtp):
    """Each MTP layer's draft logits equal transformers' MtpModel's within 1e-4: mtp_features
    chained by hand after a prompt, and specjax.MTP(k=n) step by step (its own caches caught up
    on 1, 0 and 2 accepted drafts in turn) against MtpModel from scratch on the same sequence."""
    main, mtp = _mtp_checkpoint(family, tmp_path, num_mtp)
    model = specjax.load(tmp_path)
    assert model.mtp is not None and len(model.mtp) == num_mtp
    prompt = prompts(lengths=(40,))[0]
    P = len(prompt)
    c = model.config
    hidden = _hidden(model, prompt)
    first = int(jnp.argmax(lm_head(model.params, hidden[:, -1], c)))
    want = _hf_draft_logits(main, mtp, prompt + [first])
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
        np.testing.assert_allclose(np.asarray(logits[0]), want[j], atol=1e-4, rtol=1e-4)
        next_tokens = jnp.concatenate([next_tokens[:, 1:], jnp.argmax(logits, -1)[:, None]], axis=1)
        feed = g

    proposer = specjax.MTP(k=num_mtp)
    spec, params = proposer.spec(model), proposer.params(model)
    seen = []
    logits_of = MTPSpec._logits
    monkeypatch.setattr(MTPSpec, "_logits", lambda self, p, x: seen.append(logits_of(self, p, x)) or seen[-1])
    greedy = SamplingParams.of(specjax.Sampling(), 1)

    @jax.jit
    def propose(state, tokens, lengths):  # and each draft's logits [1, n, V]
        seen.clear()
        proposal, state = by_hand.propose(
            spec, model.params, params, state, tokens, lengths, None, greedy, None
        )
        return proposal, state, jnp.stack(seen, axis=1)

    capacity = P + 16
    state = by_hand.init(
        spec, model.params, params, jnp.asarray([prompt]), jnp.asarray([P]), capacity, hidden
    )
    sequence = prompt + [first]
    for accepted in (min(a, num_mtp) for a in (1, 0, 2)):
        L = len(sequence)
        tokens = jnp.zeros((1, capacity), jnp.int32).at[0, :L].set(jnp.asarray(sequence))
        proposal, state, logits = propose(state, tokens, jnp.asarray([L]))
        want = _hf_draft_logits(main, mtp, sequence)
        np.testing.assert_allclose(np.asarray(logits[0]), want, atol=1e-4, rtol=1e-4)
        drafts = np.asarray(proposal.draft_tokens[0]).tolist()
        assert drafts == want.argmax(-1).tolist()
        bonus = (drafts[accepted] + 1) % c.vocab_size if accepted < num_mtp else 5  # any token will do
        sequence = sequence + drafts[:accepted] + [bonus]
        path = _hidden(model, sequence)[:, L - 1 : L + accepted]  # at the last token and the accepted drafts
        path = jnp.pad(path, ((0, 0), (0, num_mtp - accepted), (0, 0)))
        state = by_hand.update(spec, state, path, jnp.asarray([accepted]))


@pytest.fixture(scope="module")
def with_mtp():
    return first_layer_mtp(layered_target())


@pytest.fixture(scope="module")
def with_two():
    return first_layer_mtp(layered_target(), num_layers=2)


@pytest.mark.parametrize(
    "batch, target, proposer",
    [
        pytest.param(1, "with_mtp", specjax.MTP(k=3), marks=pytest.mark.slow),
        (4, "with_mtp", specjax.MTP(k=3)),
        pytest.param(
            4, "with_mtp", specjax.MTP(tree=specjax.TokenTree.top_k((2, 2, 1))), marks=pytest.mark.slow
        ),
        pytest.param(1, "with_mtp", specjax.MTP(k=1), marks=pytest.mark.slow),
        pytest.param(1, "with_two", specjax.MTP(k=2), marks=pytest.mark.slow),
        (4, "with_two", specjax.MTP(k=3)),  # step 2 runs layer 0 again
    ],
)
def test_mtp_greedy_equals_plain(request, batch, target, proposer):
    """Greedy drafting from the MTP layers (one, or two in turn) emits plain decoding's tokens
    (batch 1, and 4 ragged rows, one of a single token with two layers), and its drafts are
    accepted part of the time."""
    model = request.getfixturevalue(target)
    rows = prompts(vocab_size=model.config.vocab_size, lengths=(23, 9, 17, 30)[:batch], seed=3)
    if target == "with_two" and batch > 1:
        rows[1] = rows[1][:1]  # layer 1 has no committed pair until the second step
    plain = specjax.generate(model, rows, max_new_tokens=24)
    spec = specjax.generate(model, rows, proposer=proposer, max_new_tokens=24)
    assert spec.tokens == plain.tokens
    check_acceptance(spec.metrics, 0.1, 0.9)


def test_mtp_errors_name_what_is_wrong(with_mtp, with_two):
    target = layered_target()
    with pytest.raises(ValueError, match="MTP: model 'layered-11-0.3' has no MTP layers: its 'llama' config"):
        specjax.generate(target, [[1, 2, 3]], proposer=specjax.MTP(k=2), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"MTP layers=\(1,\): model .* has 1 MTP layer"):
        specjax.generate(with_mtp, [[1, 2, 3]], proposer=specjax.MTP(layers=(1,)), max_new_tokens=2)
    with pytest.raises(ValueError, match="MTP layers must be None or a non-empty tuple"):
        specjax.MTP(layers="all")
    with pytest.raises(ValueError, match=r"MTP layers must be .* distinct .*, got \(0, 0\)"):
        specjax.MTP(layers=(0, 0))
    with pytest.raises(
        ValueError, match=r"MTP layers=\(0, 1\) with a tree: a token tree drafts with one MTP layer"
    ):
        specjax.generate(with_two, [[1, 2, 3]], proposer=specjax.MTP(tree=[[0], [1]]), max_new_tokens=2)
    tree = specjax.WithNGram(specjax.MTP(tree=[[0], [1]]))
    with pytest.raises(ValueError, match=r"WithNGram proposer \(MTP\) must draft a whole chain every step"):
        specjax.generate(with_mtp, [[1, 2, 3]], proposer=tree, max_new_tokens=2)
    with pytest.raises(
        ValueError, match="WithNGram proposer must draft from the target's features .* got NGram"
    ):
        specjax.generate(
            with_mtp, [[1, 2, 3]], proposer=specjax.WithNGram(specjax.NGram(k=2)), max_new_tokens=2
        )
    with pytest.raises(ValueError, match="WithNGram ngram must be a specjax.NGram, got int"):
        specjax.WithNGram(specjax.MTP(k=1), ngram=3)
    with pytest.raises(ValueError, match="WithNGram: proposer k=9 plus ngram k=8 must be at most 16, got 17"):
        specjax.WithNGram(specjax.MTP(k=9), specjax.NGram(k=8))
    with pytest.raises(ValueError, match="MTP k must be an integer"):
        specjax.MTP(k=0)


@pytest.mark.parametrize(
    "batch, target, proposer",
    [
        pytest.param(
            1, "with_mtp", specjax.WithNGram(specjax.MTP(k=1), specjax.NGram(k=3)), marks=pytest.mark.slow
        ),
        (4, "with_two", specjax.WithNGram(specjax.MTP(k=2), specjax.NGram(k=2, n_max=3))),
    ],
)
def test_with_ngram_greedy_equals_plain(request, batch, target, proposer):
    """FastDeploy's with_ngram: the MTP layers' drafts extended by prompt lookup emit plain
    decoding's tokens (batch 1, and 4 ragged rows), each part's drafts accepted in a band and
    counted apart by position."""
    model = request.getfixturevalue(target)
    rows = prompts(vocab_size=model.config.vocab_size, lengths=(23, 9, 17, 30)[:batch], seed=3)
    plain = specjax.generate(model, rows, max_new_tokens=24)
    spec = specjax.generate(model, rows, proposer=proposer, max_new_tokens=24)
    assert spec.tokens == plain.tokens
    m, counts = spec.metrics, spec.metrics.proposer
    model_k = proposer.proposer.k
    assert counts["model_drafted"].sum() == m.drafted_at[:, :model_k].sum()
    assert counts["ngram_drafted"].sum() == m.drafted_at[:, model_k:].sum()
    assert counts["model_accepted"].sum() == m.accepted_at[:, :model_k].sum()
    assert counts["ngram_accepted"].sum() == m.accepted_at[:, model_k:].sum()
    check_part_acceptance(m, "model", 0.3, 0.9)  # 75% (batch 1), 62% (batch 4) here
    check_part_acceptance(m, "ngram", 0.05, 0.6)  # 2 of 19, 11 of 37
