"""Proposers by name, for the command line, sweep files and Spec-Bench methods (host side: a
description may name a model or a head to load by path).

A proposer description is a name plus options, e.g. ``{"name": "ngram", "k": 4}`` or
``{"name": "eagle", "head": "heads/eagle/head", "tree": [[0], [1], [0, 0]]}``. Names:

    plain                   no proposer (plain decoding)
    ngram                   NGram(k, n_max, n_min)
    self_draft              SelfDraft(layers, k)
    draft_model             DraftModel(model=<name or path, loaded>, k)
    medusa                  Medusa(head=<folder of a saved head>, tree)
    eagle                   Eagle(head=<folder of a saved head>, k, tree, confidence_threshold)
    eagle3                  Eagle3(head=<folder: a saved or published EAGLE-3 head>, k, tree,
                            confidence_threshold)
    dflash                  DFlash(head=<folder: a saved or published DFlash head>, block)
    mlp_speculator          MLPSpeculator(head=<folder: a published or saved MLP speculator>, k)
    mtp                     MTP(k, layers, tree, confidence_threshold): the target's own MTP layers
    with_ngram              WithNGram(proposer=<description>, ngram=<an ngram description>)
    hybrid                  Hybrid(first=<description>, then=<description>, gate=<None or a goodput
                            schedule: {"name": "goodput", "draft_cost": 0.08, "verify_cost": 0.14}>)
    forced                  ForcedAcceptance(acceptance, proposer=<description or None>, k)
    dynamic                 Dynamic(proposer=<description>, schedule=<"heuristic", "goodput" or a
                            description: {"name": "goodput", "draft_cost": 0.2, ...}>)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.models import Model, load, load_head
from specjax.speculate.proposers import (
    MTP,
    DFlash,
    DraftModel,
    Dynamic,
    Eagle,
    Eagle3,
    ForcedAcceptance,
    GoodputSchedule,
    HeuristicSchedule,
    Hybrid,
    Medusa,
    MLPSpeculator,
    NGram,
    SelfDraft,
    WithNGram,
    with_k,
)

PROPOSER_NAMES = (
    "plain",
    "ngram",
    "self_draft",
    "draft_model",
    "medusa",
    "eagle",
    "eagle3",
    "dflash",
    "mlp_speculator",
    "mtp",
    "with_ngram",
    "hybrid",
    "forced",
    "dynamic",
)
HEAD_PROPOSERS = {  # name -> (class, options beside the head)
    "medusa": (Medusa, ("tree",)),
    "eagle": (Eagle, ("k", "tree", "confidence_threshold")),
    "eagle3": (Eagle3, ("k", "tree", "confidence_threshold")),
    "dflash": (DFlash, ("block",)),
    "mlp_speculator": (MLPSpeculator, ("k",)),
}
SCHEDULE_NAMES = ("heuristic", "goodput")


def _options(description: dict, allowed: tuple[str, ...], where: str) -> dict:
    options = {key: value for key, value in description.items() if key != "name"}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"{where}: unknown option {unknown[0]!r} for {description['name']!r}; allowed: "
            f"{', '.join(allowed) or 'none'}"
        )
    return options


def schedule_from_description(description: Any, where: str = "schedule"):
    """A HeuristicSchedule or GoodputSchedule from "heuristic", "goodput" or {"name": ..., ...}."""
    if isinstance(description, str):
        description = {"name": description}
    if not isinstance(description, dict) or description.get("name") not in SCHEDULE_NAMES:
        raise ValueError(
            f"{where} must be one of {', '.join(SCHEDULE_NAMES)} (or a dict with that name), "
            f"got {description!r}"
        )
    schedule = {"heuristic": HeuristicSchedule, "goodput": GoodputSchedule}[description["name"]]
    return schedule(**_options(description, tuple(f.name for f in dataclasses.fields(schedule)), where))


def proposer_from_description(description: Any, target: Model | None = None, where: str = "proposer"):
    """The proposer a description names (None for "plain"); `target` is needed only to check a
    loaded head or draft model against it (heads are checked again when generating)."""
    if description is None:
        return None
    if isinstance(description, str):
        description = {"name": description}
    if not isinstance(description, dict) or description.get("name") not in PROPOSER_NAMES:
        raise ValueError(
            f"{where} must name one of {', '.join(PROPOSER_NAMES)} (e.g. {{'name': 'ngram', 'k': 4}}), "
            f"got {description!r}"
        )
    name = description["name"]
    if name == "plain":
        _options(description, (), where)
        return None
    if name == "ngram":
        return NGram(**_options(description, ("k", "n_max", "n_min"), where))
    if name == "self_draft":
        return SelfDraft(**_options(description, ("layers", "k"), where))
    if name == "draft_model":
        options = _options(description, ("model", "k"), where)
        if "model" not in options:
            raise ValueError(f"{where}: draft_model needs 'model' (a built-in name, HF folder or .gguf file)")
        return DraftModel(load(options.pop("model")), **options)
    if name in HEAD_PROPOSERS:
        proposer, allowed = HEAD_PROPOSERS[name]
        options = _options(description, ("head", *allowed), where)
        if "head" not in options:
            raise ValueError(f"{where}: {name} needs 'head' (the folder of a saved or published head)")
        if target is None:
            raise ValueError(f"{where}: loading a {name} head needs the target model")
        head = load_head(options.pop("head"), target)
        if options.get("tree") is not None:
            options["tree"] = [tuple(path) for path in options["tree"]]
        return proposer(head, **options)
    if name == "mtp":
        options = _options(description, ("k", "layers", "tree", "confidence_threshold"), where)
        if isinstance(options.get("layers"), list):
            options["layers"] = tuple(options["layers"])
        if options.get("tree") is not None:
            options["tree"] = [tuple(path) for path in options["tree"]]
        return MTP(**options)
    if name == "with_ngram":
        options = _options(description, ("proposer", "ngram"), where)
        if "proposer" not in options:
            raise ValueError(
                f"{where}: with_ngram needs 'proposer' (the model part, e.g. {{'name': 'mtp', 'k': 1}})"
            )
        inner = proposer_from_description(options["proposer"], target, f"{where}.proposer")
        ngram = proposer_from_description(
            options.get("ngram", {"name": "ngram", "k": 2}), target, f"{where}.ngram"
        )
        if not isinstance(ngram, NGram):
            raise ValueError(f"{where}.ngram must describe an ngram proposer, got {options['ngram']!r}")
        return WithNGram(inner, ngram)
    if name == "hybrid":
        options = _options(description, ("first", "then", "gate"), where)
        if not {"first", "then"} <= set(options):
            raise ValueError(f"{where}: hybrid needs 'first' and 'then' (two proposer descriptions)")
        parts = {k: proposer_from_description(options[k], target, f"{where}.{k}") for k in ("first", "then")}
        gate = options.get("gate")
        if gate is not None:
            gate = schedule_from_description(gate, f"{where}.gate")
        return Hybrid(parts["first"], parts["then"], gate=gate)
    if name == "forced":
        options = _options(description, ("acceptance", "proposer", "k"), where)
        inner = proposer_from_description(options.pop("proposer", None), target, f"{where}.proposer")
        return ForcedAcceptance(proposer=inner, **options)
    options = _options(description, ("proposer", "schedule"), where)  # dynamic
    if "proposer" not in options:
        raise ValueError(f"{where}: dynamic needs 'proposer' (the proposer whose k it schedules)")
    inner = proposer_from_description(options["proposer"], target, f"{where}.proposer")
    schedule = schedule_from_description(options.get("schedule", "heuristic"), f"{where}.schedule")
    return Dynamic(inner, schedule)


__all__ = [
    "PROPOSER_NAMES",
    "SCHEDULE_NAMES",
    "proposer_from_description",
    "schedule_from_description",
    "with_k",  # lives with the proposers (specjax.speculate.proposers); here for the callers of names
]
