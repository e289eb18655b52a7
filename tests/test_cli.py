"""The command line: one-line errors for bad input, and train-medusa end to end on a tiny model."""

import json

import pytest
from tiny import tiny_model

import specjax
from specjax import cli
from specjax.train import load_head


def test_help_and_missing_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train-medusa", "--help"])
    assert "--prompts" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["train-medusa"])
    assert "required" in capsys.readouterr().err


def test_bad_prompt_file_is_one_line(tmp_path, capsys):
    assert cli.main(["train-medusa", "--prompts", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err
    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps({"text": "hi"}) + "\n")
    assert cli.main(["train-medusa", "--prompts", str(file), "--out", str(tmp_path)]) == 2
    assert "no field 'turns'" in capsys.readouterr().err


def test_exclude_holds_prompts_out(tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps({"turns": [t, "second turn"]}) + "\n" for t in "abcd"))
    held.write_text(json.dumps({"turns": ["b"]}) + "\n")
    args = cli.parser().parse_args(
        ["train-medusa", "--prompts", str(train), "--exclude", str(held), "--out", "x"]
    )
    assert args.exclude == str(held)
    assert cli.read_prompts(str(train), "turns", None) == ["a", "b", "c", "d"]


def test_train_medusa_command_on_a_tiny_model(tmp_path, monkeypatch):
    target = tiny_model(seed=11)
    # Token-id prompts through a tiny character tokenizer would need a chat template: feed the
    # command a model whose generate sees plain id lists instead.
    monkeypatch.setattr(specjax, "load", lambda name: target)
    real_generate = specjax.generate
    monkeypatch.setattr(
        specjax,
        "generate",
        lambda model, prompts, **kw: real_generate(
            model, [[ord(c) % 97 for c in p] for p in prompts], **{**kw, "chat": False}
        ),
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"prompt number {i}"]}) + "\n" for i in range(6)))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"turns": ["prompt number 3"]}) + "\n")
    out = tmp_path / "out"
    argv = ["train-medusa", "--prompts", str(prompts), "--exclude", str(held), "--out", str(out)]
    argv += ["--heads", "2", "--steps", "5"]
    argv += ["--new-tokens", "8", "--max-len", "32", "--batch-size", "4"]
    assert cli.main(argv) == 0
    head = load_head(out / "head", target)
    assert head.config.num_heads == 2 and head.meta["num_prompts"] == 5  # one held out
