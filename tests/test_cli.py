"""The command line: --help and one-line errors for every command; generate, bench and ablate on
a tiny random model saved as an HF folder; train-medusa and train-eagle end to end on a tiny model,
one distillation set (--data) training both."""

import csv
import io
import json
import re
import statistics
from pathlib import Path
from types import SimpleNamespace

import hf_export
import jax
import numpy as np
import pytest
from tiny import CHAT_TEMPLATE, tiny_model, tiny_tokenizer

import specjax
import specjax.serve.app
from specjax import bench, cli
from specjax.models import EagleHead, MedusaHead
from specjax.named import PROPOSER_NAMES
from specjax.train import DistillationData, load_head, read_prompts, training_prompts

COMMANDS = [
    "train-medusa",
    "train-eagle",
    "train-eagle3",
    "train-dflash",
    "train-mlp-speculator",
    "train-mtp",
]


class WithHead(specjax.Proposer):
    """A proposer that stands for one drafting with a trained head (the bench tools ask for heads)."""

    def __init__(self, head):
        self.head = head

    def spec(self, target, warp=None, mesh=None):
        raise NotImplementedError("a stand-in: never generates")

    def trained_heads(self) -> tuple:
        return (self.head,)


def save_hf_folder(model, folder) -> None:
    """Write a specjax model as an HF checkpoint folder (config.json, model.safetensors) with the
    tiny character tokenizer and a chat template: what `--model PATH` reads, without torch."""
    hf_export.save_hf_folder(model, folder)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "model"
    save_hf_folder(tiny_model(seed=5), folder)
    return folder


SPEC_BENCH_ROWS = [
    {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 2, "category": "rag", "turns": ["Given: the sky is blue. What colour is the sky?"]},
    {"question_id": 3, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    {"question_id": 4, "category": "qa", "turns": ["How far is the moon?"]},
    {"question_id": 5, "category": "translation", "turns": ["Translate: bonjour"]},
]


@pytest.fixture
def data_folder(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    lines = "".join(json.dumps(row) + "\n" for row in SPEC_BENCH_ROWS)
    (folder / "spec_bench_question.jsonl").write_text(lines)
    return folder


# ---------------------------------------------------------------------------------------------
# --help and errors


@pytest.mark.parametrize("command", ["generate", "bench", "ablate", "serve", *COMMANDS])
def test_help_of_every_command(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: specjax {command}")
    assert f"specjax {command} " in out.split("options:")[0]  # an example in the description


def test_generate_help_names_every_proposer(capsys):
    cli.main(["generate", "--help"])
    listed = re.search(r"a name \(([^)]*)\)", " ".join(capsys.readouterr().out.split())).group(1)
    assert tuple(listed.split(", ")) == PROPOSER_NAMES


@pytest.mark.parametrize("command", COMMANDS)
def test_help_and_missing_arguments(command, capsys):
    assert cli.main([command, "--help"]) == 0
    assert "--prompts" in capsys.readouterr().out
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"specjax {command}: error:") and "required" in err


BAD_ARGUMENTS = [
    (["bogus"], "specjax: error: argument COMMAND: invalid choice: 'bogus'"),
    (["generate", "hi", "--k", "0"], "specjax generate: error: argument --k: must be an integer >= 1"),
    (["generate", "hi", "--tree", "[[0]"], "argument --tree: not valid JSON"),
    (["generate", "hi", "--k", "3"], "--k needs --proposer"),
    (["generate", "hi", "--head", "h"], "--head needs --proposer"),
    (["generate", "--proposer", "ngram"], "no prompts: give them as arguments or with --prompts-file"),
    (["generate", "hi", "--proposer", '{"name": "ngram", "k": 2}', "--k", "3"], "--k: 'k' is also in"),
    (["generate", "hi", "--proposer", '{"name": "ngram"'], "--proposer: not valid JSON"),
    (["generate", "hi", "--temperature", "-1"], "Sampling temperature must be a finite number >= 0"),
    (["generate", "hi", "--temperature", "warm"], "argument --temperature: invalid float value"),
    (["generate", "--prompts-file", "{tmp}/none.jsonl"], "--prompts-file: no such file"),
    (["generate", "hi", "--model", "{tmp}/no-model"], "no-model"),
    (["bench", "--methods", "plain,nope"], "--methods: unknown method 'nope'; allowed: plain, ngram"),
    (["bench", "--methods", "ngram", "--ngram-n-min", "5"], "NGram n_min (5) must not exceed n_max (4)"),
    (["bench", "--categories", "qa,poetry"], "--categories: unknown category 'poetry'"),
    (["bench", "--methods", "ngram", "--data", "{tmp}"], "no spec_bench_question.jsonl in {tmp}"),
    (["bench", "--methods", "medusa", "--heads", "{tmp}"], "no Medusa head in {tmp}/medusa/head"),
    (["bench", "--format", "html"], "argument --format: invalid choice: 'html'"),
    (["bench", "--repeats", "0"], "argument --repeats: must be an integer >= 1"),
    (["ablate", "{tmp}/sweep.yaml", "--out", "{tmp}/out"], "no such file '{tmp}/sweep.yaml'"),
    (["ablate", "{tmp}/sweep.yaml"], "the following arguments are required: --out"),
    (["serve"], "the following arguments are required: MODEL"),
    (["serve", "m", "--port", "0"], "specjax serve: error: argument --port: must be an integer >= 1"),
    (["serve", "m", "--speculative-config", "{"], "argument --speculative-config: not valid JSON"),
    (["serve", "m", "--max-waiting", "-1"], "argument --max-waiting: must be an integer >= 0"),
    (["serve", "m", "--precompile", "-3"], "argument --precompile: must be an integer >= 0, or -1 for off"),
    (["serve", "{tmp}/no-model"], "no-model"),
    (["generate", "hi", "--quantization", "int3"], "argument --quantization: invalid choice: 'int3'"),
    (["serve", "m", "--group-size", "0"], "argument --group-size: must be an integer >= 1, got '0'"),
    (
        ["train-mlp-speculator", "--out", "o", "--positions", "-1"],
        "argument --positions: must be an integer >= 0",
    ),
    (
        ["train-mtp", "--out", "o", "--positions", "all"],
        "argument --positions: must be an integer >= 0, got 'all'",
    ),
    (
        ["generate", "hi", "--quantization", "int8", "--group-size", "32"],
        "group_size is for quantization='int4'",
    ),
]


@pytest.mark.parametrize(("argv", "message"), BAD_ARGUMENTS)
def test_bad_arguments_are_one_line(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    command = (
        argv[0]
        if argv[0] in ("generate", "bench", "ablate", "serve", "train-mlp-speculator", "train-mtp")
        else None
    )
    assert err.count("\n") == 1, err
    assert err.startswith(f"specjax {command}: error: " if command else "specjax: error: ")
    assert message.replace("{tmp}", str(tmp_path)) in err


@pytest.mark.parametrize("argv", [["generate", "hi"], ["bench", "--data", "{data}"], ["serve", "m"]])
def test_the_quantization_options_reach_load(argv, data_folder, monkeypatch, capsys):
    """--quantization and --group-size go to specjax.load as they are (serve: through
    specjax.serve.serve)."""

    def load(source, **options):
        raise ValueError(f"load was given {options}")

    monkeypatch.setattr(specjax, "load", load)
    monkeypatch.setattr(specjax.serve.app, "load", load)
    argv = [a.replace("{data}", str(data_folder)) for a in argv]
    assert cli.main([*argv, "--quantization", "int4", "--group-size", "128"]) == 2
    assert "'quantization': 'int4', 'group_size': 128" in capsys.readouterr().err


@pytest.mark.parametrize("precompile", ["40", "-1"])
def test_serve_compiles_its_programs_before_it_listens(precompile, tiny_folder, monkeypatch, capsys):
    """`specjax serve` compiles the loop at every width and the prefill of prompts up to
    --precompile tokens before uvicorn starts (-1: nothing ahead, each on first use)."""
    served = {}

    def run(app, **options):  # uvicorn.run: take the app instead of listening
        served["programs"] = set(app.state.engine.compiled)
        served["widths"] = set(app.state.engine._widths)

    monkeypatch.setattr(specjax.serve.app.uvicorn, "run", run)
    argv = ["serve", str(tiny_folder), "--max-batch", "4", "--max-model-len", "64"]
    assert cli.main([*argv, "--precompile", precompile]) == 0
    loops = {(kind, w) for kind, w in served["programs"] if kind in ("lean", "resume")}
    prefills = {bucket for kind, bucket in served["programs"] if kind == "prefill"}
    if precompile == "-1":
        assert loops == set() and prefills == {specjax.planner.MIN_BUCKET}  # (the free slot's row)
    else:
        assert loops == {(kind, w) for kind in ("lean", "resume") for w in served["widths"]}
        assert prefills == {16, 32, 48}  # the buckets of prompts of 1 to 40 tokens
        assert "programs compiled" in capsys.readouterr().out


def test_serve_on_pages_says_what_its_pool_holds(tiny_folder, monkeypatch, capsys):
    """--page-size with --num-pages or --kv-cache-memory: the engine's pool, reported at start;
    bad amounts are refused naming the option."""
    engines = []
    monkeypatch.setattr(specjax.serve.app.uvicorn, "run", lambda app, **_: engines.append(app.state.engine))
    argv = ["serve", str(tiny_folder), "--max-batch", "2", "--max-model-len", "64", "--precompile", "-1"]
    assert cli.main([*argv, "--page-size", "16", "--num-pages", "12"]) == 0
    assert "KV cache: 12 pages of 16 slots, 192 tokens" in capsys.readouterr().out
    assert engines[-1].kv_cache.capacity_tokens == 192
    page = specjax.models.cache.cache_bytes(engines[-1].model.config, 1, 16, 4)
    assert cli.main([*argv, "--page-size", "16", "--kv-cache-memory", str(11 * page)]) == 0
    assert engines[-1].kv_cache.capacity_tokens == 10 * 16  # (the null page comes out of the bytes)
    assert cli.main([*argv]) == 0
    assert "KV cache: dense, 2 slots of at most 64 tokens" in capsys.readouterr().out
    for bad in (
        ["--kv-cache-memory", "1.5"],
        ["--kv-cache-memory", "0"],
        ["--num-pages", "3", "--kv-cache-memory", "9"],
    ):
        assert cli.main([*argv, "--page-size", "16", *bad]) == 2
        assert "--kv-cache-memory" in capsys.readouterr().err
    assert cli.main([*argv, "--page-size", "16", "--no-prefix-caching"]) == 0
    assert not engines[-1].config.prefix_caching and engines[-2].config.prefix_caching
    assert cli.main([*argv, "--num-pages", "12"]) == 2  # without --page-size
    assert "num_pages=12 sizes a paged cache: give a page_size too" in capsys.readouterr().err


def test_serve_on_a_mesh_splits_the_model_and_the_slots(tiny_folder, monkeypatch, capsys):
    """--tensor-parallel-size and --data-parallel-size: the engine on a mesh of this process's
    devices, the weights split over "model"; sizes the devices, the model or the slots cannot take
    are refused naming them."""
    engines = []
    monkeypatch.setattr(specjax.serve.app.uvicorn, "run", lambda app, **_: engines.append(app.state.engine))
    argv = ["serve", str(tiny_folder), "--max-batch", "4", "--max-model-len", "64", "--precompile", "-1"]
    assert cli.main([*argv, "--tensor-parallel-size", "2", "--data-parallel-size", "2"]) == 0
    assert "on 4 devices, tensor parallel 2 x data parallel 2" in capsys.readouterr().out
    mesh = engines[-1].mesh
    assert dict(mesh.shape) == {"data": 2, "model": 2}
    qkv = engines[-1].model.params.layers[0].qkv
    assert qkv.addressable_shards[0].data.shape[1] == qkv.shape[1] // 2  # placed split at load
    assert cli.main([*argv, "-tp", "2"]) == 0 and dict(engines[-1].mesh.shape) == {"data": 1, "model": 2}
    assert cli.main([*argv, "-tp", "2", "--page-size", "16", "--num-pages", "12"]) == 0  # pages split by head
    assert "KV cache: 12 pages of 16 slots" in capsys.readouterr().out
    assert (
        cli.main([*argv, "-tp", "2", "-dp", "2", "--page-size", "16", "--num-pages", "12"]) == 0
    )  # and by page
    assert "KV cache: 2 data groups of 6 pages of 16 slots, 192 tokens" in capsys.readouterr().out
    for bad, message in (
        (["-tp", "4", "-dp", "4"], "4 x 4 = 16 devices, but this process has 8"),
        (["-dp", "3"], "max_batch=4: on a mesh the slots split over its 3 data groups"),
        (
            ["-dp", "2", "--page-size", "16", "--num-pages", "13"],
            "num_pages=13: on a mesh of 2 data groups the pool splits into equal parts, one a group; "
            "give a multiple of 2",
        ),
        (["-tp", "3"], "does not divide over the mesh axis 'model' of size 3"),
        (
            ["-tp", "2", "--speculative-config", '{"model": "x", "draft_tensor_parallel_size": 4}'],
            "draft_tensor_parallel_size=4: 1 .* or tensor_parallel_size=2",
        ),
    ):
        assert cli.main([*argv, *bad]) == 2
        assert re.search(message, capsys.readouterr().err), bad


def test_serve_roles_prefill_and_decode_apart(tiny_folder, monkeypatch, capsys):
    """--role prefill serves rows (POST /specjax/prefill), --role decode pulls them from
    --prefill-url; the URL goes with --role decode alone."""
    apps = []
    monkeypatch.setattr(specjax.serve.app.uvicorn, "run", lambda app, **_: apps.append(app))
    argv = ["serve", str(tiny_folder), "--max-batch", "2", "--max-model-len", "64", "--precompile", "-1"]
    assert cli.main([*argv, "--role", "prefill"]) == 0
    assert "/specjax/prefill" in {route.path for route in apps[-1].routes}
    assert cli.main([*argv, "--role", "decode", "--prefill-url", "http://127.0.0.1:9"]) == 0
    assert apps[-1].state.engine.prefiller.url == "http://127.0.0.1:9"
    assert cli.main([*argv]) == 0 and apps[-1].state.engine.prefiller is None
    for bad in (["--role", "decode"], ["--prefill-url", "http://x"]):
        assert cli.main([*argv, *bad]) == 2
        assert "a decode server needs the prefill server's URL" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# specjax generate


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_generate_matches_the_library(tiny_folder, capsys):
    """--json rows hold what specjax.generate returns for the same prompts (chat template on), and
    an n-gram proposer gives plain greedy's tokens (lossless)."""
    prompts = ["abcabcabc abc", "hello hello hello"]
    model = specjax.load(tiny_folder)
    plain = specjax.generate(model, prompts, max_new_tokens=12, chat=True)
    argv = ["generate", *prompts, "--model", str(tiny_folder), "--max-new-tokens", "12", "--json"]
    assert cli.main([*argv, "--proposer", "ngram", "--k", "3"]) == 0
    rows = json_lines(capsys.readouterr().out)
    assert [r["prompt"] for r in rows] == prompts
    assert [r["tokens"] for r in rows] == plain.tokens
    assert [r["text"] for r in rows] == plain.texts
    for r, tokens in zip(rows, plain.tokens, strict=True):
        assert r["metrics"]["num_speculative_tokens"] == 3
        assert r["metrics"]["num_emitted_tokens"] == len(tokens)  # this row's own count

    one = ["generate", prompts[0], "--model", str(tiny_folder), "--max-new-tokens", "12", "--no-chat"]
    assert cli.main(one) == 0  # one prompt, text output
    out, err = capsys.readouterr()
    no_chat = specjax.generate(model, prompts[0], max_new_tokens=12)
    assert out == no_chat.texts[0] + "\n"
    assert re.fullmatch(r"\d+ tokens in .* steps\n", err)  # the metrics line


def test_generate_proposer_json_and_shortcuts_agree(tiny_folder, capsys):
    argv = [
        "generate",
        "one two one two one",
        "--model",
        str(tiny_folder),
        "--max-new-tokens",
        "10",
        "--json",
    ]
    assert cli.main([*argv, "--proposer", '{"name": "self_draft", "layers": 1, "k": 2}']) == 0
    by_json = json_lines(capsys.readouterr().out)[0]
    assert cli.main([*argv, "--proposer", "self_draft", "--layers", "1", "--k", "2"]) == 0
    by_options = json_lines(capsys.readouterr().out)[0]
    assert by_json["tokens"] == by_options["tokens"]
    counts = ("steps", "num_draft_tokens", "num_accepted_tokens", "acceptance_length_histogram")
    assert [by_json["metrics"][c] for c in counts] == [by_options["metrics"][c] for c in counts]
    assert by_json["metrics"]["num_speculative_tokens"] == 2 and by_json["metrics"]["num_drafts"] > 0


def test_generate_samples_with_the_seed(tiny_folder, capsys):
    argv = ["generate", "abc", "--model", str(tiny_folder), "--max-new-tokens", "16", "--json"]
    argv += ["--temperature", "1.0", "--top-k", "50"]

    def tokens(seed):
        assert cli.main([*argv, "--seed", str(seed)]) == 0
        return json_lines(capsys.readouterr().out)[0]["tokens"]

    model = specjax.load(tiny_folder)
    sampling = specjax.Sampling(temperature=1.0, top_k=50)
    expected = specjax.generate(
        model, "abc", sampling=sampling, max_new_tokens=16, key=jax.random.key(5), chat=True
    )
    assert tokens(5) == expected.tokens[0]
    assert tokens(6) != expected.tokens[0]


def test_generate_reads_a_prompts_file(tiny_folder, tmp_path, capsys):
    file = tmp_path / "q.jsonl"
    file.write_text("".join(json.dumps({"text": f"question {i}", "turns": ["x"]}) + "\n" for i in range(5)))
    argv = ["generate", "first", "--prompts-file", str(file), "--field", "text", "--limit", "2"]
    argv += ["--model", str(tiny_folder), "--max-new-tokens", "4", "--batch-size", "2", "--json", "--no-chat"]
    assert cli.main(argv) == 0
    rows = json_lines(capsys.readouterr().out)
    assert [r["prompt"] for r in rows] == ["first", "question 0", "question 1"]
    model = specjax.load(tiny_folder)
    assert rows[2]["tokens"] == specjax.generate(model, "question 1", max_new_tokens=4).tokens[0]


# ---------------------------------------------------------------------------------------------
# specjax bench


def test_spec_bench_prompts_by_category(data_folder):
    prompts = bench.spec_bench_prompts(data_folder, 2, ["qa", "rag"])
    assert prompts == [
        ("qa", "What is the capital of France?"),
        ("qa", "Who wrote Hamlet?"),
        ("rag", "Given: the sky is blue. What colour is the sky?"),
    ]
    assert bench.data_dir(data_folder) == data_folder


def test_bench_table_arithmetic():
    """Means over prompts, speedups over plain and CSV columns, from known numbers."""
    result = bench.SpecBenchResult(
        methods=["plain", "NGram(k=2)", "peer"],
        speculative=["NGram(k=2)"],
        speeds={"qa": {"plain": [10.0, 30.0], "NGram(k=2)": [30.0, 50.0], "peer": [5.0, 5.0]}},
        taus={"qa": {"plain": [1.0, 1.0], "NGram(k=2)": [2.0, 3.0]}},
        accepted_at={"qa": {"NGram(k=2)": np.array([3, 1])}},
        reached_at={"qa": {"NGram(k=2)": np.array([4, 0])}},
        mismatches=[],
        prompts_per_category=2,
        max_new_tokens=8,
        repeats=1,
        chat=True,
    )
    header, rows = result.table()
    assert header == [
        "category", "plain tok/s", "NGram(k=2) tok/s", "peer tok/s",
        "NGram(k=2) speedup", "peer speedup", "NGram(k=2) tau",
    ]  # fmt: skip
    assert rows == [["qa", 20.0, 40.0, 5.0, 2.0, 0.25, 2.5]]
    table = list(csv.reader(io.StringIO(result.report("csv"))))
    assert table[0] == header + ["NGram(k=2) conditional acceptance per position"]
    assert table[1] == ["qa", "20.0", "40.0", "5.0", "2.0", "0.25", "2.5", "0.7500 nan"]
    markdown = result.report("markdown")
    assert "| qa | 20.00 | 40.00 | 5.00 | 2.00 | 0.25 | 2.50 |" in markdown
    assert "| qa | NGram(k=2) | 0.75 nan |" in markdown
    with pytest.raises(ValueError, match="--format must be markdown or csv"):
        result.report("html")
    # A head method's cells in a category its head trained on are marked; held-out ones are not.
    result.head_methods = ["NGram(k=2)"]
    assert result.table()[1][0][0] == "qa (trained)"
    assert "only the other rows are held out" in result.report("markdown")
    assert list(csv.reader(io.StringIO(result.report("csv"))))[1][-1] == "0.7500 nan"
    result.speeds["mt_bench"] = result.speeds.pop("qa")
    assert result.label("mt_bench") == "mt_bench"
    assert bench.uses_trained_head(specjax.Hybrid(specjax.NGram(k=2), WithHead(1)))
    assert not bench.uses_trained_head(specjax.Dynamic(specjax.NGram(k=2)))


def test_peers_run_in_specjaxs_rounds_from_plains_prompt_ids(tiny_folder):
    """A peer (llama.cpp, HF) is warmed up after specjax's methods and then timed in the same
    rounds as they are, one call each in turn (the machine's speed drifts: a peer timed after all
    of specjax's calls would meet another machine), and generates from the token ids of plain's
    prompt."""
    model = specjax.load(tiny_folder)
    seen = []

    def peer(ids):
        seen.append(list(ids))
        return 5

    ticks = []
    prompts = [("qa", "abc abc abc"), ("rag", "xyz")]
    methods = {"plain": None, "ngram": specjax.NGram(k=2)}
    result = bench.run_spec_bench(
        model, prompts, methods, max_new_tokens=8, repeats=2, peers={"peer": peer}, progress=ticks.append
    )
    assert [t.method for t in ticks] == ["plain", "ngram", "peer"] * 6
    for (category, text), calls in zip(prompts, (seen[:3], seen[3:]), strict=True):
        ids = specjax.chat_prompt_ids(model.tokenizer, [{"role": "user", "content": text}])
        assert calls == [ids] * 3
        assert [n for n, _ in result.rounds[category]["peer"]] == [5]
    assert result.methods == ["plain", "ngram", "peer"]


def test_run_spec_bench_ticks_and_catches_lossy_methods(tiny_folder):
    """One tick per generate call; a lossy method (forced acceptance) is reported as differing from
    plain greedy, a lossless one is not."""
    from specjax.speculate.proposers.forced import ForcedAcceptance

    model = specjax.load(tiny_folder)
    methods = {"plain": None, "ngram": specjax.NGram(k=2), "forced": ForcedAcceptance(1.0, k=3)}
    ticks = []
    prompts = [("qa", "abc abc abc"), ("rag", "xyz")]
    result = bench.run_spec_bench(model, prompts, methods, max_new_tokens=8, repeats=2, progress=ticks.append)
    assert [t.done for t in ticks] == list(range(1, 19)) and {t.total for t in ticks} == {18}
    # every method warmed up, then rounds that run each in turn
    assert [t.method for t in ticks[:9]] == ["plain", "ngram", "forced"] * 3
    assert [t.category for t in ticks] == ["qa"] * 9 + ["rag"] * 9
    assert result.mismatches == [("qa", "forced"), ("rag", "forced")]
    assert result.taus["qa"]["forced"] == [4.0]  # every draft accepted: k + 1 tokens per step
    for category, by_method in result.rounds.items():
        for name, runs in by_method.items():
            assert [len(seconds) for _, seconds in runs] == [2] * len(runs)
            speeds = [n / statistics.median(seconds) for n, seconds in runs]
            assert result.speeds[category][name] == pytest.approx(speeds)
    # a round's speedup: all its tokens over all its seconds, against plain's in the same round
    (n_plain, plain), (n_ngram, ngram) = result.rounds["qa"]["plain"][0], result.rounds["qa"]["ngram"][0]
    expected = [(n_ngram / ngram[r]) / (n_plain / plain[r]) for r in range(2)]
    assert result.round_speedups(["qa"], "ngram") == pytest.approx(expected)


def test_bench_command_on_a_tiny_model(tiny_folder, data_folder, tmp_path, capsys):
    out = tmp_path / "table.csv"
    options = (
        "--categories qa,rag --methods ngram,selfdraft --ngram-k 3 --ngram-n-min 2 --self-draft-layers 1 "
        "--self-draft-k 2 "
        "--per-category 2 --max-new-tokens 6 --repeats 1 --format csv"
    )
    argv = ["bench", "--model", str(tiny_folder), "--data", str(data_folder), "--out", str(out)]
    argv += options.split()
    assert cli.main(argv) == 0
    stdout, stderr = capsys.readouterr()
    assert out.read_text() == stdout
    table = list(csv.DictReader(io.StringIO(stdout)))
    assert [row["category"] for row in table] == ["qa", "rag"]
    for row in table:
        assert float(row["plain tok/s"]) > 0
        assert float(row["NGram(k=3, n_min=2) speedup"]) == pytest.approx(
            float(row["NGram(k=3, n_min=2) tok/s"]) / float(row["plain tok/s"])
        )
        assert 1.0 <= float(row["SelfDraft(layers=1, k=2) tau"]) <= 3.0
        assert len(row["SelfDraft(layers=1, k=2) conditional acceptance per position"].split()) == 2
    assert "spec-bench" in stderr and "18/18" in stderr  # 3 prompts x 3 methods x (warm-up + 1)
    assert f"wrote the table to {out}" in stderr


# ---------------------------------------------------------------------------------------------
# specjax ablate


def test_ablate_command_runs_a_tiny_sweep(tiny_folder, tmp_path, capsys):
    spec = tmp_path / "sweep.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(tiny_folder),
                "prompts": {"code": ["abc abc abc"], "chat": ["hello there"]},
                "proposers": [{"name": "ngram", "k": 2}],
                "max_new_tokens": 6,
                "chat": False,
            }
        )
    )
    out = tmp_path / "out"
    assert cli.main(["ablate", str(spec), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    import pandas as pd

    frame = pd.read_csv(out / "ablation.csv")
    assert sorted(set(frame["category"])) == ["chat", "code"] and sorted(set(frame["k"])) == [0, 2]
    assert f"table: {out / 'ablation.csv'} ({len(frame)} rows)" in stdout
    header, *rows = stdout.splitlines()[2:]  # the summary: a row per configuration
    assert header.split()[:3] == ["category", "proposer", "k"] and "speedup" in header
    assert len(rows) == len(frame) and sum("NGram(n_max=4, n_min=1)" in row for row in rows) == 2
    figures = sorted(out.glob("*.png"))
    assert figures and f"figures: {', '.join(str(f) for f in figures)}" in stdout


def test_ablate_bad_spec_is_one_line(tmp_path, capsys):
    spec = tmp_path / "sweep.yaml"
    spec.write_text("model: smollm2-135m\nproposers: [{name: nope}]\n")
    assert cli.main(["ablate", str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specjax ablate: error: ")


# ---------------------------------------------------------------------------------------------
# specjax train-medusa, train-eagle


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
    assert training_prompts(cli.train.training_options(args)) == (["a", "c", "d"], {"b"})
    assert read_prompts(str(train), "turns", None) == ["a", "b", "c", "d"]


def test_split_names_the_prompts_in_one_place(tmp_path):
    """--split reads the split's files from --split-data: the same split the benchmarks read."""
    split = bench.HEADS_SPLIT
    (tmp_path / split.prompts).write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("a", "b", "c")))
    (tmp_path / split.exclude).write_text(json.dumps({"turns": ["b"]}) + "\n")
    args = cli.parser().parse_args(
        ["train-eagle3", "--split", split.name, "--split-data", str(tmp_path), "--out", "x"]
    )
    assert training_prompts(cli.train.training_options(args)) == (["a", "c"], {"b"})
    assert split.training_prompts(tmp_path) == {"a", "c"}  # what the benchmarks check against
    for argv, message in [
        (["--split", "nope"], "--split: unknown split 'nope'; allowed: spec-bench-minus-mt-bench"),
        (["--split", split.name, "--prompts", "p.jsonl"], "drop --prompts/--exclude"),
        (["--split-data", str(tmp_path)], "give --split too"),
        (["--split", split.name, "--split-data", str(tmp_path / "none")], "no spec_bench_question.jsonl"),
    ]:
        args = cli.parser().parse_args(["train-eagle3", *argv, "--out", "x"])
        with pytest.raises(ValueError, match=re.escape(message)):
            training_prompts(cli.train.training_options(args))
    assert not split.trained_on("mt_bench") and split.trained_on("qa")


@pytest.mark.data
def test_heads_split_is_the_data_and_the_committed_heads():
    """HEADS_SPLIT's training prompts are every question of its trained categories and none of
    MT-bench's (what the "(trained)" marks assume), and each committed head records that split."""
    from conftest import data_file

    folder = data_file(bench.HEADS_SPLIT.exclude).parent
    trained = bench.HEADS_SPLIT.training_prompts(folder)
    every = bench.spec_bench_prompts(folder, per_category=1000)
    assert {c for c, text in every if text in trained} == set(bench.HEADS_SPLIT.trained_categories)
    assert all(text in trained for c, text in every if bench.HEADS_SPLIT.trained_on(c))
    assert not any(text in trained for c, text in every if c == "mt_bench")
    heads = Path(__file__).resolve().parent.parent / "heads"
    for kind in bench.HEAD_FOLDERS:
        folder = heads / kind / "head"
        text = (
            (folder / "head.json") if (folder / "head.json").is_file() else folder / "config.json"
        ).read_text()
        assert f'"split": "{bench.HEADS_SPLIT.name}"' in text, kind


def test_heads_say_what_they_trained_on():
    """The Spec-Bench report marks rows by the split its heads record, and names it; heads of no one
    named split mark no row and say what each trained on."""
    split_head = SimpleNamespace(meta={"split": bench.HEADS_SPLIT.name, "self_instruct_prompts": 800})
    other_head = SimpleNamespace(meta={"prompts_file": "../data/mine.jsonl"})
    hybrid = specjax.Hybrid(specjax.NGram(k=2), WithHead(split_head))
    assert bench.heads_of(hybrid) == [split_head] and bench.split_of(split_head) is bench.HEADS_SPLIT
    assert bench.training_of(split_head).endswith("and 800 chat prompts the target wrote itself")
    assert bench.split_of(other_head) is None
    assert bench.training_of(other_head) == "the prompts of mine.jsonl"
    assert bench.training_of(SimpleNamespace(meta={})) == "prompts its meta does not name"

    def result(category, split, training):
        return bench.SpecBenchResult(
            methods=["plain", "H"], speculative=["H"], speeds={category: {"plain": [1.0], "H": [1.0]}},
            taus={category: {"plain": [1.0], "H": [1.0]}}, accepted_at={category: {"H": np.array([1])}},
            reached_at={category: {"H": np.array([1])}}, mismatches=[], prompts_per_category=1,
            max_new_tokens=4, repeats=1, chat=True, head_methods=["H"], split=split,
            head_training={"H": bench.training_of(training)},
        )  # fmt: skip

    marked = result("qa", bench.HEADS_SPLIT, split_head)
    assert marked.label("qa") == "qa (trained)" and "800 chat prompts" in marked.report()
    assert "| qa (trained) |" in marked.report()
    unmarked = result("qa", None, other_head)
    assert unmarked.label("qa") == "qa" and "H: the prompts of mine.jsonl" in unmarked.report()
    assert "every row here is held out" in result("mt_bench", bench.HEADS_SPLIT, split_head).report()


@pytest.fixture
def tiny_target(monkeypatch):
    """The commands see a tiny model whose generate takes the prompts as plain id lists (a tiny
    character tokenizer would need a chat template); `generated` counts the generate calls. The
    pipeline (specjax.train.pipeline) and the tests themselves (specjax.generate) see the same."""
    tiny = SimpleNamespace(model=tiny_model(seed=11), generated=0)
    real_generate = specjax.generate

    def generate(model, prompts, **kw):
        tiny.generated += 1
        return real_generate(model, [[ord(c) % 97 for c in p] for p in prompts], **{**kw, "chat": False})

    for module in (specjax, specjax.train.pipeline):
        monkeypatch.setattr(module, "load", lambda name: tiny.model)
        monkeypatch.setattr(module, "generate", generate)
    return tiny


def _argv(command, tmp_path, out, *extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"prompt number {i}"]}) + "\n" for i in range(6)))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"turns": ["prompt number 3"]}) + "\n")
    argv = [command, "--prompts", str(prompts), "--exclude", str(held), "--out", str(out)]
    options = ["--steps", "5", "--new-tokens", "8", "--max-len", "32", "--batch-size", "4"]
    return argv + options + ["--generate-batch-size", "4", *extra]


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


@pytest.mark.slow  # make test-all: the default suite keeps within its 20 minutes
def test_train_eagle3_and_dflash_commands_share_the_set(tmp_path, tiny_target):
    """Both train on one distillation set and save speculators folders that load_head reads."""
    data_file = tmp_path / "set.npz"
    eagle3 = ["--draft-vocab", "16", "--unroll", "2", "--data", str(data_file)]
    assert cli.main(_argv("train-eagle3", tmp_path, tmp_path / "eagle3", *eagle3)) == 0
    dflash = ["--draft-vocab", "16", "--block", "4", "--anchors", "3", "--data", str(data_file)]
    assert cli.main(_argv("train-dflash", tmp_path, tmp_path / "dflash", *dflash)) == 0
    assert tiny_target.generated == 2  # generated once, for the first
    heads = [load_head(tmp_path / name / "head", tiny_target.model) for name in ("eagle3", "dflash")]
    assert isinstance(heads[0], specjax.models.Eagle3Head) and heads[0].meta["unroll"] == 2
    assert isinstance(heads[1], specjax.models.DFlashHead) and heads[1].config.block_size == 4
    assert (tmp_path / "dflash" / "head" / "config.json").is_file()  # the speculators format
    plain = specjax.generate(tiny_target.model, ["abc"], max_new_tokens=8).tokens
    for proposer in (specjax.Eagle3(heads[0], k=2), specjax.DFlash(heads[1])):
        assert (
            specjax.generate(tiny_target.model, ["abc"], proposer=proposer, max_new_tokens=8).tokens == plain
        )


@pytest.mark.slow  # ~60 s on a loaded machine: two trainings and an MTP program compiled
def test_train_mtp_and_mlp_speculator_commands_share_the_set(tmp_path, tiny_target):
    """Both draft from the whole vocabulary (no --draft-vocab); the MTP layers load with their
    target and draft through specjax.MTP over model.with_mtp."""
    data_file = tmp_path / "set.npz"
    mtp = ["--layers", "2", "--positions", "4", "--data", str(data_file)]
    assert cli.main(_argv("train-mtp", tmp_path, tmp_path / "mtp", *mtp)) == 0
    mlp = ["--n-predict", "2", "--positions", "0", "--data", str(data_file)]
    assert cli.main(_argv("train-mlp-speculator", tmp_path, tmp_path / "mlp", *mlp)) == 0
    assert tiny_target.generated == 2  # generated once, for the first
    model = tiny_target.model
    layers = load_head(tmp_path / "mtp" / "head", model)
    assert isinstance(layers, specjax.models.MTPLayers) and len(layers.layers) == 2
    assert layers.meta["positions_per_sequence"] == 4 and layers.meta["num_prompts"] == 5
    speculator = load_head(tmp_path / "mlp" / "head", model)
    assert isinstance(speculator, specjax.models.MLPSpeculatorHead) and speculator.config.n_predict == 2
    assert speculator.meta["positions_per_sequence"] is None  # --positions 0: every position
    plain = specjax.generate(model, ["abc"], max_new_tokens=8).tokens
    drafted = specjax.generate(model.with_mtp(layers), ["abc"], proposer=specjax.MTP(k=2), max_new_tokens=8)
    assert drafted.tokens == plain
    assert cli.main(_argv("train-mtp", tmp_path, tmp_path / "x", "--draft-vocab", "16")) == 2


def test_self_instruct_prompts_join_the_file_prompts(tmp_path, tiny_target, monkeypatch):
    calls = []

    def write(model, num_prompts, seed, exclude):
        calls.append((num_prompts, seed, set(exclude)))
        return [f"written prompt {i}" for i in range(num_prompts)]

    monkeypatch.setattr(specjax.train.pipeline, "self_instruct_prompts", write)
    data_file = tmp_path / "set.npz"
    argv = _argv("train-medusa", tmp_path, tmp_path / "out", "--self-instruct", "3", "--seed", "7")
    assert cli.main([*argv, "--heads", "1", "--data", str(data_file)]) == 0
    file_prompts = {f"prompt number {i}" for i in (0, 1, 2, 4, 5)}
    assert calls == [(3, 7, file_prompts | {"prompt number 3"})]  # never the held-out or file ones
    assert DistillationData.load(data_file).num_sequences == 8
    head = load_head(tmp_path / "out" / "head", tiny_target.model)
    assert head.meta["num_prompts"] == 8 and head.meta["self_instruct_prompts"] == 3


@pytest.mark.parametrize("command", COMMANDS)
def test_training_needs_prompts_from_somewhere(command, tmp_path, tiny_target, capsys):
    assert cli.main([command, "--out", str(tmp_path)]) == 2
    assert (
        "give training prompts: --prompts FILE.jsonl or --split NAME, --self-instruct N, or both"
        in capsys.readouterr().err
    )
    assert cli.main([command, "--out", str(tmp_path), "--self-instruct", "-1"]) == 2
    assert "argument --self-instruct: must be an integer >= 0, got '-1'" in capsys.readouterr().err
    assert cli.main([command, "--out", str(tmp_path), "--self-instruct", "2"]) == 2  # a tiny model
    assert "has no tokenizer with a chat template" in capsys.readouterr().err
    assert tiny_target.generated == 0


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
