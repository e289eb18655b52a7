"""Every proposer by name: one entry each, read by the proposer descriptions of the command line,
sweep files and benchmarks (specjax/named.py), by the server's `--speculative-config`
(specjax/serve/config.py: the methods of vLLM and FastDeploy) and by the docs (docs/proposers.md's
table, checked against this one by the tests).

A new proposer is its own file in this folder and one `Entry` below: its name, its class, a
line for the docs, the options a description may give (with how each value is read) and, where
vLLM or FastDeploy have a method for it, how that method's keys make it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from specjax.checks import check_int
from specjax.speculate.proposers.dflash import DFlash
from specjax.speculate.proposers.draft import DraftModel, SelfDraft
from specjax.speculate.proposers.dynamic import Dynamic
from specjax.speculate.proposers.eagle import Eagle
from specjax.speculate.proposers.eagle3 import Eagle3
from specjax.speculate.proposers.forced import ForcedAcceptance
from specjax.speculate.proposers.grammar_draft import GrammarDraft
from specjax.speculate.proposers.hybrid import Hybrid
from specjax.speculate.proposers.medusa import Medusa
from specjax.speculate.proposers.mlp_speculator import MLPSpeculator
from specjax.speculate.proposers.mtp import MTP
from specjax.speculate.proposers.ngram import NGram
from specjax.speculate.proposers.with_ngram import WithNGram
from specjax.speculate.tree import MAX_SPECULATIVE_TOKENS, TokenTree

# How a description's option value becomes the proposer's argument (specjax/named.py reads them).
VALUE = "value"  # as it is
TREE = "tree"  # a list of paths (lists of ranks) -> tuples
LAYERS = "layers"  # a list of layer indices -> a tuple
HEAD = "head"  # the folder of a saved or published head, loaded against the target
MODEL = "model"  # a built-in name, an HF folder or a .gguf file, loaded
PROPOSER = "proposer"  # a nested proposer description
NGRAM = "ngram"  # a nested description of an ngram proposer
SCHEDULE = "schedule"  # "heuristic", "goodput" or a schedule description


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a proposer description."""

    name: str  # the description's key, which is the proposer's argument
    kind: str = VALUE  # how its value is read (the kinds above)
    needed: str | None = None  # what it is, in words, where a description must give it
    default: Any = None  # a description's value where it gives none (None: the proposer's own default)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One proposer: its description name, class, docs line and options, and where vLLM's and
    FastDeploy's `--speculative-config` has a method for it, that method's keys and how they make
    the proposer (`speculative_config(options, target) -> proposer`, options the config's keys
    but "method", already checked to be among `method_keys`)."""

    name: str
    proposer: type | None  # None for "plain"
    summary: str
    options: tuple[Option, ...] = ()
    method: str | None = None
    method_keys: tuple[str, ...] = ()
    speculative_config: Callable[[dict, Any], Any] | None = None


# ----- vLLM's and FastDeploy's keys ---------------------------------------------------------------

WHERE = "speculative_config"  # how errors name the server's option


def method_int(options: dict, key: str, low: int, high: int | None = None) -> int | None:
    """options[key] checked to be an integer in [low, high] (None when absent)."""
    value = options.get(key)
    return None if value is None else check_int(f"{WHERE}: {key!r}", value, low, high)


def method_required(options: dict, key: str, method: str, what: str) -> Any:
    if key not in options:
        raise ValueError(f"{WHERE}: method {method!r} needs {key!r} ({what})")
    return options[key]


def method_k(options: dict) -> dict:
    """{"k": num_speculative_tokens} when given, else {} (the proposer's own default k)."""
    k = method_int(options, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    return {} if k is None else {"k": k}


def _ngram_method(options: dict, target) -> NGram:
    lookup = {"n_max": "prompt_lookup_max", "n_min": "prompt_lookup_min"}
    sizes = {name: method_int(options, key, 1) for name, key in lookup.items() if key in options}
    if sizes.get("n_min", 1) > sizes.get("n_max", NGram.n_max):
        raise ValueError(
            f"{WHERE}: prompt_lookup_min ({sizes['n_min']}) must not exceed prompt_lookup_max "
            f"({sizes.get('n_max', NGram.n_max)}{'' if 'n_max' in sizes else ', the default'})"
        )
    return NGram(**method_k(options), **sizes)


def _draft_model_method(options: dict, target) -> DraftModel:
    from specjax.models import load

    source = method_required(options, "model", "draft_model", "a built-in name, an HF folder or a .gguf file")
    # vLLM's draft_tensor_parallel_size: 1 replicates the draft on every device of a model group;
    # the target's tensor-parallel size splits it as the target (serve checks it is that size)
    split = method_int(options, "draft_tensor_parallel_size", 1)
    tensor_parallel = split is not None and split > 1
    model = load(source, dtype=target.params.dtype.name)
    return DraftModel(model, **method_k(options), tensor_parallel=tensor_parallel)


def _self_draft_method(options: dict, target) -> SelfDraft:
    method_required(options, "layers", "self_draft", "how many of the target's first layers draft")
    return SelfDraft(layers=method_int(options, "layers", 1), **method_k(options))


def _head(options: dict, method: str, target):
    from specjax.models import load_head

    path = method_required(options, "model", method, "the folder of a saved or published head")
    if not isinstance(path, str):
        raise ValueError(f"{WHERE}: 'model' must be a path (a string), got {path!r}")
    return load_head(path, target)


def _head_method(proposer: type, method: str) -> Callable[[dict, Any], Any]:
    def make(options: dict, target):
        return proposer(_head(options, method, target), **method_k(options))

    return make


def _medusa_method(options: dict, target) -> Medusa:
    """One draft per head: k takes the first k heads as a chain."""
    head = _head(options, "medusa", target)
    k = method_k(options).get("k")
    if k is None:
        return Medusa(head)
    if k > head.config.num_heads:
        raise ValueError(
            f"{WHERE}: 'num_speculative_tokens' of this Medusa head must be in "
            f"1..{head.config.num_heads} (one draft per head), got {k}"
        )
    return Medusa(head, tree=TokenTree.chain(k))


def _dflash_method(options: dict, target) -> DFlash:
    """One forward drafts a block: the anchor and k drafts."""
    head = _head(options, "dflash", target)
    k = method_k(options).get("k")
    return DFlash(head) if k is None else DFlash(head, block=k + 1)


def _mtp_method(options: dict, target):
    """The target's own multi-token-prediction layers (DeepSeek-V3, GLM-4.5): specjax.MTP, with
    FastDeploy's keys: `num_model_steps` (the MTP layers' drafts) and `mtp_strategy`: "default"
    (the MTP layers draft all num_speculative_tokens; num_model_steps equal to it when given) or
    "with_ngram" (specjax.WithNGram: the MTP layers draft num_model_steps, default 1, and prompt
    lookup extends the chain to num_speculative_tokens)."""
    strategy = options.get("mtp_strategy", "default")
    if strategy not in ("default", "with_ngram"):
        raise ValueError(
            f"{WHERE}: mtp_strategy {strategy!r} is not supported; allowed: 'default', 'with_ngram'"
        )
    k = method_k(options).get("k")
    steps = method_int(options, "num_model_steps", 1, MAX_SPECULATIVE_TOKENS)
    if strategy == "with_ngram":
        steps = 1 if steps is None else steps
        if k is None or k <= steps:
            raise ValueError(
                f"{WHERE}: mtp_strategy 'with_ngram' needs num_speculative_tokens greater than "
                f"num_model_steps ({steps}): the lookup drafts the rest, got {k}"
            )
        return WithNGram(MTP(k=steps), NGram(k=k - steps))
    if steps is not None and k is not None and steps != k:
        raise ValueError(
            f"{WHERE}: num_model_steps={steps} differs from num_speculative_tokens={k}; with "
            "mtp_strategy 'default' the MTP layers draft them all: give equal values, one of them, or "
            "mtp_strategy 'with_ngram'"
        )
    k = steps if k is None else k
    return MTP() if k is None else MTP(k=k)


_K = ("num_speculative_tokens",)
_HEAD_KEYS = ("model", "num_speculative_tokens")
_NEEDS_HEAD = "the folder of a saved or published head"
# An EAGLE or EAGLE-3 head's options: its folder, and a chain of k or a tree, with a threshold
_HEAD_CHAIN_OR_TREE = (
    Option("head", HEAD, _NEEDS_HEAD),
    Option("k"),
    Option("tree", TREE),
    Option("confidence_threshold"),
)

# In the order the docs and messages list them: vLLM's and FastDeploy's methods first, in their
# order, then specjax's own.
ENTRIES: tuple[Entry, ...] = (
    Entry("plain", None, "no proposer: plain decoding, the baseline"),
    Entry(
        "ngram",
        NGram,
        "prompt lookup: the continuation of the longest earlier n-gram match, on the device",
        (Option("k"), Option("n_max"), Option("n_min")),
        method="ngram",
        method_keys=(*_K, "prompt_lookup_max", "prompt_lookup_min"),
        speculative_config=_ngram_method,
    ),
    Entry(
        "draft_model",
        DraftModel,
        "a separate small model with the target's vocabulary",
        (Option("model", MODEL, "a built-in name, HF folder or .gguf file"), Option("k")),
        method="draft_model",
        method_keys=(*_HEAD_KEYS, "draft_tensor_parallel_size"),
        speculative_config=_draft_model_method,
    ),
    Entry(
        "eagle",
        Eagle,
        "an EAGLE head: a chain or tree in the target's feature space",
        _HEAD_CHAIN_OR_TREE,
        method="eagle",
        method_keys=_HEAD_KEYS,
        speculative_config=_head_method(Eagle, "eagle"),
    ),
    Entry(
        "eagle3",
        Eagle3,
        "an EAGLE-3 head: the target's low, middle and high features fused, a draft vocabulary",
        _HEAD_CHAIN_OR_TREE,
        method="eagle3",
        method_keys=_HEAD_KEYS,
        speculative_config=_head_method(Eagle3, "eagle3"),
    ),
    Entry(
        "medusa",
        Medusa,
        "Medusa heads: a token tree from the target's last hidden state",
        (Option("head", HEAD, _NEEDS_HEAD), Option("tree", TREE)),
        method="medusa",
        method_keys=_HEAD_KEYS,
        speculative_config=_medusa_method,
    ),
    Entry(
        "dflash",
        DFlash,
        "a DFlash block drafter: one forward pass drafts the whole block",
        (Option("head", HEAD, _NEEDS_HEAD), Option("block")),
        method="dflash",
        method_keys=_HEAD_KEYS,
        speculative_config=_dflash_method,
    ),
    Entry(
        "mlp_speculator",
        MLPSpeculator,
        "IBM's MLP speculator: one stage per draft, from the target's last hidden state",
        (Option("head", HEAD, _NEEDS_HEAD), Option("k")),
        method="mlp_speculator",
        method_keys=_HEAD_KEYS,
        speculative_config=_head_method(MLPSpeculator, "mlp_speculator"),
    ),
    Entry(
        "mtp",
        MTP,
        "the target's own multi-token-prediction layers (DeepSeek-V3, GLM-4.5)",
        (Option("k"), Option("layers", LAYERS), Option("tree", TREE), Option("confidence_threshold")),
        method="mtp",
        method_keys=(*_K, "num_model_steps", "mtp_strategy"),
        speculative_config=_mtp_method,
    ),
    Entry(
        "self_draft",
        SelfDraft,
        "early exit: the target's first layers, its final norm and its head",
        (Option("layers"), Option("k")),
        method="self_draft",
        method_keys=("layers", *_K),
        speculative_config=_self_draft_method,
    ),
    Entry(
        "with_ngram",
        WithNGram,
        "FastDeploy's with_ngram: a model's drafts, extended by prompt lookup",
        (
            Option("proposer", PROPOSER, "the model part, e.g. {'name': 'mtp', 'k': 1}"),
            Option("ngram", NGRAM, default={"name": "ngram", "k": 2}),
        ),
    ),
    Entry(
        "hybrid",
        Hybrid,
        "per row, the first proposer's drafts where it has any, else the second's",
        (
            Option("first", PROPOSER, "a proposer description"),
            Option("then", PROPOSER, "a proposer description"),
            Option("gate", SCHEDULE),
        ),
    ),
    Entry(
        "forced",
        ForcedAcceptance,
        "forced acceptance rates: a measurement tool, never lossless",
        (Option("acceptance"), Option("proposer", PROPOSER), Option("k")),
    ),
    Entry(
        "dynamic",
        Dynamic,
        "a per-row k chosen by a schedule (heuristic or goodput)",
        (
            Option("proposer", PROPOSER, "the proposer whose k it schedules"),
            Option("schedule", SCHEDULE, default="heuristic"),
        ),
    ),
    Entry(
        "grammar",
        GrammarDraft,
        "the tokens a row's constraint (regex, json_schema, choice) forces, drafted for free",
        (Option("k"),),
    ),
)
BY_NAME: dict[str, Entry] = {entry.name: entry for entry in ENTRIES}
BY_METHOD: dict[str, Entry] = {entry.method: entry for entry in ENTRIES if entry.method is not None}
