"""Constrained requests in the engine (Sampling(regex=, json_schema=, choice=); EngineConfig's
constraint_states and constraint_edges): requests with different constraints and free ones run
side by side, each greedy answer what `generate` gives it alone, and new constraints come and go
in the fixed-size tables without a compile (serve/engine_automata.py)."""

import json
import re

import numpy as np
import pytest
from test_engine import drive
from test_structured import EOS, REGEX, SCHEMA, TARGET, output_text, proposers

import specjax
from specjax import Request
from specjax.serve.engine_automata import ConstraintPool
from specjax.speculate.grammar import compile_constraint, constraint_regex

CHOICES = ["yes", "no", "maybe"]
FIELDS = [dict(regex=REGEX), dict(json_schema=SCHEMA), dict(choice=CHOICES), {}]


def ids(text: str) -> list[int]:
    return [ord(c) - 32 for c in text]  # tiny_tokenizer's ids


def alone(request: Request, proposer) -> list[int]:
    result = specjax.generate(TARGET, [request.prompt], proposer, request.sampling, request.max_new_tokens)
    return result.tokens[0]


def check_output(fields: dict, tokens: list[int]) -> None:
    text, ended = output_text(tokens)
    if not fields:
        return
    assert ended, (fields, text)
    if "regex" in fields:
        assert re.fullmatch(REGEX, text), text
    elif "choice" in fields:
        assert text in CHOICES, text
    else:
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("name", ["plain", "ngram", "eagle-tree"])
def test_constrained_and_free_requests_side_by_side_equal_generate_alone(name):
    """Six requests through two slots: each constraint's rows and free rows interleave, arriving
    at random steps; every greedy answer is `generate`'s for its prompt alone, matching its
    constraint; a second round with the same constraints compiles nothing. Chains and a token
    tree (each node masked along its own path)."""
    proposer = {"plain": None, "ngram": specjax.NGram(k=3, n_max=3, n_min=1)}.get(name)
    if name == "eagle-tree":
        proposer = proposers()[name]
    engine = specjax.Engine(
        TARGET, proposer, max_batch=2, max_model_len=64, chunk_steps=3, constraint_states=256
    )
    prompts = ["12 cats", "x", "hello there", "a b", "name:", "ok?"]
    requests = [
        Request(ids(p), specjax.Sampling(**FIELDS[i % len(FIELDS)]), max_new_tokens=30)
        for i, p in enumerate(prompts)
    ]
    tokens, finals = drive(engine, requests, seed=5)
    for i, request in enumerate(requests):
        assert tokens[i] == alone(request, proposer), (i, FIELDS[i % len(FIELDS)])
        check_output(FIELDS[i % len(FIELDS)], tokens[i])
    compiled = engine.num_compiles
    again, _ = drive(engine, requests[::-1], seed=6)
    assert engine.num_compiles == compiled
    assert [again[i] for i in range(len(requests))] == [tokens[len(requests) - 1 - i] for i in range(6)]
    if proposer is not None:  # drafts were verified, and accepted in part
        accepted = sum(int(u.metrics.accepted.sum()) for u in finals.values())
        drafted = sum(int(u.metrics.drafted.sum()) for u in finals.values())
        assert 0 < accepted < drafted, (accepted, drafted)


def test_a_constraint_that_does_not_fit_beside_the_running_ones_waits():
    """Tables that hold one of two automata at a time: the second request waits for the first to
    end, then runs in the room it left (the unused automaton evicted), and both answers are
    generate's; a constraint that could never fit is refused naming the budget."""
    regexes = [r"[0-9]{6}", r"(yes|no)-[a-c]{5}"]
    sizes = [
        compile_constraint(r, TARGET.tokenizer, TARGET.config.vocab_size, [EOS]).num_states for r in regexes
    ]
    budget = max(sizes) + min(sizes) - 1  # either alone, never both
    engine = specjax.Engine(TARGET, max_batch=2, max_model_len=64, constraint_states=budget)
    requests = [Request(ids("go"), specjax.Sampling(regex=r), max_new_tokens=12) for r in regexes]
    first, second = (engine.add(r) for r in requests)
    tokens = {first: [], second: []}
    for update in engine.step():
        tokens[update.request_id] += update.tokens
    assert engine.num_running == 1 and engine.num_waiting == 1  # a slot is free, the tables are not
    while engine.has_work:
        for update in engine.step():
            tokens[update.request_id] += update.tokens
    assert tokens[first] == alone(requests[0], None) and tokens[second] == alone(requests[1], None)
    assert re.fullmatch(regexes[1], output_text(tokens[second])[0])
    with pytest.raises(ValueError, match=r"automaton has \d+ states .* tables hold \d+ states"):
        engine.add(Request(ids("go"), specjax.Sampling(regex=f"[0-9]{{{2 * budget}}}"), max_new_tokens=4))


def test_an_engine_without_tables_refuses_constrained_requests():
    engine = specjax.Engine(TARGET, max_batch=1, max_model_len=64)
    with pytest.raises(ValueError, match=r"built without constraint tables.*constraint_states"):
        engine.add(Request(ids("go"), specjax.Sampling(choice=CHOICES), max_new_tokens=4))
    with pytest.raises(ValueError, match="constraint_states must be an integer >= 1, got 0"):
        specjax.EngineConfig(constraint_states=0)


def test_the_pool_places_shares_and_evicts_automata():
    """First fit in the state space, one placement per distinct regex however many rows use it,
    unused automata kept until their room is needed (least recently used first), and the
    device tables' transitions those of the placed automata at their offsets."""
    vocab = TARGET.config.vocab_size
    regexes = [r"[a-c]{6}", r"[0-9]{3}", constraint_regex(None, None, ["ab", "cd"])]
    sizes = [compile_constraint(r, TARGET.tokenizer, vocab, [EOS]).num_states for r in regexes]
    assert sizes[2] <= sizes[0]  # the third fits where the first was
    pool = ConstraintPool(TARGET.tokenizer, vocab, [EOS], max_states=sizes[0] + sizes[1], max_edges=4096)
    a = pool.acquire(regexes[0])
    assert pool.acquire(regexes[0]) == a == 0  # shared
    b = pool.acquire(regexes[1])
    assert b == sizes[0]
    assert not pool.can_place(regexes[2])  # every state in use
    pool.release(regexes[0])
    assert not pool.can_place(regexes[2])  # still used once
    pool.release(regexes[0])
    assert pool.can_place(regexes[2])  # the unused automaton's room
    assert pool.acquire(regexes[2]) == 0 and pool.acquire(regexes[1]) == b  # b never moved
    grammar = pool.grammar([b, -1])
    keys = np.asarray(grammar.edge_keys)
    real = keys[keys != np.iinfo(np.int32).max]
    assert (np.diff(real) > 0).all()
    expected = sum(len(compile_constraint(r, TARGET.tokenizer, vocab, [EOS]).tokens) for r in regexes[1:])
    assert len(real) == expected
    assert np.asarray(grammar.start).tolist() == [b, -1]
