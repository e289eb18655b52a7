"""Proposers by name (the CLI's and sweep files' descriptions) and `with_k`."""

import pytest
from tiny import tiny_model

import specjax
from specjax.named import proposer_from_description, with_k

TARGET = tiny_model(seed=0)


def test_descriptions_build_the_proposers_they_name():
    assert proposer_from_description("plain") is None and proposer_from_description(None) is None
    assert proposer_from_description({"name": "ngram", "k": 3, "n_max": 2}) == specjax.NGram(3, 2)
    assert proposer_from_description({"name": "self_draft", "layers": 1, "k": 2}) == specjax.SelfDraft(1, 2)
    forced = proposer_from_description({"name": "forced", "acceptance": 0.5, "k": 3})
    assert forced.acceptance == (0.5, 0.5, 0.5) and forced.proposer is None
    dynamic = proposer_from_description(
        {
            "name": "dynamic",
            "proposer": {"name": "ngram", "k": 6},
            "schedule": {"name": "goodput", "decay": 0.8},
        }
    )
    assert dynamic.proposer == specjax.NGram(k=6)
    assert dynamic.schedule == specjax.GoodputSchedule(decay=0.8)
    assert proposer_from_description({"name": "dynamic", "proposer": "ngram"}).schedule == (
        specjax.HeuristicSchedule()
    )
    hybrid = proposer_from_description(
        {
            "name": "hybrid",
            "first": {"name": "ngram", "k": 4, "n_min": 3},
            "then": {"name": "ngram", "k": 2},
            "gate": {"name": "goodput", "draft_cost": 0.1, "verify_cost": 0.2},
        }
    )
    assert (hybrid.first, hybrid.then) == (specjax.NGram(k=4, n_min=3), specjax.NGram(k=2))
    assert hybrid.gate == specjax.GoodputSchedule(draft_cost=0.1, verify_cost=0.2)
    mtp = proposer_from_description({"name": "mtp", "k": 2, "layers": [0]})
    assert isinstance(mtp, specjax.MTP) and (mtp.k, mtp.layers) == (2, (0,))
    with_ngram = proposer_from_description(
        {"name": "with_ngram", "proposer": {"name": "mtp", "k": 1}, "ngram": {"name": "ngram", "k": 3}}
    )
    assert isinstance(with_ngram.proposer, specjax.MTP) and with_ngram.proposer.k == 1
    assert with_ngram.ngram == specjax.NGram(k=3)
    assert proposer_from_description({"name": "with_ngram", "proposer": "mtp"}).ngram == specjax.NGram(k=2)


@pytest.mark.parametrize(
    "description, match",
    [
        ({"name": "beam"}, "proposer must name one of plain, ngram"),
        ({"name": "ngram", "layers": 2}, "unknown option 'layers' for 'ngram'; allowed: k, n_max, n_min"),
        ({"name": "dynamic"}, "dynamic needs 'proposer'"),
        ({"name": "dynamic", "proposer": "ngram", "schedule": "fast"}, "schedule must be one of heuristic"),
        ({"name": "eagle"}, "eagle needs 'head'"),
        ({"name": "mlp_speculator"}, "mlp_speculator needs 'head'"),
        ({"name": "with_ngram"}, "with_ngram needs 'proposer'"),
        ({"name": "with_ngram", "proposer": "mtp", "ngram": "self_draft"}, "ngram must describe an ngram"),
        ({"name": "mtp", "depth": 2}, "unknown option 'depth' for 'mtp'"),
        ({"name": "draft_model", "k": 2}, "draft_model needs 'model'"),
        ({"name": "ngram", "k": 0}, "NGram k must be an integer in 1..16"),
        ({"name": "hybrid", "first": "ngram", "then": "ngram", "gate": "heuristic"}, "Hybrid gate must be"),
    ],
)
def test_bad_descriptions(description, match):
    with pytest.raises(ValueError, match=match):
        proposer_from_description(description, TARGET)


def test_with_k():
    assert with_k(specjax.NGram(k=5, n_max=2), 2) == specjax.NGram(k=2, n_max=2)
    assert with_k(specjax.SelfDraft(1, k=4), 3) == specjax.SelfDraft(1, k=3)
    dynamic = with_k(specjax.Dynamic(specjax.NGram(k=8)), 3)
    assert dynamic.proposer == specjax.NGram(k=3) and dynamic.k == 3
    forced = with_k(specjax.ForcedAcceptance(0.5, k=4), 2)
    assert forced.k == 2 and forced.acceptance == (0.5, 0.5)
    with pytest.raises(ValueError, match="one rate per position"):
        with_k(specjax.ForcedAcceptance([0.5, 0.4]), 3)
    import jax

    from specjax.models import DFlashHead, Eagle3Head

    eagle3 = Eagle3Head.init(TARGET, jax.random.key(0), aux_layer_ids=(0, 1, 2))
    chain = with_k(specjax.Eagle3(eagle3, k=4), 2)
    assert isinstance(chain, specjax.Eagle3) and chain.head is eagle3 and (chain.k, chain.tree) == (2, None)
    dflash = DFlashHead.init(TARGET, jax.random.key(0), block_size=8, num_layers=1, aux_layer_ids=(1,))
    assert with_k(specjax.DFlash(dflash), 3).k == 3
    hybrid = with_k(specjax.Hybrid(specjax.NGram(k=4, n_min=3), specjax.DFlash(dflash)), 3)
    assert hybrid.first == specjax.NGram(k=3, n_min=3) and hybrid.then.k == 3
    with pytest.raises(ValueError, match="cannot change k of Medusa"):
        import jax

        from specjax.models import MedusaHead

        with_k(specjax.Medusa(MedusaHead.init(TARGET, num_heads=2, key=jax.random.key(0))), 3)


def test_a_head_description_takes_a_confidence_threshold(tmp_path):
    import jax

    from specjax.models import Eagle3Head
    from specjax.models.heads import save_head

    save_head(tmp_path / "head", Eagle3Head.init(TARGET, jax.random.key(0), aux_layer_ids=(0, 1, 2)))
    description = {"name": "eagle3", "head": str(tmp_path / "head"), "k": 2, "confidence_threshold": 0.3}
    proposer = proposer_from_description(description, TARGET)
    assert isinstance(proposer, specjax.Eagle3) and (proposer.k, proposer.confidence_threshold) == (2, 0.3)
    with pytest.raises(ValueError, match="Eagle3 confidence_threshold must be a number in"):
        proposer_from_description(description | {"confidence_threshold": 2}, TARGET)
