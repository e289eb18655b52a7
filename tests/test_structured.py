"""Structured output (Sampling(regex=...), json_schema, choice) inside the compiled loop: every
output matches its constraint, greedy speculative output equals plain constrained greedy, sampled
output follows the target's law restricted to the grammar (exact enumeration against a reference
that reads the constraint's language, not the library's automaton), mixed batches, one program
for constraints of one budget, no host callback."""

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from laws import assert_sequence_law
from tiny import tiny_model, tiny_tokenizer

import specjax
from specjax import programs
from specjax.models import EagleHead, forward, init_cache
from specjax.speculate import grammar as grammar_module
from specjax.speculate.loop import GenerationInputs, LoopSpec, generate_program
from specjax.speculate.sampling import SamplingParams, WarpSpec
from specjax.speculate.tree import TokenTree

BASE = tiny_model(seed=21)
TARGET = specjax.Model(BASE.config, BASE.params, tiny_tokenizer(), name="tiny-structured")
_DRAFT = tiny_model(seed=22, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=48)
DRAFT = specjax.Model(_DRAFT.config, _DRAFT.params, TARGET.tokenizer, name="tiny-structured-draft")
EOS = 96  # tiny_tokenizer's "<eos>"; ids 0..94 are chr(32 + id), 95 is "ab"
PROMPTS = ["12 cats", "x", "hello there"]


def text_of(token: int) -> str:
    return "ab" if token == 95 else chr(32 + token)


def output_text(tokens) -> tuple[str, bool]:
    """(the text before EOS, whether the row ended with EOS)."""
    ended = bool(tokens) and tokens[-1] == EOS
    return "".join(text_of(t) for t in (tokens[:-1] if ended else tokens)), ended


def proposers():
    return {
        "none": None,
        "ngram": specjax.NGram(k=3, n_max=3, n_min=1),
        "draft": specjax.DraftModel(DRAFT, k=3),
        "eagle": specjax.Eagle(EagleHead.init(TARGET, jax.random.key(0)), k=3),
        # a token tree: every node's target distribution masked along its own path
        "eagle-tree": specjax.Eagle(EagleHead.init(TARGET, jax.random.key(0)), tree=TokenTree.top_k((3, 2))),
    }


def generate(proposer, sampling, prompts=PROMPTS, max_new_tokens=12, **options):
    return specjax.generate(
        TARGET, prompts, proposer=proposer, sampling=sampling, max_new_tokens=max_new_tokens, **options
    )


# ---------------------------------------------------------------------------------------------
# At the door


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(regex="a", choice=["a"]), "at most one of regex, json_schema and choice, got regex, choice"),
        (dict(regex=""), "regex must be a non-empty string"),
        (dict(regex=3), "regex must be a non-empty string"),
        (dict(choice="abc"), "choice must be a non-empty list of non-empty strings"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(choice=["a", ""]), "choice must be a non-empty list of non-empty strings"),
        (
            dict(json_schema={"type": "strin"}),
            "json_schema is not a schema specjax can compile: Unsupported type",
        ),
        (dict(json_schema=5), "json_schema must be a dict or a JSON string"),
        (dict(json_schema="{not json"), "json_schema is not JSON"),
        (
            dict(json_schema={"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}),
            "json_schema uses 'minimum' (at /properties/age), which outlines-core's compiler",
        ),
        (
            dict(json_schema={"anyOf": [{"type": "null"}, {"type": "array", "uniqueItems": True}]}),
            "json_schema uses 'uniqueItems' (at /anyOf/1)",
        ),
        (dict(regex="a", compact_json=True), "compact_json=True shapes a json_schema's whitespace"),
        (dict(json_schema={"type": "object"}, compact_json=1), "compact_json must be True or False, got 1"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        specjax.Sampling(**fields)


def test_a_property_named_like_a_keyword_is_not_taken_for_one():
    """Property names are not keywords: a property called "minimum" compiles."""
    schema = {"type": "object", "properties": {"minimum": {"type": "boolean"}}, "required": ["minimum"]}
    assert specjax.Sampling(json_schema=schema).constraint == '\\{[ ]?"minimum"[ ]?:[ ]?(true|false)[ ]?\\}'


def test_a_regex_the_vocabulary_cannot_spell_is_refused():
    with pytest.raises(ValueError, match=re.escape("regex 'é+' cannot be compiled over the vocabulary")):
        generate(None, specjax.Sampling(regex="é+"))


def test_a_constraint_over_the_budget_is_refused(monkeypatch):
    monkeypatch.setattr(grammar_module, "MAX_STATES", 8)
    with pytest.raises(ValueError, match=r"need \d+ states, more than the budget of 8"):
        generate(None, specjax.Sampling(regex="[0-9]{20}"))


def test_a_constraint_needs_a_tokenizer():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        specjax.generate(BASE, [[1, 2]], sampling=specjax.Sampling(regex="a"), max_new_tokens=2)


# ---------------------------------------------------------------------------------------------
# Outputs match their constraints; speculation changes nothing at temperature 0

REGEX = r"[0-9]{2,4}(ab|cd)?-[a-c]+"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 3}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}


@functools.cache
def plain_greedy(constraint: str):
    return generate(None, specjax.Sampling(**json.loads(constraint)), max_new_tokens=30).tokens


@pytest.mark.parametrize("name", ["none", "ngram", "draft", "eagle", "eagle-tree"])
def test_greedy_speculation_equals_plain_constrained_greedy(name):
    accepted = drafted = 0
    for fields in (dict(regex=REGEX), dict(json_schema=SCHEMA), dict(choice=["yes", "no", "maybe"])):
        result = generate(proposers()[name], specjax.Sampling(**fields), max_new_tokens=30)
        assert result.tokens == plain_greedy(json.dumps(fields)), (name, fields)
        accepted += int(result.metrics.accepted.sum())
        drafted += int(result.metrics.drafted.sum())
        for tokens in result.tokens:
            text, ended = output_text(tokens)
            assert ended, (fields, text)
            if "regex" in fields:
                assert re.fullmatch(REGEX, text), text
            elif "choice" in fields:
                assert text in fields["choice"], text
            else:
                jsonschema = pytest.importorskip("jsonschema")
                jsonschema.validate(json.loads(text), SCHEMA)
    if name != "none":  # drafts were verified and accepted in part
        assert 0 < accepted < drafted, (name, accepted, drafted)


@pytest.mark.parametrize("name", ["none", "ngram", "draft"])
def test_sampled_outputs_match_their_constraint(name):
    """Sampled rows (the draft model's drafts are sampled from its unmasked law) never leave the
    language."""
    sampling = specjax.Sampling(regex=REGEX, temperature=1.0)
    result = generate(
        proposers()[name], sampling, prompts=PROMPTS * 8, max_new_tokens=16, key=jax.random.key(3)
    )
    for tokens in result.tokens:
        text, ended = output_text(tokens)
        if ended:
            assert re.fullmatch(REGEX, text), text
        else:  # cut at max_new_tokens: a prefix of the language
            assert re.fullmatch(r"[0-9]{0,4}|[0-9]{2,4}(a|ab|c|cd)?(-[a-c]*)?", text), text


def test_greedy_constrained_output_is_the_restricted_argmax():
    """Plain constrained greedy against a reference that takes the argmax over the tokens that keep
    the text a prefix of the (finite) language, EOS where the text is in it."""
    language = ["n", "no", "yes", "nope", "nab"]  # prefixes of later ones, and accepting on the way
    result = generate(None, specjax.Sampling(choice=language), max_new_tokens=8)
    for prompt, tokens in zip(PROMPTS, result.tokens, strict=True):
        out = []
        while not out or out[-1] != EOS:
            probs = restricted_probs(list(TARGET.tokenizer(prompt)["input_ids"]) + out, out, language, 1.0)
            out.append(int(np.argmax(probs)))
        assert tokens == out


# ---------------------------------------------------------------------------------------------
# The law: the target's, restricted to the grammar and renormalised at each step


@functools.cache
def _last_logits_fn():
    @jax.jit
    def last_logits(tokens, length):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        cache = init_cache(TARGET.config, 1, tokens.shape[1])
        return forward(TARGET.params, TARGET.config, tokens, positions, cache)[0][0, length - 1]

    return last_logits


def next_logits(sequence) -> np.ndarray:
    padded = np.zeros((1, 64), np.int32)
    padded[0, : len(sequence)] = sequence
    return np.asarray(_last_logits_fn()(jnp.asarray(padded), len(sequence)), np.float64)


def restricted_probs(sequence, generated, language, temperature) -> np.ndarray:
    """The next token's law [V]: softmax(logits / T) over the tokens that keep the generated text
    a prefix of a word of the language, and EOS when the text is a word of it."""
    text = "".join(text_of(t) for t in generated)
    allowed = np.zeros(TARGET.config.vocab_size, bool)
    for v in range(EOS):
        allowed[v] = any(w.startswith(text + text_of(v)) for w in language)
    allowed[EOS] = text in language
    x = np.where(allowed, next_logits(sequence) / temperature, -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


def restricted_joint(prompt_ids, language, temperature):
    """{token sequence (EOS included): probability} by enumeration."""
    joint, done = {(): 1.0}, {}
    while joint:
        grown = {}
        for prefix, prob in joint.items():
            p = restricted_probs(list(prompt_ids) + list(prefix), prefix, language, temperature)
            for token in np.flatnonzero(p > 0):
                seq = prefix + (int(token),)
                (done if token == EOS else grown)[seq] = prob * p[token]
        joint = grown
    return done


# (the draft model's law, 55 s here, runs in make test-all)
@pytest.mark.parametrize(
    "name", ["none", "ngram", "eagle-tree", pytest.param("draft", marks=pytest.mark.slow)]
)
def test_sampled_output_follows_the_restricted_law(name):
    """2,000 rows of `(a|b|ab)c?` at temperature 1 (the language's six words, reached by 8 token
    sequences as "ab" is one token or two) against exact enumeration; tests/laws.py's G-test and
    per-cell bounds."""
    # "a" before "ab", and "a" an accepting prefix of "ac": the two ways outlines-core's own index
    # loses words (specjax/speculate/grammar.py, compile_constraint)
    regex, language = r"(a|b|ab)c?", ["a", "b", "ab", "ac", "bc", "abc"]
    prompt = "ab c"
    prompt_ids = TARGET.tokenizer(prompt)["input_ids"]
    joint = restricted_joint(prompt_ids, language, 1.0)
    assert len(joint) == 8 and abs(sum(joint.values()) - 1) < 1e-9
    rows = 2000
    result = specjax.generate(
        TARGET,
        [prompt] * rows,
        proposer=proposers()[name],
        sampling=specjax.Sampling(regex=regex, temperature=1.0),
        max_new_tokens=5,
        key=jax.random.key(7),
    )
    assert_sequence_law(result.tokens, joint, f"{name}: {regex}")


# ---------------------------------------------------------------------------------------------
# Batches, programs


def test_mixed_batch_of_constrained_and_free_rows():
    free = specjax.Sampling()
    samplings = [specjax.Sampling(regex=REGEX), free, specjax.Sampling(choice=["no", "yes"]), free]
    prompts = ["12 cats", "x", "hello there", "a b"]
    for proposer in (None, specjax.NGram(k=3, n_max=3, n_min=1)):
        mixed = generate(proposer, samplings, prompts=prompts, max_new_tokens=20)
        alone = generate(None, free, prompts=prompts, max_new_tokens=20)
        assert mixed.tokens[1] == alone.tokens[1] and mixed.tokens[3] == alone.tokens[3]
        assert re.fullmatch(REGEX, output_text(mixed.tokens[0])[0])
        assert output_text(mixed.tokens[2])[0] in ("no", "yes")


def test_a_second_constraint_of_the_same_budget_does_not_recompile():
    proposer = specjax.NGram(k=3, n_max=3, n_min=1)
    generate(proposer, specjax.Sampling(regex=r"[0-9]{3}"), max_new_tokens=8)
    count = programs.compiled_program_count()
    other = generate(proposer, specjax.Sampling(regex=r"(yes|no)-[a-z]{2}"), max_new_tokens=8)
    assert programs.compiled_program_count() == count
    assert all(re.fullmatch(r"(yes|no)-[a-z]{2}", output_text(t)[0]) for t in other.tokens)


def test_the_program_holds_no_host_callback():
    sampling = [specjax.Sampling(regex=REGEX), specjax.Sampling()]
    V = TARGET.config.vocab_size
    spec = LoopSpec(TARGET.config, 2, 16, 64, WarpSpec.of(sampling))
    tables = grammar_module.build_grammar(TARGET.tokenizer, V, (EOS,), [s.constraint for s in sampling])
    inputs = GenerationInputs.simple(
        prompt_tokens=jnp.zeros((2, 16), jnp.int32),
        prompt_lengths=jnp.array([3, 5], jnp.int32),
        max_new_tokens=jnp.array([8, 8], jnp.int32),
        sampling=SamplingParams.of(sampling, 2, V).replace(grammar=tables),
        key=jax.random.key(0),
        stop_token_ids=(EOS,),
    )
    jaxpr = str(jax.make_jaxpr(generate_program, static_argnums=0)(spec, TARGET.params, None, inputs))
    assert "callback" not in jaxpr and jaxpr.count("while") >= 1


def test_tree_node_states_follow_each_nodes_own_path():
    """Grammar.node_states against the host automaton walked along each node's path (its
    ancestors' tokens, root first): siblings read their own token from their parent's state, not
    the drafts before them in node order (a chain's path_states would do that)."""
    V = TARGET.config.vocab_size
    regex = "[0-3][0-3][0-3]x"
    tables = grammar_module.build_grammar(TARGET.tokenizer, V, (EOS,), [regex])
    automaton = grammar_module.compile_constraint(regex, TARGET.tokenizer, V, (EOS,))
    edges = {
        (int(s), int(t)): int(n)
        for s, t, n in zip(automaton.sources, automaton.tokens, automaton.targets, strict=True)
    }
    tree = TokenTree.top_k((3, 2, 1))
    digits = [ord(c) - 32 for c in "0123"]
    rng = np.random.default_rng(0)
    node_tokens = rng.choice(digits + [ord("y") - 32], size=(4, tree.num_nodes))  # some forbidden
    states = np.asarray(
        tables.node_states(tables.start[:1].repeat(4), jnp.asarray(node_tokens), tree.parents, V)
    )
    for b in range(4):
        for i, path in enumerate(tree.paths, start=1):
            state = 0  # (the only automaton: its start is state 0)
            nodes = [tree.paths.index(path[:d]) + 1 for d in range(1, len(path) + 1)]
            for node in nodes:
                state = edges.get((state, int(node_tokens[b, node - 1])), state)  # no edge: it stays
            assert states[b, i] == state, (b, path)
    chain = np.asarray(tables.path_states(tables.start[:1].repeat(4), jnp.asarray(node_tokens), V))
    assert (chain != states).any()  # the test tells the two apart


def test_device_tables_are_fixed_size_bitmasks_and_a_sorted_edge_list():
    V = TARGET.config.vocab_size
    tables = grammar_module.build_grammar(TARGET.tokenizer, V, (EOS,), [r"[0-9]{2}", None])
    assert tables.allowed.shape == (grammar_module.MIN_STATES, -(-V // 32))
    assert tables.allowed.dtype == jnp.uint32
    assert tables.edge_keys.shape == (grammar_module.MIN_EDGES,)
    keys = np.asarray(tables.edge_keys)
    assert np.all(np.diff(keys) >= 0)
    start = np.asarray(tables.start)
    assert start[1] == -1
    allowed = np.asarray(tables.mask(jnp.asarray(start), V))
    digits = [ord(c) - 32 for c in "0123456789"]
    assert allowed[0].sum() == 10 and allowed[0, digits].all() and allowed[1].all()
    after = tables.advance(jnp.asarray(start), jnp.asarray([[digits[1], digits[2]], [5, 6]]), V)
    final = np.asarray(tables.mask(after[:, 1], V))
    assert np.flatnonzero(final[0]).tolist() == [EOS]


def test_grammar_draft_drafts_what_the_constraint_forces_losslessly():
    """GrammarDraft alone and before NGram (Hybrid): the JSON schema's keys and punctuation are
    forced, so they are drafted and accepted; the tokens equal plain constrained greedy."""
    sampling = specjax.Sampling(json_schema=SCHEMA)
    plain = plain_greedy(json.dumps(dict(json_schema=SCHEMA)))
    alone = generate(specjax.GrammarDraft(k=4), sampling, max_new_tokens=30)
    assert alone.tokens == plain
    drafted, accepted = alone.metrics.drafted.sum(), alone.metrics.accepted.sum()
    assert drafted > 0 and accepted == drafted  # forced tokens: the target's mask leaves p = 1
    hybrid = specjax.Hybrid(specjax.GrammarDraft(k=3), specjax.NGram(k=3, n_max=3, n_min=1))
    assert generate(hybrid, sampling, max_new_tokens=30).tokens == plain
    free = generate(specjax.GrammarDraft(k=4), specjax.Sampling(), max_new_tokens=6)
    assert free.tokens == generate(None, specjax.Sampling(), max_new_tokens=6).tokens
    assert free.metrics.drafted.sum() == 0


def test_compact_json_forces_keys_and_punctuation_whole():
    """compact_json: no whitespace between the JSON's tokens, so each key's quoted name, its colon
    and the commas are forced; GrammarDraft drafts more of the answer than with the optional
    spaces, every draft accepted, and the output is plain constrained greedy's under the same
    constraint and holds no space outside its strings."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}}
    schema["required"] = ["n", "ok"]
    compact = specjax.Sampling(json_schema=schema, compact_json=True)
    assert compact.constraint == '\\{"n":(-)?(0|[1-9][0-9]*),"ok":(true|false)\\}'
    spaced = specjax.Sampling(json_schema=schema)
    runs = {
        name: generate(specjax.GrammarDraft(k=4), sampling, max_new_tokens=30)
        for name, sampling in (("compact", compact), ("spaced", spaced))
    }
    plain = plain_greedy(json.dumps(dict(json_schema=schema, compact_json=True)))
    assert runs["compact"].tokens == plain
    text = output_text(runs["compact"].tokens[0])[0]
    assert " " not in text and json.loads(text).keys() == {"n", "ok"}
    drafted = {name: int(run.metrics.drafted.sum()) for name, run in runs.items()}
    assert drafted["compact"] > drafted["spaced"] > 0
    assert runs["compact"].metrics.accepted.sum() == drafted["compact"]


def test_grammar_draft_drafts_nothing_past_the_end():
    """A choice forces every token: after the prefill's "h", one step drafts "ello" and the EOS
    that ends the row, and nothing after it (the automaton has no edge for EOS: drafting on would
    have the target "accept" EOS again and again past the end); the metrics count those 5."""
    result = specjax.generate(
        TARGET, [PROMPTS[0]], specjax.GrammarDraft(k=8), specjax.Sampling(choice=["hello"]), max_new_tokens=20
    )
    assert output_text(result.tokens[0])[0] == "hello" and result.tokens[0][-1] == EOS
    metrics = result.metrics
    assert metrics.drafted.sum() == 5 and metrics.accepted.sum() == 5 and metrics.emitted.sum() == 6
    assert metrics.accept_hist.sum(0).tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0]


def _walk(automaton, text: str) -> int:
    """The automaton's state after `text` read one character token at a time (-1: no path)."""
    vocab_size = TARGET.config.vocab_size
    keys, targets = grammar_module.sorted_edges(automaton, vocab_size)
    state = 0
    for char in text:
        key = state * vocab_size + ord(char) - 32
        at = int(np.searchsorted(keys, key))
        if at == len(keys) or keys[at] != key:
            return -1
        state = int(targets[at])
    return state


@pytest.mark.parametrize("choices", [["yes please", "yes thanks", "no"], ["abc-1", "abc-22", "abd"]])
@pytest.mark.parametrize("keep_last", [True, False])
def test_forced_tokens_spell_the_text_the_choices_force(choices, keep_last):
    """At every state reached along a choice's characters, the forced table holds the tokenizer's
    spelling of the longest common prefix of what may follow there (the reference reads the
    choice list, not the automaton; "ab" is one token of tiny_tokenizer's, so "abc-" is spelt
    [ab, c, -]), then EOS where that text ends the only word left; without keep_last, less its
    last token where other text may follow."""
    vocab_size = TARGET.config.vocab_size
    regex = grammar_module.constraint_regex(None, None, choices)
    automaton = grammar_module.compile_constraint(regex, TARGET.tokenizer, vocab_size, (EOS,))
    forced = grammar_module.forced_tokens(
        automaton, TARGET.tokenizer, vocab_size, (EOS,), keep_last=keep_last
    )
    checked = 0
    for word in choices:
        for i in range(len(word) + 1):
            prefix = word[:i]
            followers = {w[i:] for w in choices if w.startswith(prefix)}
            if "" in followers:  # the prefix is a word: EOS may come, nothing is forced
                expected = [EOS] if followers == {""} else []
            else:
                text = os.path.commonprefix(sorted(followers))
                expected = list(TARGET.tokenizer.encode(text, add_special_tokens=False))
                if followers == {text}:
                    expected.append(EOS)
                elif not keep_last:
                    expected = expected[:-1]
            row = forced[_walk(automaton, prefix)]
            assert row[row >= 0].tolist() == expected, (prefix, followers)
            checked += 1
    assert checked > 10


def test_grammar_draft_drafts_a_forced_text_spelt_as_the_tokenizer_spells_it():
    """Under ["abc-1", "abc-22"], after the prefill's first token the rest of "abc-" is forced
    (drafted less its "-", which other text follows), and after the digit the rest of the word and
    EOS: at least two drafts a row, and the target's tokens equal plain constrained greedy."""
    sampling = specjax.Sampling(choice=["abc-1", "abc-22"])
    result = generate(specjax.GrammarDraft(k=4), sampling, max_new_tokens=10)
    assert result.tokens == generate(None, sampling, max_new_tokens=10).tokens
    assert result.metrics.drafted.sum() >= 2 * len(PROMPTS)
