"""What a proposer is: the one declared contract between a drafting method and the compiled loop.

A proposer comes in two parts:

- the user-facing `Proposer` (NGram(k=5), Eagle3(head, k=4), Hybrid(...), a researcher's own): a
  frozen config that knows nothing of any one call. `proposer.spec(target, warp, mesh)` resolves
  it for a call, and `proposer.params(target)` gives its arrays (or None);
- the `ProposerSpec` it resolves to: frozen and hashable, held by the loop as a static value (two
  calls with equal specs share one compiled program), with its params passed as an argument.

A spec provides four functions, each taking one context object (below):

    init(ctx: InitContext) -> state                       after the target's prefill
    propose(ctx: ProposeContext, state) -> (Proposal, state)   up to k drafts per row
    update(ctx: UpdateContext, state) -> state                 catch up on what was accepted
    state_bytes(batch_size, capacity) -> int              device memory of its state

and `capabilities`, one frozen `Capabilities` record of what it does, whose defaults describe a
chain drafter that drafts k tokens every step from the tokens alone. The loop, the host side, the
engine, export and Hybrid read that record and call the spec's other methods, which all have a
default here: nothing asks a spec whether it has a member. A wrapper (Dynamic, ForcedAcceptance,
Hybrid) derives its record from its parts' by one rule, `Capabilities.combine`, and forwards every
method of this protocol to its part (`Wrapper`), so that it loses nothing its part does.

Draft sampling uses the target's warping (speculate/sampling.py), and a Proposal's draft_probs
is exactly the distribution each draft was drawn from (None for a deterministic proposer, whose q
is one-hot): that is what keeps verification lossless.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax

from specjax.sharding import replicate
from specjax.speculate.verifiers import LOSSLESS

# Capabilities.target_features: the target's final-normed hidden states (EAGLE-1, Medusa, MTP).
FINAL_HIDDEN = "final hidden states"


@dataclasses.dataclass(frozen=True)
class InitContext:
    """What `init` sees: the prompts, just prefilled by the target."""

    target_params: Any  # the target's LlamaParams (as the program's backend reads them)
    params: Any  # the proposer's own params (`Proposer.params`), None for none
    prompt_tokens: jax.Array  # [B, T] int32, right-padded
    prompt_lengths: jax.Array  # [B] int32
    capacity: int  # slots per row of the loop's token buffer and caches
    target_features: jax.Array | None  # [B, T, F]: what `capabilities.target_features` asks for, or None
    target_cache: Any  # the target's KVCache holding the prompts (a draft may start from it)


@dataclasses.dataclass(frozen=True)
class ProposeContext:
    """What `propose` (and `observe`) sees at one step: the committed sequences and the options."""

    target_params: Any
    params: Any
    tokens: jax.Array  # [B, S] int32: row b's committed sequence is tokens[b, :lengths[b]]
    lengths: jax.Array  # [B] int32
    keys: jax.Array | None  # [B] one PRNG key per row for this step (a sampled draft's)
    sampling: Any  # SamplingParams: per-row temperature, filters, penalties, ...
    history: Any  # TokenHistory of the penalties' counts; None when no row has a penalty
    # The draft width the loop chose for this step among `capabilities.widths` (Dynamic); None:
    # the spec's own k.
    width: int | None = None
    # [B] int32 the rows' constraint automaton states (-1: a free row; the tables are in
    # sampling.grammar); None when no row has a constraint (specjax/speculate/grammar.py)
    grammar_states: jax.Array | None = None

    def replace(self, **changes) -> ProposeContext:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class UpdateContext:
    """What `update` sees after a verify pass."""

    # [B, K+1, F] the target's features (as at init) at the last token and at each accepted draft
    # (entry num_accepted[b]: the state the next token came from)
    path_features: jax.Array
    num_accepted: jax.Array  # [B] int32: drafts accepted this step
    running: jax.Array  # [B] bool: the rows that were running at this step

    def replace(self, **changes) -> UpdateContext:
        return dataclasses.replace(self, **changes)


# How a wrapper's capability follows from its parts' (`Capabilities.combine`): "same" (every part
# agrees, or the wrapper says otherwise), "same_given" (the parts that have one agree), "any",
# "all", "max".
_SAME, _SAME_GIVEN, _ANY, _ALL, _MAX = "same", "same_given", "any", "all", "max"


def _rule(rule: str, default, doc: str):
    return dataclasses.field(default=default, metadata={"combine": rule, "doc": doc})


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a proposer spec does, declared once: the loop, the host side, the engine and the
    wrappers read it, and nothing else tells them. The defaults are a chain drafter's that drafts
    its k tokens every step from the committed tokens alone."""

    tree: Any = _rule(
        _SAME,
        None,
        "A TokenTree it drafts (a proposal then holds one token per node; k is the tree's depth), "
        "or None for a chain of k.",
    )
    always_drafts: bool = _rule(
        _ANY,
        True,
        "Every running row drafts all k tokens every step. False: a row may draft fewer or none "
        "(its valid mask), and a step in which no running row drafted is a one-token pass.",
    )
    target_features: Any = _rule(
        _SAME_GIVEN,
        None,
        "What it reads of the target's passes (InitContext.target_features, "
        "UpdateContext.path_features): None (nothing: n-gram lookup, a draft model), FINAL_HIDDEN, "
        "or a tuple of layer ids whose incoming residual streams it reads side by side (EAGLE-3, "
        "DFlash; id L is the last layer's output).",
    )
    reads_target_cache: bool = _rule(
        _ANY,
        False,
        "init reads InitContext.target_cache (a draft whose cache starts as the target's over the "
        "prompt, SelfDraft).",
    )
    verify_widths: tuple[int, ...] | None = _rule(
        _SAME,
        None,
        "Chain lengths a step may verify (ascending; the loop verifies the smallest covering every "
        "running row's drafts); None: every step verifies k.",
    )
    widths: tuple[int, ...] | None = _rule(
        _SAME,
        None,
        "Draft widths the loop switches between, 0 first (Dynamic): it drafts and verifies the "
        "smallest covering `needed_width`, ProposeContext.width telling propose which; None: k.",
    )
    narrows: bool = _rule(
        _ALL,
        False,
        "`narrowed(k)` gives this spec drafting fewer tokens over the same state (n-gram lookup, a "
        "draft model): what lets Dynamic draft only as many as its rows need.",
    )
    catches_up: bool = _rule(
        _ALL,
        False,
        "`accepting(K)` gives this spec taking in up to K accepted drafts a step, more than its own "
        "k: a part beside a longer drafter (Hybrid, WithNGram).",
    )
    accepts: int | None = _rule(
        _MAX,
        None,
        "The most accepted drafts one update takes in; None: k.",
    )
    stateless: bool = _rule(
        _ALL,
        False,
        "It keeps no state: a step it does not draft has nothing to catch up on (so it may skip "
        "drafting altogether).",
    )
    caches_own_drafts: bool = _rule(
        _ANY,
        False,
        "It keeps keys and values of its own drafts that hold only while its own drafts are "
        "accepted (a draft model's cache): another drafter's accepted drafts would make it stale.",
    )
    verifier: Any = _rule(
        _SAME,
        LOSSLESS,
        "What decides each verify pass (speculate/verifiers.py): the lossless verifier, or a "
        "measurement tool's (ForcedAcceptance).",
    )

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The layer ids whose residual streams the target's passes capture for it, or None."""
        return self.target_features if isinstance(self.target_features, tuple) else None

    @classmethod
    def combine(cls, parts: dict[str, Capabilities], owner: str, **own) -> Capabilities:
        """A wrapper's record from its parts' (`parts`: by the names a message calls them): what
        it sets itself (`own`), and for every other field its rule's combination of the parts'
        values. ValueError naming `owner`, the field and the parts where a "same" rule finds them
        disagreeing: such a combination is refused when it is built."""
        values = {}
        for field in dataclasses.fields(cls):
            if field.name in own:
                values[field.name] = own[field.name]
                continue
            rule = field.metadata["combine"]
            got = {name: getattr(caps, field.name) for name, caps in parts.items()}
            if rule in (_SAME, _SAME_GIVEN):
                given = {n: v for n, v in got.items() if v is not None or rule == _SAME}
                distinct = list(dict.fromkeys(given.values()))
                if len(distinct) > 1:
                    shown = ", ".join(f"{name} {value!r}" for name, value in given.items())
                    raise ValueError(
                        f"{owner}: its parts differ in {field.name} ({shown}): {field.metadata['doc']}"
                    )
                values[field.name] = distinct[0] if distinct else None
            elif rule == _ANY:
                values[field.name] = any(got.values())
            elif rule == _ALL:
                values[field.name] = all(got.values())
            else:  # _MAX of the given ones
                given = [v for v in got.values() if v is not None]
                values[field.name] = max(given) if given else None
        return cls(**values)


class ProposerSpec(abc.ABC):
    """The static, hashable part of a proposer for one call (module doc). A subclass is a frozen
    dataclass that supplies `k`, `init`, `propose`, `update`, `state_bytes` and, where it is not
    the default chain drafter's, `capabilities` (a class attribute, or a property of its fields).
    Every other method has a default that is right unless the capabilities say otherwise."""

    k: int  # draft positions: a chain's length, a tree's depth
    capabilities: Capabilities = Capabilities()

    @abc.abstractmethod
    def init(self, ctx: InitContext) -> Any:
        """The state after the prompts (None for a stateless proposer)."""

    @abc.abstractmethod
    def propose(self, ctx: ProposeContext, state) -> tuple[Any, Any]:
        """(Proposal over k positions, or a tree's nodes; the new state)."""

    @abc.abstractmethod
    def update(self, ctx: UpdateContext, state) -> Any:
        """The state after the step's verdict."""

    @abc.abstractmethod
    def state_bytes(self, batch_size: int, capacity: int) -> int:
        """Device memory of the state, for the free-memory check before anything is allocated."""

    # ----- drafting on the steps it is not asked to draft -----------------------------------

    def observe(self, ctx: ProposeContext, state) -> Any:
        """Keep the state current on a step whose drafts are not used (a gated Hybrid's second
        part): by default it drafts and discards; a head overrides it with its cheaper catch-up."""
        return self.propose(ctx, state)[1]

    @property
    def accepts(self) -> int:
        """The most accepted drafts one `update` takes in (`capabilities.accepts`, default k)."""
        accepts = self.capabilities.accepts
        return self.k if accepts is None else accepts

    def accepting(self, K: int) -> ProposerSpec:
        """This spec taking in up to K accepted drafts a step (where `capabilities.catches_up`)."""
        if K <= self.accepts or self.capabilities.stateless:
            return self
        raise ValueError(
            f"{type(self).__name__} drafts k={self.k} and cannot catch up on {K} accepted drafts a "
            "step (its capabilities.catches_up is False)"
        )

    def narrowed(self, k: int) -> ProposerSpec:
        """This spec drafting k tokens over the same state (where `capabilities.narrows`)."""
        raise ValueError(f"{type(self).__name__} cannot draft fewer than its k={self.k} over one state")

    # ----- what a Dynamic proposer decides between steps -------------------------------------

    def needed_width(self, state, running: jax.Array) -> jax.Array:
        """[] the draft width the running rows need at the next step (with `capabilities.widths`)."""
        return jax.numpy.asarray(self.k, jax.numpy.int32)

    def chunk_programs(self) -> tuple[ProposerSpec, ProposerSpec] | None:
        """(drafting, quiet): the specs of a continuous batch's two loop programs, one for chunks in
        which a row may draft, one for those in which none may; None: one program for every chunk."""
        return None

    def may_draft(self, state, running: jax.Array) -> jax.Array:
        """[] whether a running row may draft at the next step (which of `chunk_programs` runs)."""
        return jax.numpy.ones((), bool)

    def ends_chunk(self, state, running: jax.Array) -> jax.Array | None:
        """[] whether a continuous batch's chunk ends before the next step (a program of
        `chunk_programs` that no longer fits); None where chunks end only as the loop's do."""
        return None

    def join(self, batch_state, row_state, running: jax.Array):
        """A row's state (a batch of one, prefilled alone) as it joins a running batch, whose rows
        `running` [B] marks (a schedule that chooses one k for the batch sets the row's to it)."""
        return row_state

    # ----- its params, as the program reads them ----------------------------------------------

    def place_params(self, params, mesh):
        """Its params placed on `mesh` (default: replicated on every device)."""
        return None if params is None else replicate(params, mesh)

    def with_panel_weights(self, params):
        """Its params in the layout of the CPU kernels (a trained head's panels); default as they are."""
        return params

    def stack_layers(self, params):
        """Its params with a draft model's own layers stacked, for a program that scans layers."""
        return params

    # ----- what it reports --------------------------------------------------------------------

    def counters(self, state) -> dict[str, jax.Array] | None:
        """Per-row counts of its own for SpecMetrics.proposer (a Hybrid's per part), or None."""
        return None


class Wrapper(ProposerSpec):
    """A spec around another, `inner` (ForcedSpec, WithNGramSpec): every method of the protocol is
    the inner spec's unless the wrapper overrides it, and methods that return a spec return the
    wrapper around the inner one's (`rewrap`), so nothing of the inner spec is lost. A subclass is
    a frozen dataclass with an `inner` field, and states its own capabilities with
    `Capabilities.combine({"inner": ...}, ...)` where they differ."""

    inner: ProposerSpec

    def rewrap(self, inner: ProposerSpec) -> Wrapper:
        """This wrapper around another inner spec (a narrowed or widened one)."""
        return dataclasses.replace(self, inner=inner)

    @property
    def k(self) -> int:
        return self.inner.k

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def init(self, ctx):
        return self.inner.init(ctx)

    def propose(self, ctx, state):
        return self.inner.propose(ctx, state)

    def update(self, ctx, state):
        return self.inner.update(ctx, state)

    def state_bytes(self, batch_size, capacity):
        return self.inner.state_bytes(batch_size, capacity)

    def observe(self, ctx, state):
        return self.inner.observe(ctx, state)

    @property
    def accepts(self) -> int:
        return self.inner.accepts

    def accepting(self, K):
        inner = self.inner.accepting(K)
        return self if inner is self.inner else self.rewrap(inner)

    def narrowed(self, k):
        return self.rewrap(self.inner.narrowed(k))

    def needed_width(self, state, running):
        return self.inner.needed_width(state, running)

    def chunk_programs(self):
        programs = self.inner.chunk_programs()
        return None if programs is None else tuple(self.rewrap(p) for p in programs)

    def may_draft(self, state, running):
        return self.inner.may_draft(state, running)

    def ends_chunk(self, state, running):
        return self.inner.ends_chunk(state, running)

    def join(self, batch_state, row_state, running):
        return self.inner.join(batch_state, row_state, running)

    def place_params(self, params, mesh):
        return self.inner.place_params(params, mesh)

    def with_panel_weights(self, params):
        return self.inner.with_panel_weights(params)

    def stack_layers(self, params):
        return self.inner.stack_layers(params)

    def counters(self, state):
        return self.inner.counters(state)


class Proposer(abc.ABC):
    """A user-facing proposer: a frozen config that resolves, per call, to a spec and its params.
    A subclass supplies `spec` and, if it has arrays, `params`; `draft_positions` defaults to its
    field `k`."""

    @abc.abstractmethod
    def spec(self, target, warp=None, mesh=None) -> ProposerSpec:
        """The spec for a call with `target` (a Model), the call's WarpSpec and mesh (or None)."""

    def params(self, target):
        """Its arrays for the call (a pytree), or None."""
        return None

    @property
    def draft_positions(self) -> int:
        """The most drafts one step can accept: its k, or its token tree's depth."""
        return self.k

    def with_k(self, k: int) -> Proposer:
        """The same proposer drafting k tokens; a ValueError where its draft length is fixed."""
        raise ValueError(
            f"k={k}: cannot change k of {type(self).__name__}: its draft length is fixed (a Medusa "
            "head's count or a token tree's depth)"
        )

    def parts(self) -> tuple[Proposer, ...]:
        """The proposers it is made of (a wrapper's), for tools that look inside."""
        return ()

    def trained_heads(self) -> tuple:
        """The trained heads it drafts with, its parts' included (Medusa, EAGLE, EAGLE-3, ...)."""
        return tuple(head for part in self.parts() for head in part.trained_heads())


def resolve(proposer, target, warp, mesh=None) -> tuple[ProposerSpec | None, Any]:
    """(spec, params) of a user-facing proposer for a call; (None, None) for plain decoding."""
    if proposer is None:
        return None, None
    if not isinstance(proposer, Proposer):
        raise ValueError(
            "proposer must be None, one of specjax's proposers (NGram, DraftModel, Eagle3, Hybrid, "
            "...) or an instance of a subclass of specjax.Proposer (docs/proposers.md, 'Write your "
            f"own proposer'), got {type(proposer).__name__}"
        )
    spec = proposer.spec(target, warp, mesh)
    if not isinstance(spec, ProposerSpec):
        raise ValueError(
            f"{type(proposer).__name__}.spec() must return a specjax.ProposerSpec, got {type(spec).__name__}"
        )
    return spec, proposer.params(target)
