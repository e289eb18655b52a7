"""The command line: one-line errors for bad input, and train-medusa and train-eagle end to end on a
tiny model, one distillation set (--data) training both."""

import json
from types import SimpleNamespace

import pytest
from tiny import tiny_model

import specjax
from specjax import cli
from specjax.models import EagleHead, MedusaHead
from specjax.train import DistillationData, load_head

COMMANDS = ["train-medusa", "train-eagle"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_and_missing_arguments(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert "--prompts" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([command])
    assert "required" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_bad_prompt_file_is_one_line(command, tmp_path, capsys):
    assert cli.main([command, "--prompts", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err
    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps({"text": "hi"}) + "\n")
    assert cli.main([command, "--prompts", str(file), "--out", str(tmp_path)]) == 2
    assert "no field 'turns'" in capsys.readouterr().err


def test_exclude_holds_prompts_out(tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps({"turns": [t, "second turn"]}) + "\n" for t in "abcd"))
    held.write_text(json.dumps({"turns": ["b"]}) + "\n")
    args = cli.parser().parse_args(
        ["train-medusa", "--prompts", str(train), "--exclude", str(held), "--out", "x"]
    )
    assert cli.training_prompts(args) == ["a", "c", "d"]
    assert cli.read_prompts(str(train), "turns", None) == ["a", "b", "c", "d"]


@pytest.fixture
def tiny_target(monkeypatch):
    """The commands see a tiny model whose generate takes the prompts as plain id lists (a tiny
    character tokenizer would need a chat template); `generated` counts the generate calls."""
    tiny = SimpleNamespace(model=tiny_model(seed=11), generated=0)
    monkeypatch.setattr(specjax, "load", lambda name: tiny.model)
    real_generate = specjax.generate

    def generate(model, prompts, **kw):
        tiny.generated += 1
        return real_generate(model, [[ord(c) % 97 for c in p] for p in prompts], **{**kw, "chat": False})

    monkeypatch.setattr(specjax, "generate", generate)
    return tiny


def _argv(command, tmp_path, out, *extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"prompt number {i}"]}) + "\n" for i in range(6)))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"turns": ["prompt number 3"]}) + "\n")
    argv = [command, "--prompts", str(prompts), "--exclude", str(held), "--out", str(out)]
    return argv + ["--steps", "5", "--new-tokens", "8", "--max-len", "32", "--batch-size", "4", *extra]


def test_train_medusa_command_on_a_tiny_model(tmp_path, tiny_target):
    out = tmp_path / "out"
    assert cli.main(_argv("train-medusa", tmp_path, out, "--heads", "2")) == 0
    head = load_head(out / "head", tiny_target.model)
    assert isinstance(head, MedusaHead)
    assert head.config.num_heads == 2 and head.meta["num_prompts"] == 5  # one held out


def test_one_data_file_trains_both_heads(tmp_path, tiny_target, capsys):
    data_file = tmp_path / "set.npz"
    medusa = ["--heads", "2", "--data", str(data_file)]
    assert cli.main(_argv("train-medusa", tmp_path, tmp_path / "medusa", *medusa)) == 0
    assert tiny_target.generated == 2  # 5 prompts, batches of 4
    data = DistillationData.load(data_file)
    assert data.num_sequences == 5 and data.target == specjax.models.target_signature(tiny_target.model)

    eagle = ["--draft-vocab", "16", "--noise", "0.2", "--data", str(data_file)]
    assert cli.main(_argv("train-eagle", tmp_path, tmp_path / "eagle", *eagle)) == 0
    assert tiny_target.generated == 2  # read from the file, not generated again
    head = load_head(tmp_path / "eagle" / "head", tiny_target.model)
    assert isinstance(head, EagleHead) and head.config.draft_vocab_size == 16
    assert head.meta["noise"] == 0.2 and head.meta["data_file"] == str(data_file)
    assert head.meta["data"] == data.summary()
    assert "reading the distillation set" in capsys.readouterr().err


def test_train_eagle_refuses_a_draft_vocab_above_the_vocab(tmp_path, tiny_target, capsys):
    assert cli.main(_argv("train-eagle", tmp_path, tmp_path / "out", "--draft-vocab", "98")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--draft-vocab must be in 1..97" in err
    assert tiny_target.generated == 0  # refused before generating


def test_a_data_file_from_another_model_is_refused(tmp_path, tiny_target, capsys):
    data_file = tmp_path / "other.npz"
    other = tiny_model(seed=12)
    from specjax.train import distill_data

    distill_data(other, [[1, 2, 3, 4]], max_len=8).save(data_file)
    argv = _argv("train-eagle", tmp_path, tmp_path / "out", "--draft-vocab", "16", "--data", str(data_file))
    assert cli.main(argv) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after "reading the distillation set ..."
    assert last.startswith("specjax train-eagle: error: data were distilled from target")
