"""Proposers by name, for the command line, sweep files and Spec-Bench methods (host side: a
description may name a model or a head to load by path).

A proposer description is a name plus options, e.g. ``{"name": "ngram", "k": 4}`` or
``{"name": "eagle", "head": "heads/eagle/head", "tree": [[0], [1], [0, 0]]}``; a name alone may be
given as a string ("ngram"). The names, their options and what each option reads are the
proposers' registry (specjax/speculate/proposers/registry.py; docs/proposers.md lists them):

    plain, ngram, self_draft, draft_model, medusa, eagle, eagle3, dflash, mlp_speculator, mtp,
    with_ngram (proposer, ngram), hybrid (first, then, gate), forced (acceptance, proposer, k),
    dynamic (proposer, schedule)

A head option is the folder of a saved or published head, loaded against the target; a model
option a built-in name, an HF folder or a .gguf file; a proposer option another description; a
schedule "heuristic", "goodput" or {"name": "goodput", "draft_cost": 0.08, ...}.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.models import Model, load, load_head
from specjax.speculate.proposers import GoodputSchedule, HeuristicSchedule, NGram, with_k
from specjax.speculate.proposers.registry import (
    BY_NAME,
    ENTRIES,
    HEAD,
    LAYERS,
    MODEL,
    NGRAM,
    PROPOSER,
    SCHEDULE,
    TREE,
    Entry,
)

PROPOSER_NAMES = tuple(entry.name for entry in ENTRIES)
SCHEDULES = {"heuristic": HeuristicSchedule, "goodput": GoodputSchedule}
SCHEDULE_NAMES = tuple(SCHEDULES)


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
    schedule = SCHEDULES[description["name"]]
    return schedule(**_options(description, tuple(f.name for f in dataclasses.fields(schedule)), where))


def proposer_from_description(description: Any, target: Model | None = None, where: str = "proposer"):
    """The proposer a description names (None for "plain"); `target` is needed only to check a
    loaded head or draft model against it (heads are checked again when generating)."""
    if description is None:
        return None
    if isinstance(description, str):
        description = {"name": description}
    if not isinstance(description, dict) or description.get("name") not in BY_NAME:
        raise ValueError(
            f"{where} must name one of {', '.join(PROPOSER_NAMES)} (e.g. {{'name': 'ngram', 'k': 4}}), "
            f"got {description!r}"
        )
    entry = BY_NAME[description["name"]]
    given = _options(description, tuple(option.name for option in entry.options), where)
    if entry.proposer is None:  # plain decoding
        return None
    arguments = {}
    for option in entry.options:
        if option.name not in given and option.needed is not None:
            raise ValueError(f"{where}: {entry.name} needs {option.name!r} ({option.needed})")
        value = given.get(option.name, option.default)
        if option.name in given or option.default is not None:
            arguments[option.name] = _read(entry, option.kind, value, target, f"{where}.{option.name}")
    return entry.proposer(**arguments)


def _read(entry: Entry, kind: str, value, target: Model | None, where: str):
    """An option's value as the proposer takes it (registry.py's kinds)."""
    if value is None:
        return None
    if kind == TREE:
        return [tuple(path) for path in value]
    if kind == LAYERS:
        return tuple(value) if isinstance(value, list) else value
    if kind == HEAD:
        if target is None:
            raise ValueError(f"{where}: loading a {entry.name} head needs the target model")
        return load_head(value, target)
    if kind == MODEL:
        return load(value)
    if kind == PROPOSER:
        return proposer_from_description(value, target, where)
    if kind == NGRAM:
        ngram = proposer_from_description(value, target, where)
        if not isinstance(ngram, NGram):
            raise ValueError(f"{where} must describe an ngram proposer, got {value!r}")
        return ngram
    if kind == SCHEDULE:
        return schedule_from_description(value, where)
    return value


__all__ = [
    "PROPOSER_NAMES",
    "SCHEDULE_NAMES",
    "proposer_from_description",
    "schedule_from_description",
    "with_k",  # lives with the proposers (specjax.speculate.proposers); here for the callers of names
]
