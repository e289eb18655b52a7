"""Spec-Bench as a library: the prompt subset, the methods, the timed runs and the tables.

`specjax bench` and `benchmarks/spec_bench.py` are thin wrappers over this module:

    prompts = spec_bench_prompts(data_dir(), per_category=2, categories=["qa"])
    methods = make_methods(model, method_descriptions("ngram,eagle", heads="heads", eagle_k=4))
    result = run_spec_bench(model, prompts, methods, max_new_tokens=128, repeats=3)
    print(result.report("markdown"))

The subset is fixed and documented: the first `per_category` questions of each Spec-Bench
category in file order (MT-bench's eight sub-categories count as one, "mt_bench", taken
round-robin), first turn only. Each method generates every prompt at batch 1, greedy, once to
warm up (compile) and then `repeats` times; tokens/s is new tokens over the median wall time of a
whole generate call (prefill included). Speculative outputs are checked against plain greedy
output. The prompt data are read from a folder (`$SPECJAX_DATA`, else `../shared/data` next to
the repository); they are never copied into it.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

DATA_FILE = "spec_bench_question.jsonl"
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}
# A sparse EAGLE tree for SmolLM2: wide at the first draft position, where acceptance is highest,
# then deeper along the best candidates (11 nodes, depth 5).
EAGLE_TREE = (
    (0,),
    (1,),
    (2,),
    (0, 0),
    (0, 1),
    (1, 0),
    (0, 0, 0),
    (0, 0, 1),
    (0, 1, 0),
    (0, 0, 0, 0),
    (0, 0, 0, 0, 0),
)
METHODS = (
    "plain",
    "ngram",
    "selfdraft",
    "medusa",
    "medusa-tree",
    "eagle",
    "eagle-tree",
    "eagle3",
    "eagle3-tree",
    "dflash",
    "hybrid",
    "eagle-k1",
    "eagle3-k1",
    "hybrid-k1",
    "eagle-conf",
    "eagle3-conf",
    "eagle-k1-conf",
    "eagle3-k1-conf",
)
HEAD_FOLDERS = {"medusa": "Medusa", "eagle": "EAGLE", "eagle3": "EAGLE-3", "dflash": "DFlash"}


# ---------------------------------------------------------------------------------------------
# Prompts


def default_data_dir() -> Path:
    """$SPECJAX_DATA, else the `shared/data` folder beside the repository holding this package."""
    return Path(os.environ.get("SPECJAX_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


def data_dir(folder: str | os.PathLike | None = None) -> Path:
    """The folder holding spec_bench_question.jsonl: `folder`, else the default; ValueError naming
    the folder when the file is not there."""
    path = Path(folder) if folder else default_data_dir()
    if not (path / DATA_FILE).is_file():
        raise ValueError(f"no {DATA_FILE} in {path}: pass --data FOLDER or set SPECJAX_DATA")
    return path


def parse_categories(text: str | Sequence[str]) -> list[str]:
    """Categories from "qa,rag" or a list, each checked against SPEC_BENCH_CATEGORIES."""
    names = [c.strip() for c in text.split(",")] if isinstance(text, str) else list(text)
    unknown = [c for c in names if c not in SPEC_BENCH_CATEGORIES]
    if unknown or not names:
        raise ValueError(
            f"--categories: unknown category {unknown[0] if unknown else ''!r}; "
            f"allowed: {', '.join(SPEC_BENCH_CATEGORIES)}"
        )
    return names


def spec_bench_prompts(
    folder: Path, per_category: int, categories: Sequence[str] = SPEC_BENCH_CATEGORIES
) -> list[tuple[str, str]]:
    """(category, first turn) pairs: the first `per_category` questions of each category, in file
    order; MT-bench's eight sub-categories count as one, "mt_bench", taken round-robin over the
    sub-categories."""
    if per_category < 1:
        raise ValueError(f"--per-category must be >= 1, got {per_category}")
    rows = [json.loads(line) for line in (Path(folder) / DATA_FILE).open() if line.strip()]
    chosen = []
    for category in SPEC_BENCH_CATEGORIES:
        if category not in categories:
            continue
        if category == "mt_bench":
            pool = [r for r in rows if r["category"] in MT_BENCH_CATEGORIES]
            pool.sort(
                key=lambda r: (int(r["question_id"]) - 81) % 10 * 100 + (int(r["question_id"]) - 81) // 10
            )
        else:
            pool = [r for r in rows if r["category"] == category]
        chosen += [(category, r["turns"][0]) for r in pool[:per_category]]
    return chosen


def spec_bench_by_category(
    folder: Path, per_category: int, categories: Sequence[str] = SPEC_BENCH_CATEGORIES
) -> dict[str, list[str]]:
    """The same subset as spec_bench_prompts, as {category: [first turns]} (what specjax.ablate
    takes)."""
    grouped: dict[str, list[str]] = {}
    for category, text in spec_bench_prompts(folder, per_category, categories):
        grouped.setdefault(category, []).append(text)
    return grouped


# ---------------------------------------------------------------------------------------------
# The heads' training split: which prompts `make heads` trains on, defined here once


@dataclasses.dataclass(frozen=True)
class HeadsSplit:
    """The prompts a set of heads is distilled from and those held out for evaluating them.
    `make heads` trains with `specjax train-* --split NAME` (so the prompts are read from here),
    each saved head records the split's name in its meta, and the benchmarks read the split from
    here to keep the held-out prompts apart and to mark the cells a head trained on."""

    name: str
    prompts: str  # a JSONL file of the data folder: the training prompts ("turns" field) ...
    exclude: str  # ... less every prompt of this file (the held-out set)
    trained_categories: tuple[str, ...]  # Spec-Bench categories whose questions it trains on

    def files(self, folder: str | os.PathLike | None = None) -> tuple[Path, Path]:
        """(prompts file, held-out file) in `folder` (default: the data folder); ValueError naming
        a missing file."""
        folder = Path(folder) if folder else default_data_dir()
        paths = (folder / self.prompts, folder / self.exclude)
        for path in paths:
            if not path.is_file():
                raise ValueError(f"split {self.name!r}: no {path.name} in {folder}: pass the data folder")
        return paths

    def training_prompts(self, folder: str | os.PathLike | None = None) -> set[str]:
        """The first turns the split's heads were distilled from: its prompts less its held-out set
        (what `specjax train-* --split` trains on)."""
        prompts, exclude = self.files(folder)
        return first_turns(prompts) - first_turns(exclude)

    def trained_on(self, category: str) -> bool:
        """Whether heads of this split were distilled from this category's questions (any other
        prompt set, e.g. HumanEval's, is held out)."""
        return category in self.trained_categories

    def describe(self) -> str:
        return (
            f"split {self.name!r}: {self.prompts} less {self.exclude}, so Spec-Bench's "
            f"{', '.join(self.trained_categories)} questions"
        )


# Spec-Bench's questions except MT-bench's: the committed heads' distillation set (400 prompts).
HEADS_SPLIT = HeadsSplit(
    name="spec-bench-minus-mt-bench",
    prompts=DATA_FILE,
    exclude="mt_bench_question.jsonl",
    trained_categories=tuple(c for c in SPEC_BENCH_CATEGORIES if c != "mt_bench"),
)
SPLITS = {HEADS_SPLIT.name: HEADS_SPLIT}


def first_turns(path: Path) -> set[str]:
    """The first turn ("turns"[0]) of every JSON line of a prompt file."""
    with Path(path).open() as f:
        return {json.loads(line)["turns"][0] for line in f if line.strip()}


def heads_of(proposer) -> list:
    """The trained heads a proposer drafts with (Medusa, EAGLE, EAGLE-3, DFlash; inside a Hybrid or
    Dynamic too)."""
    return [] if proposer is None else list(proposer.trained_heads())


def uses_trained_head(proposer) -> bool:
    """Whether a proposer drafts with a trained head."""
    return bool(heads_of(proposer))


def split_of(head) -> HeadsSplit | None:
    """The named split a head saved by `specjax train-* --split` records in its meta; None for a
    head trained otherwise or published elsewhere (its meta names no split of SPLITS)."""
    return SPLITS.get(head.meta.get("split"))  # (every trained head keeps a meta dict)


def training_of(head) -> str:
    """What a head was distilled from, in words, from its meta."""
    meta = head.meta
    split = split_of(head)
    parts = [split.describe()] if split else []
    if not split and meta.get("prompts_file"):
        parts.append(f"the prompts of {Path(meta['prompts_file']).name}")
    if meta.get("self_instruct_prompts"):
        parts.append(f"{meta['self_instruct_prompts']} chat prompts the target wrote itself")
    return " and ".join(parts) or "prompts its meta does not name"


# ---------------------------------------------------------------------------------------------
# Methods: display name -> proposer description (specjax.named)


def add_method_arguments(parser) -> None:
    """The options that choose and configure the methods (shared by `specjax bench` and
    benchmarks/spec_bench.py)."""
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, of: {', '.join(METHODS)} (plain always runs: speedups are over it)",
    )
    parser.add_argument(
        "--categories",
        default=",".join(SPEC_BENCH_CATEGORIES),
        help=f"comma-separated, of: {', '.join(SPEC_BENCH_CATEGORIES)} (default: all)",
    )
    parser.add_argument(
        "--heads", default="heads", help="folder with medusa/head and eagle/head (`make heads`)"
    )
    parser.add_argument("--ngram-k", type=int, default=5, help="NGram's k (default 5)")
    parser.add_argument(
        "--ngram-n-min",
        type=int,
        default=1,
        help="shortest n-gram NGram drafts from (default 1, NGram's own; 3 drafts only on longer matches)",
    )
    parser.add_argument(
        "--ngram-n-max", type=int, default=4, help="longest n-gram NGram looks for (default 4)"
    )
    parser.add_argument(
        "--self-draft-layers", type=int, default=8, help="layers SelfDraft drafts with (default 8)"
    )
    parser.add_argument("--self-draft-k", type=int, default=3, help="SelfDraft's k (default 3)")
    parser.add_argument("--medusa-tree", default="3,2", help="top-k widths per depth (default 3,2)")
    parser.add_argument("--eagle-k", type=int, default=4, help="the EAGLE chain's k (default 4)")


def parse_widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ValueError(f"--medusa-tree must be comma-separated widths >= 1 (e.g. 3,2), got {text!r}")
    return widths


NGRAM_DEFAULTS = {"n_max": 4, "n_min": 1}  # NGram's own; the display name shows any other value

METHOD_OPTIONS = (
    "methods",
    "heads",
    "ngram_k",
    "ngram_n_min",
    "ngram_n_max",
    "self_draft_layers",
    "self_draft_k",
    "medusa_tree",
    "eagle_k",
)


def method_options(args) -> dict[str, Any]:
    """The `method_descriptions` keywords from the options of `add_method_arguments`."""
    return {name: getattr(args, name) for name in METHOD_OPTIONS}


def method_descriptions(
    methods: str | Sequence[str] = METHODS,
    heads: str | os.PathLike = "heads",
    ngram_k: int = 5,
    ngram_n_min: int = 1,
    ngram_n_max: int = 4,
    self_draft_layers: int = 8,
    self_draft_k: int = 3,
    medusa_tree: str | Sequence[int] = "3,2",
    eagle_k: int = 4,
    confidence_threshold: float = 0.2,
) -> dict[str, Any]:
    """{display name: proposer description, or None for plain} of the named methods ("ngram,eagle"
    or a list, of METHODS); plain comes first. Medusa and EAGLE read the heads saved in
    `heads`/<kind>/head (medusa, eagle, eagle3, dflash); "hybrid" is Hybrid(NGram(k, n_min=3),
    EAGLE-3 chain k), k = eagle_k. "eagle-k1" and "eagle3-k1" are the chains of one draft (what
    pays on a CPU where a head's extra drafts cost more than they are accepted), "hybrid-k1"
    Hybrid(NGram(eagle_k, n_min=3), EAGLE-3 chain of 1). "eagle-conf" and "eagle3-conf" are the
    chains of eagle_k, "eagle-k1-conf" and "eagle3-k1-conf" those of one, verifying only the drafts
    whose path probability under the head reaches `confidence_threshold`. ValueError for an unknown
    method or a missing head."""
    from specjax.speculate.proposers import NGram
    from specjax.speculate.tree import TokenTree

    wanted = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else list(methods)
    unknown = [m for m in wanted if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown method {unknown[0]!r}; allowed: {', '.join(METHODS)}")
    heads = Path(heads)
    needs = {m.removesuffix("-conf").removesuffix("-tree").removesuffix("-k1") for m in wanted}
    needs |= {"eagle3"} if needs & {"hybrid"} else set()
    for kind, folder in HEAD_FOLDERS.items():
        if kind in needs and not (heads / kind / "head").is_dir():
            raise ValueError(f"no {folder} head in {heads / kind / 'head'}: run `make heads` or pass --heads")
    widths = ()
    if "medusa-tree" in wanted:
        widths = parse_widths(medusa_tree) if isinstance(medusa_tree, str) else tuple(medusa_tree)
    medusa, eagle = str(heads / "medusa" / "head"), str(heads / "eagle" / "head")
    eagle3, dflash = str(heads / "eagle3" / "head"), str(heads / "dflash" / "head")
    ngram_options = {"k": ngram_k, "n_max": ngram_n_max, "n_min": ngram_n_min}
    ngram_shown = [f"{n}={v}" for n, v in ngram_options.items() if n == "k" or v != NGRAM_DEFAULTS[n]]
    if "ngram" in wanted:
        NGram(**ngram_options)  # its checks, before any model or data is loaded
    every = {
        "ngram": (f"NGram({', '.join(ngram_shown)})", {"name": "ngram", **ngram_options}),
        "selfdraft": (
            f"SelfDraft(layers={self_draft_layers}, k={self_draft_k})",
            {"name": "self_draft", "layers": self_draft_layers, "k": self_draft_k},
        ),
        "medusa": ("Medusa chain", {"name": "medusa", "head": medusa}),
        "medusa-tree": (
            f"Medusa tree top_k{widths}",
            {"name": "medusa", "head": medusa, "tree": TokenTree.top_k(widths).paths if widths else None},
        ),
        "eagle": (f"EAGLE chain k={eagle_k}", {"name": "eagle", "head": eagle, "k": eagle_k}),
        "eagle-tree": (
            f"EAGLE tree ({len(EAGLE_TREE)} nodes)",
            {"name": "eagle", "head": eagle, "tree": EAGLE_TREE},
        ),
        "eagle3": (f"EAGLE-3 chain k={eagle_k}", {"name": "eagle3", "head": eagle3, "k": eagle_k}),
        "eagle3-tree": (
            f"EAGLE-3 tree ({len(EAGLE_TREE)} nodes)",
            {"name": "eagle3", "head": eagle3, "tree": EAGLE_TREE},
        ),
        "dflash": ("DFlash", {"name": "dflash", "head": dflash}),
        "hybrid": (
            f"Hybrid(NGram k={eagle_k} n_min=3, EAGLE-3)",
            {
                "name": "hybrid",
                "first": {"name": "ngram", "k": eagle_k, "n_min": 3},
                "then": {"name": "eagle3", "head": eagle3, "k": eagle_k},
            },
        ),
        "eagle-k1": ("EAGLE chain k=1", {"name": "eagle", "head": eagle, "k": 1}),
        "eagle3-k1": ("EAGLE-3 chain k=1", {"name": "eagle3", "head": eagle3, "k": 1}),
        "hybrid-k1": (
            f"Hybrid(NGram k={eagle_k} n_min=3, EAGLE-3 k=1)",
            {
                "name": "hybrid",
                "first": {"name": "ngram", "k": eagle_k, "n_min": 3},
                "then": {"name": "eagle3", "head": eagle3, "k": 1},
            },
        ),
    }
    for kind, label, folder in (("eagle", "EAGLE", eagle), ("eagle3", "EAGLE-3", eagle3)):
        for suffix, k in (("", eagle_k), ("-k1", 1)):
            every[f"{kind}{suffix}-conf"] = (
                f"{label} chain k={k}, confidence >= {confidence_threshold}",
                {"name": kind, "head": folder, "k": k, "confidence_threshold": confidence_threshold},
            )
    descriptions: dict[str, Any] = {"plain": None}
    for m in wanted:
        if m != "plain":
            name, description = every[m]
            descriptions[name] = description
    return descriptions


def make_methods(model, descriptions: dict[str, Any]) -> dict[str, Any]:
    """{display name: proposer} from {display name: description} (heads are loaded here, once)."""
    from specjax.named import proposer_from_description

    return {
        name: proposer_from_description(description, model, where=f"method {name!r}")
        for name, description in descriptions.items()
    }


# ---------------------------------------------------------------------------------------------
# Running


@dataclasses.dataclass(frozen=True)
class Tick:
    """One finished generate call, for a progress display."""

    done: int
    total: int
    prompt_index: int  # 0-based
    num_prompts: int
    category: str
    method: str


@dataclasses.dataclass
class SpecBenchResult:
    """Per category and method: tokens/s and mean acceptance length per prompt, and the
    per-position accepted / reached counts summed over the prompts."""

    methods: list[str]  # plain, the speculative methods, then the peers
    speculative: list[str]
    speeds: dict[str, dict[str, list[float]]]  # [category][method] -> tokens/s per prompt
    taus: dict[str, dict[str, list[float]]]  # [category][method] -> mean acceptance length per prompt
    accepted_at: dict[str, dict[str, np.ndarray]]  # [category][method] -> [K]
    reached_at: dict[str, dict[str, np.ndarray]]
    mismatches: list[tuple[str, str]]  # (category, method) whose output differs from plain greedy
    prompts_per_category: int
    max_new_tokens: int
    repeats: int
    chat: bool
    head_methods: list[str] = dataclasses.field(default_factory=list)  # methods drafting with a head
    split: HeadsSplit | None = HEADS_SPLIT  # what those heads trained on; None: not one named split
    head_training: dict[str, str] = dataclasses.field(default_factory=dict)  # head method -> in words
    # [category][method] -> per prompt, (new tokens, seconds of each timed round): the rounds run
    # every method in turn, so a round's ratios share the machine's load of that moment.
    rounds: dict[str, dict[str, list[tuple[int, list[float]]]]] = dataclasses.field(default_factory=dict)

    def round_speedups(self, categories: Sequence[str], method: str) -> list[float]:
        """Per timed round, `method`'s tokens/s over plain's on the prompts of `categories` (all
        their tokens over all their seconds in that round): the spread of these is the run's noise
        for the method's speedup, measured rather than guessed."""

        def rate(name, r):
            runs = [run for c in categories for run in self.rounds[c][name]]
            return sum(n for n, _ in runs) / sum(seconds[r] for _, seconds in runs)

        return [rate(method, r) / rate("plain", r) for r in range(self.repeats)]

    def label(self, category: str) -> str:
        """The category's row label: marked "(trained)" where a head method's cells are prompts its
        head was distilled from."""
        trained = self.head_methods and self.split is not None and self.split.trained_on(category)
        return f"{category} (trained)" if trained else category

    def training_note(self) -> list[str]:
        """What the heads of the head methods trained on, for the Markdown report."""
        if not self.head_methods:
            return []
        names = ", ".join(self.head_methods)
        if self.split is None:
            each = "; ".join(f"{m}: {self.head_training.get(m, 'unknown')}" for m in self.head_methods)
            return [
                f'\nno row is marked "(trained)": the heads do not record one named split ({each}); a row '
                "may hold prompts a head trained on."
            ]
        training = "; ".join(sorted(set(self.head_training.values()))) or self.split.describe()
        if any(self.split.trained_on(c) for c in self.speeds):
            return [
                f"\n(trained): {names} drafted from heads distilled from these very questions "
                f"({training}); only the other rows are held out."
            ]
        return [f"\n{names} drafted from heads distilled from {training}: every row here is held out."]

    def table(self) -> tuple[list[str], list[list]]:
        """(header, rows): per category, tokens/s of every method, speedup over plain, tau."""
        names, spec = self.methods, self.speculative
        header = ["category"] + [f"{n} tok/s" for n in names] + [f"{n} speedup" for n in names[1:]]
        header += [f"{n} tau" for n in spec]
        rows = []
        for category, by_method in self.speeds.items():
            speed = {n: statistics.mean(by_method[n]) for n in names}
            tau = [statistics.mean(self.taus[category][n]) for n in spec]
            rows.append(
                [self.label(category)]
                + [speed[n] for n in names]
                + [speed[n] / speed["plain"] for n in names[1:]]
                + tau
            )
        return header, rows

    def conditional_acceptance(self, category: str, method: str) -> np.ndarray:
        """[K] accepted at position i among the drafts that reached it (EAGLE's definition)."""
        accepted, reached = self.accepted_at[category][method], self.reached_at[category][method]
        return np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan)

    def position_table(self) -> tuple[list[str], list[list]]:
        rows = [
            [
                self.label(category),
                name,
                " ".join(f"{r:.2f}" for r in self.conditional_acceptance(category, name)),
            ]
            for category, by_method in self.accepted_at.items()
            for name in by_method
        ]
        return ["category", "method", "position 1, 2, ..."], rows

    def report(self, format: str = "markdown") -> str:
        """The whole report: a Markdown page (notes, the table, per-position acceptance, mismatches)
        or one CSV table (the main table plus a column of per-position acceptance per method)."""
        if format == "csv":
            header, rows = self.table()
            header = header + [f"{n} conditional acceptance per position" for n in self.speculative]
            rows = [
                row
                + [
                    " ".join(f"{r:.4f}" for r in self.conditional_acceptance(category, n))
                    for n in self.speculative
                ]
                for row, category in zip(rows, self.speeds, strict=True)
            ]
            return csv_table(header, rows)
        if format != "markdown":
            raise ValueError(f"--format must be markdown or csv, got {format!r}")
        chat = "chat template" if self.chat else "no chat template"
        lines = [
            f"machine: {machine()}",
            f"batch 1, greedy, {chat}, {self.max_new_tokens} new tokens, {self.prompts_per_category} "
            f"prompts per category, median of {self.repeats}; speedup is over specjax plain decoding; "
            "tau = mean acceptance length (1 + accepted drafts per step that drafted, vLLM's definition)\n",
            markdown_table(*self.table()),
            *self.training_note(),
            "\nconditional acceptance per draft position (accepted / reached), summed over the prompts:\n",
            markdown_table(*self.position_table()),
            f"\nspeculative outputs that differ from plain greedy: {self.mismatches or 'none'}",
        ]
        return "\n".join(lines)


def num_calls(num_prompts: int, num_methods: int, repeats: int) -> int:
    """Generate calls of a run: a warm-up and `repeats` timed calls per prompt and method."""
    return num_prompts * num_methods * (1 + repeats)


def run_spec_bench(
    model,
    prompts: Sequence[tuple[str, str]],
    methods: dict[str, Any],
    *,
    max_new_tokens: int = 128,
    repeats: int = 3,
    chat: bool = True,
    peers: dict[str, Callable[[list[int]], int]] | None = None,
    progress: Callable[[Tick], None] | None = None,
) -> SpecBenchResult:
    """Run every method (`methods`: display name -> proposer, "plain" -> None first) and every
    peer (display name -> a function of the prompt's token ids that generates and returns the
    number of new tokens, e.g. HF transformers or llama.cpp) on every (category, prompt) pair,
    timed the same way and in the same rounds (`interleaved`). `progress` is called after every
    generate call."""
    import specjax

    if not prompts:
        raise ValueError("no prompts to run: check --categories and --per-category")
    if next(iter(methods), None) != "plain" or methods["plain"] is not None:
        raise ValueError("methods must start with 'plain': None (the speedups are over it)")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    peers = peers or {}
    total = num_calls(len(prompts), len(methods) + len(peers), repeats)
    done = 0
    speeds: dict = {}
    taus: dict = {}
    accepted_at: dict = {}
    reached_at: dict = {}
    mismatches = []

    rounds: dict = {}

    def interleaved(calls: dict[str, Callable[[], Any]], category, index) -> dict[str, tuple[Any, list]]:
        """{name: (the warm-up call's output, seconds of each of `repeats` timed calls)}: every call
        warmed up first, then `repeats` rounds that run each in turn, so that the machine's load
        at any moment falls on every method alike; progress is reported outside the timed spans.
        The peers run in the same rounds as specjax's methods: this machine's speed drifts by up
        to a third over tens of seconds (the same float32 program decoding 95, then 79, then 70
        tokens/s within a minute, 2026-11-29), so a peer timed after all of specjax's calls met
        another machine."""

        def tick(name):
            nonlocal done
            done += 1
            if progress is not None:
                progress(Tick(done, total, index, len(prompts), category, name))

        out = {}
        for name, fn in calls.items():
            out[name] = (fn(), [])
            tick(name)
        for _ in range(repeats):
            for name, fn in calls.items():
                start = time.perf_counter()
                fn()
                out[name][1].append(time.perf_counter() - start)
                tick(name)
        return out

    def record(category, name, n_new, seconds):
        speeds.setdefault(category, {}).setdefault(name, []).append(n_new / statistics.median(seconds))
        rounds.setdefault(category, {}).setdefault(name, []).append((n_new, seconds))

    for index, (category, text) in enumerate(prompts):
        calls = {
            name: functools.partial(
                specjax.generate, model, [text], proposer=proposer, max_new_tokens=max_new_tokens, chat=chat
            )
            for name, proposer in methods.items()
        }
        prompt_ids: list[int] = []  # plain's, which the peers generate from

        def plain_call(generate=calls["plain"], ids=prompt_ids):
            out = generate()
            ids[:] = out.prompt_tokens[0]
            return out

        calls["plain"] = plain_call  # (warmed up first, so the peers' calls find the ids)
        calls |= {name: functools.partial(peer, prompt_ids) for name, peer in peers.items()}
        timed = interleaved(calls, category, index)
        plain = timed["plain"][0]
        for name, proposer in methods.items():
            warm, seconds = timed[name]
            if proposer is not None and warm.tokens[0] != plain.tokens[0]:
                mismatches.append((category, name))
            record(category, name, len(warm.tokens[0]), seconds)
            tau = warm.metrics.mean_acceptance_length if proposer is not None else 1.0
            taus.setdefault(category, {}).setdefault(name, []).append(tau)
            if proposer is not None:
                m = warm.metrics
                by_method = accepted_at.setdefault(category, {})
                by_method[name] = by_method.get(name, 0) + m.accepted_at.sum(0)
                by_method = reached_at.setdefault(category, {})
                by_method[name] = by_method.get(name, 0) + m.reached_at.sum(0)
        for name in peers:
            n_new, seconds = timed[name]
            record(category, name, n_new, seconds)

    counts = [sum(1 for c, _ in prompts if c == category) for category in speeds]
    heads = {name: found for name, proposer in methods.items() if (found := heads_of(proposer))}
    splits = {split_of(head) for found in heads.values() for head in found}  # {HEADS_SPLIT} for make heads
    return SpecBenchResult(
        head_methods=list(heads),
        split=splits.pop() if len(splits) == 1 else None,
        head_training={name: "; ".join(training_of(h) for h in found) for name, found in heads.items()},
        methods=list(methods) + list(peers),
        speculative=list(methods)[1:],
        speeds=speeds,
        taus=taus,
        accepted_at=accepted_at,
        reached_at=reached_at,
        mismatches=mismatches,
        rounds=rounds,
        prompts_per_category=max(counts),
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        chat=chat,
    )


# ---------------------------------------------------------------------------------------------
# Timing and tables


def machine() -> str:
    import jax

    cpu = platform.processor() or platform.machine()
    return (
        f"{cpu}{_vector_units()}, {os.cpu_count()} cores, python {platform.python_version()}, "
        f"jax {jax.__version__} ({jax.default_backend()}, {jax.device_count()} device(s))"
    )


def _vector_units() -> str:
    """The CPU's widest vectors for machine(): ", AVX-512" or ", AVX2" where Linux reports its
    flags (else nothing). The CPU kernels are built for the machine's vectors (16 floats with
    AVX-512, 8 with AVX2), and a product of several rows runs up to twice as fast with the wider
    ones, so a benchmark's numbers name them."""
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        ).split()
    except OSError:
        return ""
    return ", AVX-512" if "avx512f" in flags else ", AVX2" if "avx2" in flags else ""


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cell(x) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(_cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def csv_table(header: list[str], rows: list[list]) -> str:
    """CSV with full-precision numbers (the Markdown table rounds to two decimals)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([[repr(float(x)) if isinstance(x, float) else x for x in row] for row in rows])
    return out.getvalue()
