"""The distillation pipeline: what `specjax train-*` runs, callable from Python.

    options = specjax.train.TrainingOptions(prompts=["Write a haiku about JAX.", ...], out="run")
    head = specjax.train.train_head(model, "eagle3", options, unroll=3)
    result = specjax.generate(model, prompts, proposer=specjax.Eagle3(head, k=4))

One run reads the training prompts (a JSONL file, a named split of specjax.bench.SPLITS or a
list) less every held-out prompt, adds prompts the model writes itself (`self_instruct`),
generates the model's greedy continuations of them and its hidden states along them (the
distillation set, kept in the `data` file when one is named, so that one set trains every head),
trains the head and saves it to `out`/head, with the training checkpoints in `out`/checkpoints
(a rerun resumes from the latest). Each step is a function of its own: `training_prompts`,
`continuations`, `distillation_set`.

Errors are `OptionError`s (a ValueError) that name the option: as TrainingOptions' field in
Python (`draft_vocab must be in 1..97 ...`), as the command's flag on the command line
(`--draft-vocab must be in 1..97 ...`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from specjax.api import generate, load
from specjax.bench import SPLITS
from specjax.checks import is_int
from specjax.models import Model
from specjax.models.heads import save_head
from specjax.train.data import DistillationData, distill_data
from specjax.train.dflash import train_dflash
from specjax.train.eagle import train_eagle
from specjax.train.eagle3 import train_eagle3
from specjax.train.medusa import train_medusa
from specjax.train.mlp_speculator import train_mlp_speculator
from specjax.train.mtp import train_mtp
from specjax.train.prompts import self_instruct_prompts

PathLike = str | os.PathLike
# A prompt source: a JSONL file (path) or the prompts themselves.
Prompts = PathLike | Sequence[str]

DEFAULT_DRAFT_VOCAB = 8192


class OptionError(ValueError):
    """A refused training option. The message names options by placeholders (`{draft_vocab}`) and
    holds its other values in `values`, so each caller spells the options its own way: `str()`
    gives TrainingOptions' field names, `worded(spell)` any other spelling (the command line's
    flags)."""

    def __init__(self, message: str, **values):
        self.message, self.values = message, values
        super().__init__(self.worded())

    def worded(self, spell: Callable[[str], str] = str) -> str:
        """The message, each placeholder that is not one of `values` replaced by `spell(name)`."""
        return self.message.format_map(_Spelled(self.values, spell))


class _Spelled(dict):
    def __init__(self, values: dict, spell: Callable[[str], str]):
        super().__init__(values)
        self.spell = spell

    def __missing__(self, option: str) -> str:
        return self.spell(option)


def _refuse(option: str, allowed: str, value) -> None:
    # `option` is a field name and `allowed` plain words: neither holds braces.
    raise OptionError(f"{{{option}}} must be {allowed}, got {{value!r}}", value=value)


def _check_count(option: str, value, minimum: int, none: bool = False) -> None:
    if none and value is None:
        return
    if not is_int(value) or value < minimum:
        _refuse(option, f"an integer >= {minimum}", value)


def _check_path(option: str, value, none: bool = True) -> None:
    if not (none and value is None) and not isinstance(value, PathLike):
        _refuse(option, "a path (str or os.PathLike)" + (" or None" if none else ""), value)


def _prompt_source(option: str, value) -> Prompts | None:
    """`value` as a prompt source: None, a path, or a non-empty tuple of str prompts."""
    if value is None or isinstance(value, PathLike):
        return value
    if isinstance(value, Sequence) and value and all(isinstance(p, str) for p in value):
        return tuple(value)
    _refuse(option, "a JSONL file, a non-empty list of str prompts or None", value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingOptions:
    """One distillation run: where its prompts come from, how the distillation set is built and
    kept, and how long the head trains. The head's own options (its depth, `unroll`, ...) are the
    trainer's keyword arguments to `train_head`. Checked at construction; the fields are the
    flags of `specjax train-*` (`new_tokens` is `--new-tokens`), with the same defaults."""

    out: PathLike  # folder for the head (out/head) and the training checkpoints (out/checkpoints)
    prompts: Prompts | None = None  # a JSONL file of training prompts, or the prompts themselves
    field: str = "turns"  # the JSON field holding a file's prompt (a list gives its first entry)
    exclude: Prompts | None = None  # held-out prompts (a file or a list) never trained on
    limit: int | None = None  # train on the first `limit` prompts (after `exclude`) only
    split: str | None = None  # a split of specjax.bench.SPLITS: its prompts less its held-out file
    split_data: PathLike | None = None  # the folder of the split's files (default: the data folder)
    self_instruct: int = 0  # add this many chat prompts the model writes itself (Magpie)
    seed: int = 0  # seeds the self-written prompts and the training
    new_tokens: int = 128  # greedy continuation tokens generated per prompt
    max_len: int = 256  # tokens per training sequence (the end of a longer one is kept)
    generate_batch_size: int = 16  # prompts answered per generate call
    batch_size: int = 8  # training sequences per step (and per distill_data batch)
    # Heads with a draft vocabulary: its size, the set's most frequent tokens (None: 8192, or the
    # whole vocabulary of a model with fewer).
    draft_vocab: int | None = None
    data: PathLike | None = None  # an .npz distillation set: read if it exists, else saved there
    steps: int = 1000  # training steps
    learning_rate: float | None = None  # peak learning rate (None: the trainer's default)

    def __post_init__(self):
        _check_path("out", self.out, none=False)
        for option in ("prompts", "exclude"):
            object.__setattr__(self, option, _prompt_source(option, getattr(self, option)))
        if not isinstance(self.field, str) or not self.field:
            _refuse("field", "a non-empty str", self.field)
        _check_count("limit", self.limit, 1, none=True)
        self._check_split()
        for option, minimum in [
            ("self_instruct", 0),
            ("seed", 0),
            ("new_tokens", 1),
            ("max_len", 2),
            ("generate_batch_size", 1),
            ("batch_size", 1),
            ("steps", 1),
        ]:
            _check_count(option, getattr(self, option), minimum)
        _check_count("draft_vocab", self.draft_vocab, 1, none=True)
        _check_path("data", self.data)
        rate = self.learning_rate
        if rate is not None and (
            isinstance(rate, bool)
            or not isinstance(rate, int | float)
            or not math.isfinite(rate)
            or rate <= 0
        ):
            _refuse("learning_rate", "a finite number > 0 or None", rate)
        if self.prompts is None and self.split is None and not self.self_instruct:
            raise OptionError(
                "give training prompts: {prompts} FILE.jsonl or {split} NAME, {self_instruct} N, or both"
            )

    def _check_split(self) -> None:
        _check_path("split_data", self.split_data)
        if self.split is None:
            if self.split_data is not None:
                raise OptionError("{split_data} is the folder of {split}'s files: give {split} too")
            return
        if self.split not in SPLITS:
            raise OptionError(
                "{split}: unknown split {name!r}; allowed: {allowed}",
                name=self.split,
                allowed=", ".join(SPLITS),
            )
        if self.prompts is not None or self.exclude is not None:
            raise OptionError(
                "{split} {name} names the prompts and the held-out set: drop {prompts}/{exclude}",
                name=self.split,
            )

    @property
    def head_folder(self) -> Path:
        """Where train_head saves the head (`specjax.load_head(folder, model)` reads it)."""
        return Path(self.out) / "head"

    @property
    def checkpoint_folder(self) -> Path:
        return Path(self.out) / "checkpoints"


def prompt_sources(options: TrainingOptions) -> tuple[Prompts | None, Prompts | None]:
    """The training prompts and the held-out ones: the split's two files (read from
    `split_data`; ValueError naming a missing one), else `prompts` and `exclude`."""
    if options.split is None:
        return options.prompts, options.exclude
    return SPLITS[options.split].files(options.split_data)


def read_prompts(
    path: PathLike, field: str = "turns", limit: int | None = None, option: str = "prompts"
) -> list[str]:
    """The `field` of each JSON line of `path` (at most `limit` of them); a list value (MT-bench's
    "turns") gives its first entry. Errors name `option`, the file and the line."""
    path = str(path)

    def refused(problem: str, **values) -> OptionError:
        return OptionError("{" + option + "}: " + problem, path=path, **values)

    if not Path(path).is_file():
        raise refused("no such file {path!r}")
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise refused(
                "line {number} of {path!r} is not JSON ({why})", number=number, why=error.msg
            ) from None
        if not isinstance(record, dict) or field not in record:
            raise refused(
                "line {number} of {path!r} has no field {name!r} (see {field})", number=number, name=field
            )
        value = record[field]
        prompts.append(value[0] if isinstance(value, list) else value)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise refused("{path!r} holds no prompts")
    return prompts


def training_prompts(options: TrainingOptions) -> tuple[list[str], set[str]]:
    """The training prompts (none without a source) less the held-out ones, the first `limit` of
    them; and the held-out prompts."""
    prompts, exclude = prompt_sources(options)

    def read(source: Prompts, option: str) -> list[str]:
        return (
            list(source) if isinstance(source, tuple) else read_prompts(source, options.field, option=option)
        )

    held_out = set() if exclude is None else set(read(exclude, "exclude"))
    if prompts is None:
        return [], held_out
    kept = [p for p in read(prompts, "prompts") if p not in held_out]
    return kept[: options.limit], held_out


def continuations(model: Model, prompts: list[str], new_tokens: int, batch_size: int) -> list[list[int]]:
    """Each chat-templated prompt followed by the model's greedy continuation, as token ids."""
    sequences = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        result = generate(model, chunk, max_new_tokens=new_tokens, chat=True)
        sequences += [p + t for p, t in zip(result.prompt_tokens, result.tokens, strict=True)]
    return sequences


def distillation_set(
    model: Model, options: TrainingOptions, prompts: list[str], held_out: set[str] = frozenset()
) -> tuple[DistillationData, int]:
    """The `data` file's set if it exists; else the model's continuations of `prompts` and of
    `self_instruct` prompts it writes itself (none of them held out or in `prompts`), and its
    hidden states along them, saved to `data` when named. Returns the set and the number of
    prompts it was built from."""
    if options.data and Path(options.data).is_file():
        print(f"reading the distillation set from {options.data}", file=sys.stderr)
        data = DistillationData.load(options.data)
        return data, data.num_sequences
    if options.self_instruct:
        print(f"{model}: writing {options.self_instruct} user prompts", file=sys.stderr)
        written = self_instruct_prompts(
            model, options.self_instruct, seed=options.seed, exclude=set(held_out) | set(prompts)
        )
        prompts = prompts + written
    print(f"{model}: generating {options.new_tokens} tokens for {len(prompts)} prompts", file=sys.stderr)
    sequences = continuations(model, prompts, options.new_tokens, options.generate_batch_size)
    sequences = [s[-options.max_len :] for s in sequences]  # the continuation matters most
    data = distill_data(model, sequences, max_len=options.max_len, batch_size=options.batch_size)
    if options.data:
        data.save(options.data)
        print(f"saved the distillation set to {options.data}", file=sys.stderr)
    return data, len(prompts)


def draft_vocab_size(options: TrainingOptions, model: Model) -> int:
    """`options.draft_vocab`, or its default: 8192, or the whole vocabulary of a smaller model;
    refused above the model's vocabulary (before the costly generation)."""
    V = model.config.vocab_size
    size = min(DEFAULT_DRAFT_VOCAB, V) if options.draft_vocab is None else options.draft_vocab
    if not 1 <= size <= V:
        raise OptionError(
            "{draft_vocab} must be in 1..{V} (the model's vocab size), got {size}", V=V, size=size
        )
    return size


@dataclasses.dataclass(frozen=True)
class HeadTrainer:
    """How `train_head` trains one kind of head."""

    train: Callable  # (target, data, steps=, batch_size=, learning_rate=, seed=, checkpoint_dir=, ...)
    draft_vocab: bool  # takes draft_vocab_size: the head drafts from the set's most frequent tokens


# The heads train_head trains, by the name `specjax train-<name>` spells with dashes.
HEAD_TRAINERS = {
    "medusa": HeadTrainer(train_medusa, draft_vocab=True),
    "eagle": HeadTrainer(train_eagle, draft_vocab=True),
    "eagle3": HeadTrainer(train_eagle3, draft_vocab=True),
    "dflash": HeadTrainer(train_dflash, draft_vocab=True),
    "mlp_speculator": HeadTrainer(train_mlp_speculator, draft_vocab=False),
    "mtp": HeadTrainer(train_mtp, draft_vocab=False),
}
# The trainer arguments train_head sets from the options.
_FROM_OPTIONS = ("steps", "batch_size", "learning_rate", "seed", "checkpoint_dir", "draft_vocab_size")


def train_head(model: Model | PathLike, head: str, options: TrainingOptions, **trainer_options):
    """Train a `head` (a name of HEAD_TRAINERS: "medusa", "eagle", "eagle3", "dflash",
    "mlp_speculator", "mtp") for `model` (a Model, or what specjax.load reads) by self-distillation
    and save it to `options.head_folder`; returns the head, its meta naming what it trained on.
    `trainer_options` are the trainer's own (train_eagle3's `unroll`, train_medusa's `num_heads`,
    ...). Everything is checked before the costly generation."""
    if head not in HEAD_TRAINERS:
        raise ValueError(f"train_head: head must be one of {', '.join(HEAD_TRAINERS)}; got {head!r}")
    if not isinstance(options, TrainingOptions):
        raise ValueError(f"train_head: options must be a TrainingOptions, got {type(options).__name__}")
    if taken := sorted(set(trainer_options) & set(_FROM_OPTIONS)):
        raise ValueError(
            f"train_head: the TrainingOptions set {', '.join(taken)} (draft_vocab_size is their "
            "draft_vocab, checkpoint_dir their out): leave them out of the trainer's options"
        )
    trainer = HEAD_TRAINERS[head]
    if options.draft_vocab is not None and not trainer.draft_vocab:
        raise OptionError(
            "{draft_vocab}: {head} heads draft from the whole vocabulary; leave it None", head=head
        )
    prompts, held_out = training_prompts(options)
    if isinstance(model, PathLike):
        model = load(model)
    elif not isinstance(model, Model):
        raise ValueError(
            f"train_head: model must be a specjax.Model or what specjax.load reads, got {model!r}"
        )
    if trainer.draft_vocab:
        trainer_options["draft_vocab_size"] = draft_vocab_size(options, model)
    if options.learning_rate is not None:
        trainer_options["learning_rate"] = options.learning_rate
    data, num_prompts = distillation_set(model, options, prompts, held_out)
    trained = trainer.train(
        model,
        data,
        steps=options.steps,
        batch_size=options.batch_size,
        seed=options.seed,
        checkpoint_dir=options.checkpoint_folder,
        **trainer_options,
    )
    source = prompt_sources(options)[0]
    trained.meta.update(
        split=options.split,
        prompts_file=str(source) if isinstance(source, PathLike) else None,
        prompts_field=options.field,
        self_instruct_prompts=options.self_instruct,
        num_prompts=num_prompts,
    )
    if options.data:
        trained.meta.update(data_file=str(options.data))
    save_head(options.head_folder, trained)
    return trained
