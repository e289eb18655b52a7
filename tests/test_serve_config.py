"""`--speculative-config`: vLLM's and FastDeploy's JSON keys onto specjax's proposers
(specjax/serve/config.py), one case per method, and the errors that name the bad key."""

import jax
import pytest
from hf_export import save_hf_folder
from tiny import tiny_model

import specjax
from specjax.models import DFlashHead, Eagle3Head, EagleHead, MedusaHead, MLPSpeculatorHead
from specjax.models.heads import save_head
from specjax.serve.config import METHOD_KEYS, speculative_config_to_proposer
from specjax.speculate.tree import TokenTree

TARGET = tiny_model(seed=0)


def test_no_config_is_plain_decoding():
    assert speculative_config_to_proposer(None, TARGET) is None
    assert speculative_config_to_proposer({}, TARGET) is None


def test_ngram_reads_the_prompt_lookup_keys():
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    assert speculative_config_to_proposer(config, TARGET) == specjax.NGram(k=3, n_max=3, n_min=2)
    assert speculative_config_to_proposer({"method": "ngram"}, TARGET) == specjax.NGram()


def test_draft_model_loads_the_model_in_the_targets_dtype(tmp_path):
    draft = tiny_model(seed=1, num_layers=1)
    save_hf_folder(draft, tmp_path / "draft")
    proposer = speculative_config_to_proposer(
        {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 2}, TARGET
    )
    assert isinstance(proposer, specjax.DraftModel) and proposer.k == 2
    assert proposer.model.config.num_layers == 1 and proposer.model.params.dtype.name == "float32"
    leaf = jax.tree.leaves(draft.params)[0]
    assert (jax.tree.leaves(proposer.model.params)[0] == leaf).all()
    # vLLM's older form: a "model" without a "method" is a draft model
    plain = speculative_config_to_proposer({"model": str(tmp_path / "draft")}, TARGET)
    assert isinstance(plain, specjax.DraftModel) and plain.k == specjax.DraftModel(draft).k


def test_eagle_heads_load_from_their_folders(tmp_path):
    save_head(tmp_path / "eagle", EagleHead.init(TARGET, jax.random.key(0)))
    eagle = speculative_config_to_proposer(
        {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 3}, TARGET
    )
    assert isinstance(eagle, specjax.Eagle) and eagle.k == 3 and eagle.tree is None
    save_head(tmp_path / "eagle3", Eagle3Head.init(TARGET, jax.random.key(0), aux_layer_ids=(0, 1, 2)))
    eagle3 = speculative_config_to_proposer({"method": "eagle3", "model": str(tmp_path / "eagle3")}, TARGET)
    assert isinstance(eagle3, specjax.Eagle3) and eagle3.k == specjax.Eagle3(eagle3.head).k
    with pytest.raises(ValueError, match="Eagle head must be a specjax.models.EagleHead"):
        speculative_config_to_proposer({"method": "eagle", "model": str(tmp_path / "eagle3")}, TARGET)


def test_medusa_takes_its_first_k_heads_as_a_chain(tmp_path):
    save_head(tmp_path / "medusa", MedusaHead.init(TARGET, num_heads=3, key=jax.random.key(0), scale=0.1))
    config = {"method": "medusa", "model": str(tmp_path / "medusa")}
    assert speculative_config_to_proposer(config, TARGET).tree == TokenTree.chain(3)
    chain = speculative_config_to_proposer(config | {"num_speculative_tokens": 2}, TARGET)
    assert isinstance(chain, specjax.Medusa) and chain.tree == TokenTree.chain(2)
    with pytest.raises(ValueError, match=r"'num_speculative_tokens' of this Medusa head must be in 1..3"):
        speculative_config_to_proposer(config | {"num_speculative_tokens": 4}, TARGET)


def test_dflash_drafts_k_tokens_per_block(tmp_path):
    head = DFlashHead.init(TARGET, jax.random.key(0), block_size=8, num_layers=1, aux_layer_ids=(1,))
    save_head(tmp_path / "dflash", head)
    config = {"method": "dflash", "model": str(tmp_path / "dflash")}
    assert speculative_config_to_proposer(config, TARGET).k == 7  # the head's own block of 8
    dflash = speculative_config_to_proposer(config | {"num_speculative_tokens": 3}, TARGET)
    assert isinstance(dflash, specjax.DFlash) and (dflash.k, dflash.block) == (3, 4)


def test_mlp_speculator_drafts_up_to_n_predict(tmp_path):
    save_head(tmp_path / "head", MLPSpeculatorHead.init(TARGET, n_predict=3, inner_dim=16))
    config = {"method": "mlp_speculator", "model": str(tmp_path / "head")}
    assert speculative_config_to_proposer(config, TARGET).k == 3  # one draft per stage
    proposer = speculative_config_to_proposer(config | {"num_speculative_tokens": 2}, TARGET)
    assert isinstance(proposer, specjax.MLPSpeculator) and proposer.k == 2
    with pytest.raises(ValueError, match="MLPSpeculator k=4 exceeds the head's n_predict=3"):
        speculative_config_to_proposer(config | {"num_speculative_tokens": 4}, TARGET)


def test_specjax_methods():
    self_draft = {"method": "self_draft", "layers": 1, "num_speculative_tokens": 2}
    assert speculative_config_to_proposer(self_draft, TARGET) == specjax.SelfDraft(layers=1, k=2)
    described = {
        "method": "specjax",
        "proposer": {"name": "hybrid", "first": {"name": "ngram", "k": 4, "n_min": 3}, "then": "ngram"},
    }
    hybrid = speculative_config_to_proposer(described, TARGET)
    assert isinstance(hybrid, specjax.Hybrid) and hybrid.first == specjax.NGram(k=4, n_min=3)


def test_mtp_maps_fastdeploy_keys():
    def k_of(config):
        proposer = speculative_config_to_proposer({"method": "mtp", **config}, TARGET)
        assert isinstance(proposer, specjax.MTP) and proposer.layers is None
        return proposer.k

    assert k_of({}) == 3
    assert k_of({"num_speculative_tokens": 2, "num_model_steps": 2, "mtp_strategy": "default"}) == 2
    assert k_of({"num_model_steps": 4}) == 4
    with pytest.raises(ValueError, match="num_model_steps=1 differs from num_speculative_tokens=3"):
        speculative_config_to_proposer(
            {"method": "mtp", "num_speculative_tokens": 3, "num_model_steps": 1}, TARGET
        )
    with_ngram = {"method": "mtp", "mtp_strategy": "with_ngram", "num_speculative_tokens": 5}
    proposer = speculative_config_to_proposer(with_ngram | {"num_model_steps": 2}, TARGET)
    assert isinstance(proposer, specjax.WithNGram) and isinstance(proposer.proposer, specjax.MTP)
    assert proposer.proposer.k == 2 and proposer.ngram == specjax.NGram(k=3)
    assert speculative_config_to_proposer(with_ngram, TARGET).proposer.k == 1  # FastDeploy's default
    with pytest.raises(
        ValueError, match="'with_ngram' needs num_speculative_tokens greater than num_model_steps"
    ):
        speculative_config_to_proposer({"method": "mtp", "mtp_strategy": "with_ngram"}, TARGET)
    with pytest.raises(
        ValueError, match="mtp_strategy 'suffix' is not supported; allowed: 'default', 'with_ngram'"
    ):
        speculative_config_to_proposer({"method": "mtp", "mtp_strategy": "suffix"}, TARGET)


@pytest.mark.parametrize(
    "config, match",
    [
        ("ngram", "speculative_config must be a JSON object, got 'ngram'"),
        ({"num_speculative_tokens": 3}, "speculative_config needs 'method' \\(one of ngram, draft_model"),
        ({"method": "suffix"}, "unknown method 'suffix'; allowed: ngram, draft_model, eagle, eagle3"),
        (
            {"method": "ngram", "model": "x"},
            "unknown key 'model' for method 'ngram'; allowed: method, num_speculative_tokens, "
            "prompt_lookup_max, prompt_lookup_min",
        ),
        (
            {"method": "eagle3", "model": "x", "draft_tensor_parallel_size": 1},
            "unknown key 'draft_tensor_parallel_size' for method 'eagle3'",
        ),
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be an integer in 1..16, got 0"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "'num_speculative_tokens' must be an integer"),
        ({"method": "ngram", "prompt_lookup_max": 0}, "'prompt_lookup_max' must be an integer >= 1, got 0"),
        ({"method": "ngram", "prompt_lookup_min": 6}, r"prompt_lookup_min \(6\) must not exceed"),
        ({"method": "draft_model"}, "method 'draft_model' needs 'model'"),
        ({"method": "eagle"}, "method 'eagle' needs 'model' \\(the folder of a saved or published head\\)"),
        ({"method": "self_draft"}, "method 'self_draft' needs 'layers'"),
        ({"method": "specjax", "proposer": {"name": "beam"}}, "speculative_config.proposer must name one of"),
    ],
)
def test_bad_configs_name_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        speculative_config_to_proposer(config, TARGET)


def test_a_missing_head_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        speculative_config_to_proposer({"method": "eagle", "model": str(tmp_path / "none")}, TARGET)


def test_every_method_is_covered():
    # the cases above, one per method: a new method must come with its own
    assert set(METHOD_KEYS) == {
        "ngram", "draft_model", "eagle", "eagle3", "medusa", "dflash", "mlp_speculator", "mtp", "self_draft",
        "specjax"
    }  # fmt: skip
