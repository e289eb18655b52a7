"""Every wrapper composes: ForcedAcceptance, Dynamic and Hybrid around each other and around every
proposer either run (lossless ones: greedy output equal to plain decoding's; ForcedAcceptance: the
accepted fraction its rate forces) or are refused when built, with a message naming the
combination and why (docs/proposers.md, "How wrappers compose").

One tiny target serves every proposer: a `quiet_target` with constant queries (a DFlash head's
need) and an MTP layer, with heads built from its first layer so that their drafts are accepted
part of the time (tests/drafters.py). The grid's spec-level part (which combinations build, and
what their capabilities say) runs for every pair, cheaply; the run-level part compiles one program
per combination, so the default suite runs the combinations the issue named, and `make test-all`
runs them all.
"""

import functools

import jax
import pytest
from drafters import first_layer_dflash, first_layer_eagle, first_layer_eagle3, first_layer_mtp, quiet_target

import specjax
from specjax.models import MedusaHead, MLPSpeculatorHead
from specjax.serve import Engine, Request
from specjax.speculate.proposers import ForcedSpec, HybridSpec
from specjax.speculate.sampling import WarpSpec
from specjax.speculate.verifiers import LOSSLESS

TARGET = first_layer_mtp(quiet_target(seed=11, num_layers=3, embed_scale=0.01, constant_queries=True))
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [20, 21, 22, 20, 21]]
NEW_TOKENS = 12
GOODPUT = specjax.GoodputSchedule(draft_cost=0.05, verify_cost=0.1)


@functools.cache
def parts() -> dict:
    """One of each proposer, k = 2 (a tree's depth 2)."""
    eagle = first_layer_eagle(TARGET)
    eagle3 = first_layer_eagle3(TARGET, (0, 1, 3))
    dflash = first_layer_dflash(TARGET, 3, (0, 2))
    medusa = MedusaHead.init(TARGET, 2, jax.random.key(2), scale=0.1)
    mlp = MLPSpeculatorHead.init(TARGET, n_predict=2, key=jax.random.key(3))
    return {
        "ngram": specjax.NGram(k=2, n_min=1),
        "draft_model": specjax.DraftModel(TARGET, k=2),
        "self_draft": specjax.SelfDraft(1, k=2),
        "medusa": specjax.Medusa(medusa),
        "mlp_speculator": specjax.MLPSpeculator(mlp, k=2),
        "eagle": specjax.Eagle(eagle, k=2),
        "eagle-tree": specjax.Eagle(eagle, tree=specjax.TokenTree.top_k((2, 1))),
        "eagle3": specjax.Eagle3(eagle3, k=2),
        "dflash": specjax.DFlash(dflash, block=3),
        "mtp": specjax.MTP(k=2),
        "with_ngram": specjax.WithNGram(specjax.MTP(k=1), specjax.NGram(k=1)),
    }


def wrapped(wrapper: str, part):
    """`part` inside one wrapper: forced (rate 1: every draft accepted), dynamic (heuristic or
    goodput), or hybrid (n-gram lookup first, `part` then; `part` first, lookup then)."""
    lookup = specjax.NGram(k=2, n_min=2)
    return {
        "forced": lambda: specjax.ForcedAcceptance(1.0, part),
        "dynamic": lambda: specjax.Dynamic(part),
        "dynamic-goodput": lambda: specjax.Dynamic(part, GOODPUT),
        "hybrid-then": lambda: specjax.Hybrid(lookup, part),
        "hybrid-first": lambda: specjax.Hybrid(part, lookup),
    }[wrapper]()


WRAPPERS = ("forced", "dynamic", "dynamic-goodput", "hybrid-then", "hybrid-first")
PARTS = (
    "ngram",
    "draft_model",
    "self_draft",
    "medusa",
    "mlp_speculator",
    "eagle",
    "eagle-tree",
    "eagle3",
    "dflash",
    "mtp",
    "with_ngram",
)
# What is refused, by (wrapper, part), and the words that say why.
REFUSED = {
    **{(w, "medusa"): "drafts a token tree" for w in ("hybrid-then", "hybrid-first")},
    **{(w, "eagle-tree"): "drafts a token tree" for w in ("hybrid-then", "hybrid-first")},
    **{
        (w, p): "keeps a cache of its own drafts"
        for w in ("hybrid-then", "hybrid-first")
        for p in ("draft_model", "self_draft")
    },  # fmt: skip
}


def nested() -> dict:
    """Wrappers inside wrappers, by name: the proposer, and the words of its refusal (None: it runs)."""
    p = parts()
    lookup = specjax.NGram(k=2, n_min=2)
    hybrid = specjax.Hybrid(lookup, p["eagle3"])
    return {
        # The two combinations of the issue: refused as "leave k out", and a TypeError with k given
        "forced(hybrid)": (specjax.ForcedAcceptance(1.0, hybrid), None),
        "forced(hybrid, k)": (specjax.ForcedAcceptance(1.0, hybrid, k=2), None),
        # ... and one that lost its widths, batch-wide k, join and chunk programs
        "forced(dynamic-goodput)": (specjax.ForcedAcceptance(1.0, specjax.Dynamic(lookup, GOODPUT)), None),
        "dynamic(forced)": (specjax.Dynamic(specjax.ForcedAcceptance(1.0, lookup)), None),
        "dynamic(hybrid)": (specjax.Dynamic(hybrid), None),
        "dynamic-goodput(hybrid)": (specjax.Dynamic(hybrid, GOODPUT), None),
        "forced(dynamic(hybrid))": (specjax.ForcedAcceptance(1.0, specjax.Dynamic(hybrid)), None),
        "hybrid(hybrid, ngram)": (specjax.Hybrid(hybrid, specjax.NGram(k=2)), None),
        "hybrid(forced, eagle3)": (
            specjax.Hybrid(specjax.ForcedAcceptance(1.0, lookup), p["eagle3"]),
            "Hybrid first has a verifier of its own",
        ),
        "hybrid(ngram, dynamic)": (
            specjax.Hybrid(lookup, specjax.Dynamic(specjax.NGram(k=2))),
            "Hybrid then is a Dynamic proposer",
        ),
        "with_ngram(dynamic(mtp))": (
            specjax.WithNGram(specjax.Dynamic(specjax.MTP(k=1)), specjax.NGram(k=1)),
            "must draft a whole chain every step",
        ),
        "with_ngram(hybrid)": (
            specjax.WithNGram(specjax.Hybrid(specjax.MTP(k=1), lookup), specjax.NGram(k=1)),
            "must draft from the target's features and catch up",
        ),
    }


def refused_when_built():
    """Combinations refused as they are constructed (before any target is seen)."""
    lookup = specjax.NGram(k=2)
    with pytest.raises(ValueError, match="must not hold a ForcedAcceptance"):
        specjax.ForcedAcceptance(0.5, specjax.Dynamic(specjax.ForcedAcceptance(0.5, lookup)))
    with pytest.raises(ValueError, match="Dynamic proposer must be a proposer other than Dynamic"):
        specjax.Dynamic(specjax.Dynamic(lookup))
    with pytest.raises(ValueError, match="Hybrid then must be a specjax proposer"):
        specjax.Hybrid(lookup, "ngram")


def test_combinations_refused_when_constructed():
    refused_when_built()


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("part", PARTS)
def test_every_wrapper_around_every_proposer_builds_or_is_refused(wrapper, part):
    """Spec level: the combination's spec builds, with its parts' capabilities combined by the one
    rule, or is refused naming the combination and why."""
    proposer = wrapped(wrapper, parts()[part])
    reason = REFUSED.get((wrapper, part))
    if reason is not None:
        with pytest.raises(ValueError, match=reason):
            proposer.spec(TARGET, WarpSpec())
        return
    spec = proposer.spec(TARGET, WarpSpec())
    caps, inner = spec.capabilities, parts()[part].spec(TARGET, WarpSpec()).capabilities
    if wrapper == "forced":
        assert isinstance(spec, ForcedSpec) and caps.verifier.rates == (1.0,) * spec.k
        assert caps.verifier.inner is LOSSLESS
        # everything else as the part declares it
        for field in ("tree", "always_drafts", "target_features", "widths", "verify_widths"):
            assert getattr(caps, field) == getattr(inner, field), field
    elif wrapper.startswith("dynamic"):
        assert not caps.always_drafts and caps.tree == inner.tree and caps.verifier is LOSSLESS
        assert (caps.widths is not None) == inner.narrows  # drafts only the batch's widest k
    else:
        assert isinstance(spec, HybridSpec) and caps.tree is None and caps.verifier is LOSSLESS
        assert spec.k == max(spec.first.k, spec.then.k)


@pytest.mark.parametrize("name", list(nested()))
def test_wrappers_inside_wrappers_build_or_are_refused(name):
    proposer, reason = nested()[name]
    if reason is not None:
        with pytest.raises(ValueError, match=reason):
            proposer.spec(TARGET, WarpSpec())
        return
    spec = proposer.spec(TARGET, WarpSpec())
    assert spec.k == 2


def test_forced_around_dynamic_keeps_what_dynamic_does():
    """ForcedAcceptance around Dynamic(goodput) keeps its widths, its batch-wide schedule (the
    running rows reach it), its join and its two chunk programs: it changes the verifier alone."""
    dynamic = specjax.Dynamic(specjax.NGram(k=4), GOODPUT)
    alone, forced = (p.spec(TARGET, WarpSpec()) for p in (dynamic, specjax.ForcedAcceptance(1.0, dynamic)))
    assert forced.capabilities.widths == alone.capabilities.widths == (0, 1, 2, 4)
    assert forced.capabilities.verifier.rates == (1.0,) * 4
    drafting, quiet = forced.chunk_programs()
    assert isinstance(drafting, ForcedSpec) and drafting.inner == alone.chunk_programs()[0]
    assert quiet.capabilities.widths == (0,) and quiet.capabilities.verifier == forced.capabilities.verifier


@functools.cache
def plain_tokens():
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=NEW_TOKENS).tokens


def check_runs(proposer):
    """A lossless proposer's greedy output equals plain decoding's; ForcedAcceptance at rate 1
    accepts every draft it verifies (its band: exactly all)."""
    result = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=NEW_TOKENS)
    metrics, capabilities = result.metrics, proposer.spec(TARGET, WarpSpec()).capabilities
    if capabilities.verifier is not LOSSLESS:  # a ForcedAcceptance, perhaps inside another wrapper
        assert metrics.drafted.sum() > 0
        if capabilities.tree is None:  # every valid draft
            assert (metrics.accepted == metrics.drafted).all(), (metrics.accepted, metrics.drafted)
        else:  # a tree's first-ranked path, its whole depth, each drafting step
            assert (metrics.accepted == proposer.k * metrics.drafting_steps).all()
    else:
        assert result.tokens == plain_tokens()


# The default suite runs the combinations the issue named, a Dynamic around a Hybrid, and Forced
# around Dynamic in the engine; `make test-all` runs every wrapper around every proposer (the
# existing tests of Dynamic, Hybrid and ForcedAcceptance run each around several proposers).
@pytest.mark.parametrize(
    "wrapper, part",
    [pytest.param(w, p, marks=pytest.mark.slow) for w in WRAPPERS for p in PARTS if (w, p) not in REFUSED],
)
def test_every_wrapper_around_every_proposer_runs(wrapper, part):
    check_runs(wrapped(wrapper, parts()[part]))


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            marks=()
            if n in ("forced(hybrid)", "forced(dynamic-goodput)", "dynamic(hybrid)")
            else pytest.mark.slow,
        )  # fmt: skip
        for n, (_, reason) in nested().items()
        if reason is None
    ],
)
def test_wrappers_inside_wrappers_run(name):
    check_runs(nested()[name][0])


def test_forced_around_dynamic_serves_in_the_engine():
    """The engine's programs for Dynamic (drafting and quiet chunks, the join of a new row) run
    under ForcedAcceptance too, and every draft verified is accepted."""
    proposer = specjax.ForcedAcceptance(1.0, specjax.Dynamic(specjax.NGram(k=2), GOODPUT))
    engine = Engine(TARGET, proposer, max_batch=2, max_model_len=64, chunk_steps=4)
    ids = [engine.add(Request(prompt, max_new_tokens=NEW_TOKENS)) for prompt in PROMPTS]
    drafted = accepted = 0
    while engine.has_work:
        for update in engine.step():
            drafted, accepted = drafted + update.num_draft_tokens, accepted + update.num_accepted_tokens
    assert len(ids) == 2 and drafted > 0 and accepted == drafted
