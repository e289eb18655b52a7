"""The distillation pipeline from Python (specjax.train.pipeline): a head trained on a list of
prompts without argparse, the options refused at construction and before generating, and the
command line's flags and defaults agreeing with TrainingOptions."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from tiny import CHAT_TEMPLATE, tiny_model, tiny_tokenizer

import specjax
from specjax import cli
from specjax.models import Model
from specjax.train import (
    HEAD_TRAINERS,
    DistillationData,
    OptionError,
    TrainingOptions,
    load_head,
    train_head,
)


def chat_model() -> Model:
    """A tiny random model with the character tokenizer and a chat template: generate(chat=True)
    reads str prompts with it, as the pipeline asks."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    base = tiny_model(seed=11)
    return Model(base.config, base.params, tokenizer=tokenizer, name="tiny-chat")


def test_an_eagle3_head_trains_on_a_list_of_prompts(tmp_path, capsys):
    model = chat_model()
    options = TrainingOptions(
        prompts=[f"prompt number {i}" for i in range(5)],
        exclude=["prompt number 3"],
        out=tmp_path / "run",
        data=tmp_path / "set.npz",
        steps=2,
        new_tokens=4,
        max_len=24,
        batch_size=2,
        generate_batch_size=4,
        draft_vocab=16,
    )
    head = train_head(model, "eagle3", options, unroll=1, progress=False)
    assert isinstance(head, specjax.models.Eagle3Head) and head.config.draft_vocab_size == 16
    assert head.meta["num_prompts"] == 4 and head.meta["prompts_file"] is None  # one held out
    assert head.meta["unroll"] == 1 and head.meta["steps_done"] == 2
    assert head.meta["learning_rate"] == 3e-3  # the trainer's default: learning_rate=None
    saved = load_head(options.head_folder, model)
    assert isinstance(saved, specjax.models.Eagle3Head) and saved.meta == head.meta
    assert (tmp_path / "run" / "checkpoints").is_dir()
    data = DistillationData.load(options.data)
    assert data.num_sequences == 4 and data.target == specjax.models.target_signature(model)
    assert "generating 4 tokens for 4 prompts" in capsys.readouterr().err


BAD_OPTIONS = [
    ({"prompts": None}, "give training prompts: prompts FILE.jsonl or split NAME, self_instruct N, or both"),
    ({"out": None}, "out must be a path (str or os.PathLike), got None"),
    ({"prompts": []}, "prompts must be a JSONL file, a non-empty list of str prompts or None, got []"),
    ({"prompts": ["a", 2]}, "prompts must be a JSONL file, a non-empty list of str prompts or None"),
    ({"exclude": 5}, "exclude must be a JSONL file, a non-empty list of str prompts or None, got 5"),
    ({"field": ""}, "field must be a non-empty str, got ''"),
    ({"limit": 0}, "limit must be an integer >= 1, got 0"),
    ({"split": "nope"}, "split: unknown split 'nope'; allowed: spec-bench-minus-mt-bench"),
    ({"split": "spec-bench-minus-mt-bench"}, "names the prompts and the held-out set: drop prompts/exclude"),
    ({"split_data": "folder"}, "split_data is the folder of split's files: give split too"),
    ({"self_instruct": -1}, "self_instruct must be an integer >= 0, got -1"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"new_tokens": 1.5}, "new_tokens must be an integer >= 1, got 1.5"),
    ({"max_len": 1}, "max_len must be an integer >= 2, got 1"),
    ({"generate_batch_size": 0}, "generate_batch_size must be an integer >= 1, got 0"),
    ({"batch_size": True}, "batch_size must be an integer >= 1, got True"),
    ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ({"draft_vocab": 0}, "draft_vocab must be an integer >= 1, got 0"),
    ({"data": 3}, "data must be a path (str or os.PathLike) or None, got 3"),
    ({"learning_rate": float("nan")}, "learning_rate must be a finite number > 0 or None, got nan"),
    ({"learning_rate": "1e-3"}, "learning_rate must be a finite number > 0 or None, got '1e-3'"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_OPTIONS)
def test_bad_options_are_refused_at_construction(fields, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        TrainingOptions(**{"out": "run", "prompts": ["a"], **fields})


def test_the_command_line_spells_the_options_as_flags():
    with pytest.raises(OptionError) as refused:
        TrainingOptions(out="run", split_data="folder")
    assert isinstance(refused.value, ValueError)
    assert str(refused.value) == "split_data is the folder of split's files: give split too"
    assert (
        refused.value.worded(cli.train.flag)
        == "--split-data is the folder of --split's files: give --split too"
    )


@pytest.fixture
def no_generate(monkeypatch):
    def generate(*args, **kwargs):
        raise AssertionError("generated before refusing")

    monkeypatch.setattr(specjax.train.pipeline, "generate", generate)


@pytest.mark.parametrize(
    ("model", "head", "fields", "trainer_options", "message"),
    [
        (
            None,
            "eagle",
            {"draft_vocab": 98},
            {},
            "draft_vocab must be in 1..97 (the model's vocab size), got 98",
        ),
        (None, "mtp", {"draft_vocab": 16}, {}, "draft_vocab: mtp heads draft from the whole vocabulary"),
        (None, "nope", {}, {}, "head must be one of medusa, eagle, eagle3, dflash, mlp_speculator, mtp"),
        (None, "medusa", {}, {"steps": 3}, "the TrainingOptions set steps"),
        (None, "medusa", {}, {"draft_vocab_size": 8}, "the TrainingOptions set draft_vocab_size"),
        (None, "medusa", {"prompts": "none.jsonl"}, {}, "prompts: no such file 'none.jsonl'"),
        (None, "medusa", {"exclude": "none.jsonl"}, {}, "exclude: no such file 'none.jsonl'"),
        (42, "medusa", {}, {}, "model must be a specjax.Model or what specjax.load reads, got 42"),
    ],
)
def test_train_head_refuses_before_generating(model, head, fields, trainer_options, message, no_generate):
    options = TrainingOptions(**{"out": "run", "prompts": ["a"], **fields})
    with pytest.raises(ValueError, match=re.escape(message)):
        train_head(tiny_model(seed=11) if model is None else model, head, options, **trainer_options)


def test_train_head_takes_options_only_as_a_record():
    with pytest.raises(ValueError, match="options must be a TrainingOptions, got dict"):
        train_head(tiny_model(seed=11), "medusa", {"out": "run", "prompts": ["a"]})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"turns": ["a"]}\n{"text": "b"}\n',
            r"prompts: line 2 of '.*p.jsonl' has no field 'turns' \(see field\)",
        ),
        ('{"turns": ["a"]}\n{"turns": \n', r"prompts: line 2 of '.*p.jsonl' is not JSON \(Expecting value\)"),
        ("\n\n", r"prompts: '.*p.jsonl' holds no prompts"),
    ],
)
def test_a_prompt_file_error_names_its_line(text, message, tmp_path, no_generate):
    file = tmp_path / "p.jsonl"
    file.write_text(text)
    with pytest.raises(OptionError, match=message):
        train_head(tiny_model(seed=11), "medusa", TrainingOptions(out="run", prompts=file))


@pytest.mark.parametrize("command", [f"train-{head.replace('_', '-')}" for head in HEAD_TRAINERS])
def test_every_train_command_builds_its_options(command):
    """Each field of TrainingOptions is a flag of every train command (--draft-vocab exactly where
    HEAD_TRAINERS declares a draft vocabulary) with TrainingOptions' default; the learning rate's
    default is the trainer's own."""
    args = cli.parser().parse_args([command, "--out", "o", "--prompts", "p.jsonl"])
    trainer = HEAD_TRAINERS[cli.train.trained_head(args)]
    flags = set(vars(args))
    assert ("draft_vocab" in flags) == trainer.draft_vocab
    assert {f.name for f in dataclasses.fields(TrainingOptions)} - {"draft_vocab"} <= flags
    assert cli.train.training_options(args) == TrainingOptions(
        out="o",
        prompts="p.jsonl",
        learning_rate=inspect.signature(trainer.train).parameters["learning_rate"].default,
    )
