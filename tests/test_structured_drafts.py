"""Drafts masked by the constraint before they are drawn (specjax/speculate/grammar.py,
mask_draft_logits): every proposer that draws from logits of its own drafts only tokens the
automaton allows along its own drafts (a tree's nodes along their own paths), a sampled draft's
q is its law over those tokens, and the output is still the constrained target's: greedy equals
plain constrained greedy, sampled follows the restricted law by exact enumeration.

What a proposer drafted is read by `Audited`, a wrapper written for this test: it walks the
automaton along each proposal with the host-built tables and counts, per row, the valid drafts
the state before them forbids and the draft positions whose q puts mass outside the allowed set,
reported through the proposer counters (SpecMetrics.proposer) the protocol declares."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import first_layer_mtp
from laws import assert_sequence_law
from test_structured import DRAFT, EOS, PROMPTS, REGEX, SCHEMA, TARGET, plain_greedy, restricted_joint

import specjax
from specjax.models import DFlashHead, EagleHead, MedusaHead, MLPSpeculatorHead
from specjax.models.eagle3 import Eagle3Head
from specjax.speculate.proposers.protocol import Proposer, Wrapper
from specjax.speculate.tree import TokenTree

V = TARGET.config.vocab_size
MTP_TARGET = dataclasses.replace(first_layer_mtp(TARGET), tokenizer=TARGET.tokenizer)


@dataclasses.dataclass(frozen=True)
class AuditSpec(Wrapper):
    """The inner spec, with per-row counts of what its proposals hold that the constraint forbids."""

    inner: object
    vocab: tuple | None = None  # a draft vocabulary: where a state allows none of it, nothing is counted

    def init(self, ctx):
        return self.inner.init(ctx), jnp.zeros((ctx.prompt_lengths.shape[0], 3), jnp.int32)

    def propose(self, ctx, state):
        proposal, inner_state = self.inner.propose(ctx, state[0])
        counts = state[1]
        if ctx.grammar_states is not None:
            counts = counts + self._audit(ctx, proposal)
        return proposal, (inner_state, counts)

    def _audit(self, ctx, proposal):
        grammar, drafts = ctx.sampling.grammar, proposal.draft_tokens
        tree = self.inner.capabilities.tree
        if tree is None:  # the state before draft j: after the committed tokens and drafts < j
            before = grammar.path_states(ctx.grammar_states, drafts, V)[:, :-1]
        else:  # before node i: the state at its parent
            at = grammar.node_states(ctx.grammar_states, drafts, tree.parents, V)
            before = at[:, np.asarray(tree.parents[1:])]
        allowed = grammar.mask(before, V)  # [B, K, V]
        if self.vocab is not None:  # rows allowed nothing the drafter can draft are not its fault
            can = jnp.any(allowed[..., np.asarray(self.vocab)], axis=-1, keepdims=True)
            allowed |= ~can
        ok = jnp.take_along_axis(allowed, drafts[..., None], axis=-1)[..., 0]
        forbidden = jnp.sum(proposal.valid & ~ok, axis=1)
        valid = jnp.sum(proposal.valid, axis=1)
        outside = jnp.zeros_like(valid)
        if proposal.draft_probs is not None:
            mass = jnp.sum(jnp.where(allowed, 0.0, proposal.draft_probs), axis=-1)  # [B, K]
            outside = jnp.sum(proposal.valid & (mass > 1e-6), axis=1)
        return jnp.stack([forbidden, valid, outside], axis=1).astype(jnp.int32)

    def observe(self, ctx, state):
        return self.inner.observe(ctx, state[0]), state[1]

    def update(self, ctx, state):
        return self.inner.update(ctx, state[0]), state[1]

    def needed_width(self, state, running):
        return self.inner.needed_width(state[0], running)

    def state_bytes(self, batch_size, capacity):
        return self.inner.state_bytes(batch_size, capacity) + batch_size * 3 * 4

    def counters(self, state):
        counts = state[1]
        return {"forbidden": counts[:, 0], "drafted": counts[:, 1], "q_outside": counts[:, 2]}


@dataclasses.dataclass(frozen=True, eq=False)
class Audited(Proposer):
    inner: Proposer
    vocab: tuple | None = None

    def spec(self, target, warp=None, mesh=None):
        return AuditSpec(self.inner.spec(target, warp, mesh), self.vocab)

    def params(self, target):
        return self.inner.params(target)

    @property
    def draft_positions(self) -> int:
        return self.inner.draft_positions


TREE, AUX = TokenTree.top_k((3, 2)), (0, 1, 2)
SUBSET = tuple(range(0, 30)) + (EOS,)  # digits, "-" and EOS, no letters: states after "-" draft none


@functools.cache
def drafters():
    key = jax.random.key(0)
    eagle3 = Eagle3Head.init(TARGET, key, aux_layer_ids=AUX, scale=1.0)
    return {
        "draft": (TARGET, specjax.DraftModel(DRAFT, k=3), None),
        "self-draft": (TARGET, specjax.SelfDraft(layers=1, k=3), None),
        "eagle": (TARGET, specjax.Eagle(EagleHead.init(TARGET, key), k=3), None),
        "eagle-tree": (TARGET, specjax.Eagle(EagleHead.init(TARGET, key), tree=TREE), None),
        "eagle3": (TARGET, specjax.Eagle3(eagle3, k=3), None),
        "eagle3-subset": (
            TARGET,
            specjax.Eagle3(Eagle3Head.init(TARGET, key, vocab=np.asarray(SUBSET), aux_layer_ids=AUX), k=3),
            SUBSET,
        ),
        "dflash": (
            TARGET,
            specjax.DFlash(DFlashHead.init(TARGET, key, block_size=4, num_layers=1, aux_layer_ids=(1, 2))),
            None,
        ),
        "medusa": (TARGET, specjax.Medusa(MedusaHead.init(TARGET, num_heads=3, key=key, scale=0.5)), None),
        "medusa-tree": (
            TARGET,
            specjax.Medusa(
                MedusaHead.init(TARGET, num_heads=2, key=key, scale=0.5), tree=TokenTree.top_k((3, 2))
            ),
            None,
        ),
        "mlp-speculator": (TARGET, specjax.MLPSpeculator(MLPSpeculatorHead.init(TARGET, key=key)), None),
        "mtp": (MTP_TARGET, specjax.MTP(k=3), None),
    }


def run(name, sampling, prompts=PROMPTS, max_new_tokens=30, **options):
    target, proposer, vocab = drafters()[name]
    return specjax.generate(
        target,
        prompts,
        proposer=Audited(proposer, vocab),
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        **options,
    )


CONSTRAINTS = (dict(regex=REGEX), dict(json_schema=SCHEMA))


@pytest.mark.parametrize("name", list(drafters()))
def test_greedy_drafts_are_allowed_and_the_output_is_plain_constrained_greedy(name):
    accepted = drafted = 0
    for fields in CONSTRAINTS:
        result = run(name, specjax.Sampling(**fields))
        # (MTP's target shares TARGET's weights: the same plain output)
        assert result.tokens == plain_greedy(json.dumps(fields)), (name, fields)
        counts = result.metrics.proposer
        assert int(np.sum(counts["forbidden"])) == 0, (name, fields, counts)
        assert int(np.sum(counts["drafted"])) > 0
        accepted += int(result.metrics.accepted.sum())
        drafted += int(result.metrics.drafted.sum())
    # Random heads over a tiny model: allowed drafts are accepted part of the time.
    assert 0 < accepted < drafted, (name, accepted, drafted)


def test_the_audit_counts_drafts_the_constraint_forbids():
    """The audit can fail: n-gram drafts are copied from the context, not drawn, so nothing masks
    them, and under the regex some are forbidden (and rejected)."""
    result = specjax.generate(
        TARGET,
        ["12 cats 12 cats 12 cats", "1234-ab 1234-ab"],
        proposer=Audited(specjax.NGram(k=3, n_max=3, n_min=1)),
        sampling=specjax.Sampling(regex=REGEX),
        max_new_tokens=30,
    )
    assert int(np.sum(result.metrics.proposer["forbidden"])) > 0


def test_free_rows_beside_constrained_ones_draft_as_without_a_constraint():
    target, proposer, _ = drafters()["eagle"]
    free = specjax.generate(target, PROMPTS, proposer=proposer, max_new_tokens=30)
    mixed = specjax.generate(
        target,
        PROMPTS,
        proposer=Audited(proposer),
        sampling=[specjax.Sampling(regex=REGEX), specjax.Sampling(), specjax.Sampling()],
        max_new_tokens=30,
    )
    assert mixed.tokens[1:] == free.tokens[1:]
    assert np.array_equal(mixed.metrics.accepted[1:], free.metrics.accepted[1:])
    assert int(np.sum(mixed.metrics.proposer["forbidden"])) == 0


@pytest.mark.parametrize("name", ["draft", "mlp-speculator", "mtp"])
def test_sampled_drafts_are_drawn_from_the_allowed_tokens(name):
    result = run(
        name,
        specjax.Sampling(regex=REGEX, temperature=1.0, top_p=0.9),
        prompts=PROMPTS * 4,
        max_new_tokens=16,
        key=jax.random.key(5),
    )
    counts = result.metrics.proposer
    assert int(np.sum(counts["drafted"])) > 0
    assert int(np.sum(counts["forbidden"])) == 0 and int(np.sum(counts["q_outside"])) == 0, counts
    accepted, drafted = int(result.metrics.accepted.sum()), int(result.metrics.drafted.sum())
    assert 0 < accepted < drafted, (name, accepted, drafted)


def test_masked_sampled_drafts_keep_the_restricted_law():
    """2,000 rows of `(a|b|ab)c?` at temperature 1, drafted by the MLP speculator's masked
    sampled drafts, against exact enumeration of the target's law restricted to the language."""
    regex, language, prompt = r"(a|b|ab)c?", ["a", "b", "ab", "ac", "bc", "abc"], "ab c"
    joint = restricted_joint(TARGET.tokenizer(prompt)["input_ids"], language, 1.0)
    result = run(
        "mlp-speculator",
        specjax.Sampling(regex=regex, temperature=1.0),
        prompts=[prompt] * 2000,
        max_new_tokens=5,
        key=jax.random.key(8),
    )
    assert int(np.sum(result.metrics.proposer["q_outside"])) == 0
    assert 0 < int(result.metrics.accepted.sum()) < int(result.metrics.drafted.sum())
    assert_sequence_law(result.tokens, joint, f"mlp-speculator: {regex}")
