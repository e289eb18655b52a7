"""The declared proposer protocol (specjax/speculate/proposers/protocol.py): nothing in the package
probes a proposer for members, wrappers forward every method of it, the loop knows no concrete
proposer, the registry is what the names, the server and the docs list, and docs/proposers.md's
example proposer runs through generate, the engine and export_generate."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from tiny import tiny_model

import specjax
from specjax.speculate.proposers import Capabilities, ProposerSpec, Wrapper, registry

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "specjax"
DOCS = REPO / "docs" / "proposers.md"

# The modules that handle proposers: none may ask a proposer (or anything) whether it has a
# member. Elsewhere no probe may name a proposer, a spec or a part of one.
PROPOSER_USERS = (
    "speculate",
    "api.py",
    "planner.py",
    "export.py",
    "serve",
    "named.py",
    "costs.py",
    "bench.py",
)
PROPOSER_WORDS = re.compile(r"proposer|spec|inner|part|first|then|head|schedule", re.I)


def probes(path: Path):
    """(line, source) of every hasattr call and getattr call with a default in a module."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3):
                yield node.lineno, ast.unparse(node)


def test_nothing_probes_a_proposer_for_its_members():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        user = relative.startswith(PROPOSER_USERS)
        for line, source in probes(path):
            if user or PROPOSER_WORDS.search(source.split(",")[0]):
                found.append(f"specjax/{relative}:{line}: {source}")
    assert not found, "\n".join(found)


def test_a_wrapper_forwards_every_method_of_the_protocol():
    """A method added to ProposerSpec must be forwarded by Wrapper, or a wrapper loses it."""
    methods = {
        name
        for name, value in vars(ProposerSpec).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }
    assert methods - set(vars(Wrapper)) == set()


def test_the_loop_imports_no_concrete_proposer():
    imported = [
        node.module
        for node in ast.walk(ast.parse((PACKAGE / "speculate" / "loop.py").read_text()))
        if isinstance(node, ast.ImportFrom) and node.module.startswith("specjax.speculate.proposers")
    ]
    assert imported == ["specjax.speculate.proposers.protocol"]


def test_every_capability_is_documented():
    text = DOCS.read_text()
    for field in dataclasses.fields(Capabilities):
        assert f"| `{field.name}` |" in text, field.name
        assert field.metadata["doc"], field.name


def test_the_docs_table_is_the_registry():
    """docs/proposers.md lists every registered proposer, with its method and its line, in order."""
    table = DOCS.read_text().split("## The proposers that ship")[1].split("\n## ")[0]
    cells = [[c.strip().strip("`") for c in line.split("|")[1:-1]] for line in table.splitlines()]
    listed = [tuple(row) for row in cells if len(row) == 4 and row[0] not in ("name", "---")]
    expected = [
        (
            e.name,
            "(none)" if e.proposer is None else e.proposer.__name__,
            e.method or "",
            e.summary,
        )
        for e in registry.ENTRIES
    ]
    assert listed == expected


def test_names_and_methods_are_the_registrys():
    from specjax.named import PROPOSER_NAMES
    from specjax.serve.config import METHOD_KEYS

    assert PROPOSER_NAMES == tuple(e.name for e in registry.ENTRIES)
    assert [m for m in METHOD_KEYS if m != "specjax"] == [e.method for e in registry.ENTRIES if e.method]
    for entry in registry.ENTRIES:
        if entry.method is not None:
            assert METHOD_KEYS[entry.method] == entry.method_keys


def docs_example() -> dict:
    """The docs' example proposer, run as written: the names it defines."""
    code = re.search(r"## Write your own proposer.*?```python\n(.*?)```", DOCS.read_text(), re.S).group(1)
    assert len(code.splitlines()) <= 40
    names: dict = {}
    exec(compile(code, str(DOCS), "exec"), names)
    return names


MODEL = tiny_model(seed=3, num_layers=2)
PROMPTS = [[4, 8, 15, 16, 23, 42, 4, 8, 15], [7, 7, 7, 1, 2]]


@pytest.fixture(scope="module")
def table_proposer():
    """The docs' Table proposer with a table that is right about half the time: the model's own
    greedy continuations of the prompts, every other entry left out (-1)."""
    Table = docs_example()["Table"]
    plain = specjax.generate(MODEL, PROMPTS, max_new_tokens=16)
    table = np.full((MODEL.config.vocab_size, 3), -1, np.int32)
    for prompt, new in zip(PROMPTS, plain.tokens, strict=True):
        sequence = prompt + new
        for i, token in enumerate(sequence[:-3]):
            if i % 2 == 0:
                table[token] = sequence[i + 1 : i + 4]
    return Table(table), plain


def test_the_docs_example_generates_losslessly(table_proposer):
    proposer, plain = table_proposer
    result = specjax.generate(MODEL, PROMPTS, proposer=proposer, max_new_tokens=16)
    assert result.tokens == plain.tokens
    assert (
        result.metrics.accepted.sum() > 0 and result.metrics.drafting_steps.sum() < result.metrics.steps.sum()
    )


def test_the_docs_example_serves_in_the_engine(table_proposer):
    proposer, plain = table_proposer
    engine = specjax.Engine(MODEL, proposer, max_batch=2, max_model_len=64, chunk_steps=4)
    tokens = engine.run([specjax.serve.Request(p, max_new_tokens=16) for p in PROMPTS])
    assert list(tokens.values()) == plain.tokens


def test_the_docs_example_exports(table_proposer):
    proposer, _ = table_proposer
    exported = specjax.export_generate(
        MODEL, PROMPTS, platforms=("cuda", "tpu"), proposer=proposer, max_new_tokens=8
    )
    assert exported.platforms == ("cuda", "tpu")
    assert "specjax_" not in exported.mlir_module()  # no CPU kernel in an accelerator's program


def test_a_proposer_that_is_not_one_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Probed:  # spec() and params() methods, but no declared protocol
        def spec(self, target, warp=None, mesh=None):
            return specjax.NGram()

        def params(self, target):
            return None

    with pytest.raises(ValueError, match="subclass of specjax.Proposer"):
        specjax.generate(MODEL, PROMPTS, proposer=Probed(), max_new_tokens=2)

    class NotASpec(specjax.speculate.proposers.Proposer):
        def spec(self, target, warp=None, mesh=None):
            return "ngram"

    with pytest.raises(ValueError, match="must return a specjax.ProposerSpec, got str"):
        specjax.generate(MODEL, PROMPTS, proposer=NotASpec(), max_new_tokens=2)


def test_capabilities_combine_by_their_rules():
    chain, tree = Capabilities(), Capabilities(tree=specjax.TokenTree.top_k((2, 1)), always_drafts=True)
    with pytest.raises(ValueError, match="Wrapped: its parts differ in tree"):
        Capabilities.combine({"a": chain, "b": tree}, "Wrapped")
    lookup = Capabilities(always_drafts=False, narrows=True, stateless=True)
    head = Capabilities(target_features=(0, 2), catches_up=True, accepts=4)
    both = Capabilities.combine({"a": lookup, "b": head}, "Wrapped")
    assert both.always_drafts and both.target_features == (0, 2) and both.accepts == 4
    assert not (both.narrows or both.stateless or both.catches_up)
    assert Capabilities.combine({"a": lookup}, "Wrapped", always_drafts=True).narrows
    with pytest.raises(ValueError, match="differ in target_features"):
        Capabilities.combine({"a": head, "b": Capabilities(target_features=(1,))}, "Wrapped")
