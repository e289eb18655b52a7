"""Every sampling option, per row, under speculation: penalties, logit bias, filters, seeds,
stop token ids and stop strings, checked against a float64 numpy reference of the options and
exact enumeration of the target's law; plus the errors raised from inside the loop and at the
door."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import check_drafted_acceptance, first_layer_mtp
from laws import assert_sequence_law, detectable_shift, pool, power_against
from oracle import Oracle, references
from tiny import tiny_model, tiny_tokenizer

import specjax
from specjax.models import EagleHead, MedusaHead, MLPSpeculatorHead, forward, init_cache
from specjax.speculate.history import TokenHistory
from specjax.speculate.sampling import SamplingParams, WarpSpec, adjust_logits, warp_logits
from specjax.speculate.tree import TokenTree

TARGET = tiny_model(seed=11)
DRAFT = tiny_model(seed=12, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=48)
V = TARGET.config.vocab_size
# The target with two MTP layers (tests/drafters.py): the same model, so the same law.
WITH_MTP = first_layer_mtp(TARGET, num_layers=2)


def proposers(k):
    return {
        "none": None,
        "ngram": specjax.NGram(k=k, n_max=3, n_min=1),
        "draft": specjax.DraftModel(DRAFT, k=k),
        "self": specjax.SelfDraft(layers=1, k=k),
        "mlp": specjax.MLPSpeculator(MLPSpeculatorHead.init(TARGET, n_predict=3, inner_dim=48), k=k),
        "mtp": specjax.MTP(k=k),  # drafts sampled from the warped MTP logits, layers 0 and 1 in turn
        "mtp_ngram": specjax.WithNGram(
            specjax.MTP(k=max(k - 1, 1)), specjax.NGram(k=1)
        ),  # then prompt lookup
    }


# ---------------------------------------------------------------------------------------------
# The reference: the options written out in float64 numpy, from their definitions


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def reference_probs(logits, prompt, generated, s: specjax.Sampling) -> np.ndarray:
    """The distribution of the next token [V] (one-hot at temperature 0)."""
    x = np.asarray(logits, np.float64).copy()
    for token, bias in (s.logit_bias or {}).items():
        x[token] += bias
    counts = np.bincount(np.asarray(generated, int), minlength=len(x)).astype(np.float64)
    for token in set(prompt) | set(generated):  # repetition penalty: prompt and output
        x[token] = x[token] / s.repetition_penalty if x[token] > 0 else x[token] * s.repetition_penalty
    x -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0)  # output only
    if s.temperature == 0:
        return np.eye(len(x))[np.argmax(x)]
    x /= s.temperature
    if s.top_k:
        x[x < np.sort(x)[::-1][s.top_k - 1]] = -np.inf
    if s.top_p < 1:
        p = softmax(x)
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep = (before < s.top_p) | (np.arange(len(x)) == 0)
        x[x < x[order][keep].min()] = -np.inf
    if s.min_p:
        p = softmax(x)
        x[p < s.min_p * p.max()] = -np.inf
    return softmax(x)


@functools.cache
def _last_logits_fn(model):
    @jax.jit
    def last_logits(tokens, length):  # tokens [1, 64] right-padded; causal, so padding is inert
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        cache = init_cache(model.config, 1, tokens.shape[1])
        return forward(model.params, model.config, tokens, positions, cache)[0][0, length - 1]

    return last_logits


def next_logits(model, sequence) -> np.ndarray:
    padded = np.zeros((1, 64), np.int32)
    padded[0, : len(sequence)] = sequence
    return np.asarray(_last_logits_fn(model)(jnp.asarray(padded), len(sequence)))


def reference_joint(model, prompt, s: specjax.Sampling, num_tokens):
    """P(first num_tokens generated tokens) by enumeration: {tuple: probability}."""
    joint = {(): 1.0}
    for _ in range(num_tokens):
        grown = {}
        for prefix, prob in joint.items():
            p = reference_probs(next_logits(model, list(prompt) + list(prefix)), prompt, prefix, s)
            for token in np.flatnonzero(p > 0):
                grown[prefix + (int(token),)] = prob * p[token]
        joint = grown
    return joint


def reference_greedy(model, prompt, s: specjax.Sampling, num_tokens):
    out = []
    for _ in range(num_tokens):
        out.append(int(np.argmax(reference_probs(next_logits(model, list(prompt) + out), prompt, out, s))))
    return out


# ---------------------------------------------------------------------------------------------
# The options on their own


@pytest.mark.parametrize(
    "sampling",
    [
        specjax.Sampling(temperature=0.9, repetition_penalty=1.7),
        specjax.Sampling(temperature=0.9, repetition_penalty=0.6),
        specjax.Sampling(temperature=1.1, frequency_penalty=0.8, presence_penalty=-0.5),
        specjax.Sampling(temperature=0.7, logit_bias={3: 4.0, 10: -2.5, 50: 1.0}),
        specjax.Sampling(temperature=0.8, top_k=7, top_p=0.8, min_p=0.02, repetition_penalty=1.3),
    ],
    ids=["repetition", "repetition<1", "frequency+presence", "logit_bias", "all"],
)
def test_adjust_and_warp_match_the_numpy_reference(sampling):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, V)).astype(np.float32) * 2
    prompt = [1, 2, 3, 3, 40]
    generated = [[5, 5, 6], [], [2, 7, 7, 7, 8]]  # per row; the prompt is shared
    spec, params = WarpSpec.of(sampling), SamplingParams.of(sampling, 3, V)
    counts = np.stack([np.bincount(g, minlength=V) for g in generated]).astype(np.int32)
    in_prompt = np.zeros((3, V), bool)
    in_prompt[:, prompt] = True
    adjusted = adjust_logits(jnp.asarray(logits), params, spec, jnp.asarray(counts), jnp.asarray(in_prompt))
    got = np.exp(np.asarray(warp_logits(adjusted, params, spec), np.float64))
    for b in range(3):
        want = reference_probs(logits[b], prompt, generated[b], sampling)
        np.testing.assert_allclose(got[b], want, atol=2e-6)
        assert ((got[b] > 0) == (want > 0)).all()


@pytest.mark.parametrize(
    "tree",
    [TokenTree.chain(4), TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)])],
    ids=["chain", "tree"],
)
def test_counts_at_nodes_add_the_valid_drafts_on_each_path(tree):
    """The penalties' counts a verify pass scores each node with: the committed counts plus the
    valid drafts on the path to the node (its ancestors and itself), each counted once, against a
    walk up the tree. Greedy and sampled tests of the loop hardly see a draft counted twice: that
    changes a logit only through the frequency penalty of a token repeated inside one step."""
    rng = np.random.default_rng(0)
    B, N, vocab = 4, tree.num_nodes, 5  # a small vocabulary, so tokens repeat along paths
    committed = rng.integers(0, 3, size=(B, vocab)).astype(np.int32)
    node_tokens = rng.integers(0, vocab, size=(B, N)).astype(np.int32)
    valid = rng.random((B, N)) < 0.8
    history = TokenHistory(counts=jnp.asarray(committed), in_prompt=jnp.zeros((B, vocab), bool))
    got = history.counts_at_nodes(
        jnp.asarray(node_tokens), jnp.asarray(valid), jnp.asarray(tree.attention_mask)
    )
    got = np.asarray(got)  # [B, N+1, V], the root first
    for b in range(B):
        for i in range(N + 1):
            want, node = committed[b].copy(), i
            while node > 0:  # node n >= 1 holds node_tokens[:, n - 1]
                want[node_tokens[b, node - 1]] += valid[b, node - 1]
                node = tree.parents[node]
            np.testing.assert_array_equal(got[b, i], want, err_msg=f"row {b}, node {i}")
    assert (got - committed[:, None]).max() >= 2  # some path holds a token twice


# Four sampled row groups, each exercising some options, and a greedy group with penalties and a
# bias: one batch, one program. Every sampled group keeps top_k small so that the law of three
# tokens can be enumerated. Group 0's temperature (0.7, was 0.8) and group 2's min_p (0.15, was
# 0.05, which filtered nothing here) are set so that losing either changes the law detectably
# (test_the_mixed_batch_law_check_catches_a_lost_option).
GROUPS = [
    specjax.Sampling(temperature=0.7, top_k=4, top_p=0.9),
    specjax.Sampling(temperature=1.0, top_k=5, repetition_penalty=1.8),
    specjax.Sampling(temperature=0.9, top_k=5, frequency_penalty=1.5, presence_penalty=0.8, min_p=0.15),
    specjax.Sampling(temperature=0.7, top_k=5, logit_bias={44: 2.5, 21: 1.5, 30: -3.0}),
]
GREEDY = specjax.Sampling(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={44: 1.0})
PROMPT = [5, 6, 7, 5, 6]
ROWS_PER_GROUP = 1500


@pytest.fixture(scope="module")
def group_laws():
    return [reference_joint(TARGET, PROMPT, s, 3) for s in GROUPS]


def tree_proposers(num_rows):
    """Token trees: Medusa and EAGLE with random heads, and the oracle (tests/oracle.py) that knows the
    greedy continuation and hides it among wrong siblings, so that sampled rows accept paths
    through later siblings too."""
    head = MedusaHead.init(TARGET, num_heads=2, key=jax.random.key(0), scale=0.5)
    eagle = EagleHead.init(TARGET, jax.random.key(0))
    greedy = specjax.generate(TARGET, [PROMPT], max_new_tokens=8).tokens
    reference = np.repeat(references([PROMPT], greedy), num_rows, axis=0)
    return {
        "medusa_tree": specjax.Medusa(head, tree=TokenTree.top_k((3, 2))),
        "oracle_tree": Oracle(TokenTree.top_k((3, 2)), reference),
        "eagle_tree": specjax.Eagle(eagle, tree=TokenTree.top_k((3, 2))),
    }


# The default set keeps the chains (trees' laws: tests/test_speculative.py); `make test-all` the
# three trees too.
@pytest.mark.parametrize(
    "name",
    [
        "none",
        "ngram",
        "draft",
        pytest.param("self", marks=pytest.mark.slow),  # a model draft's law: "draft" (20 s each)
        pytest.param("mlp", marks=pytest.mark.slow),  # sampled drafts from a head, q its warped law
        pytest.param("mtp", marks=pytest.mark.slow),
        pytest.param("mtp_ngram", marks=pytest.mark.slow),
        pytest.param("medusa_tree", marks=pytest.mark.slow),
        pytest.param("oracle_tree", marks=pytest.mark.slow),
        pytest.param("eagle_tree", marks=pytest.mark.slow),
    ],
)
def test_mixed_batch_follows_the_reference_law(group_laws, name):
    """The first three tokens of every row follow its own options' exact law (the first token from
    the prefill, the next two from speculative steps), checked per group by tests/laws.py: no
    sequence of probability 0, each count within 6 binomial standard deviations plus 3, and a
    G-test at false-alarm rate 1e-6 (1.4e-6 to 4.4e-6 per group with the per-cell bounds). At
    ROWS_PER_GROUP = 1,500 over 36 to 82 pooled cells, the G-test detects any shift of 11.5% to
    13.3% of a group's mass (with probability 0.9); the errors this test exists for are larger or put
    mass on forbidden sequences (test_the_mixed_batch_law_check_catches_a_lost_option). More rows
    would cost about 4 s of run time per 1,000 per group and proposer here."""
    samplings = [s for s in GROUPS for _ in range(ROWS_PER_GROUP)] + [GREEDY] * 4
    proposer = tree_proposers(len(samplings))[name] if "tree" in name else proposers(2)[name]
    result = specjax.generate(
        WITH_MTP if name.startswith("mtp") else TARGET,
        [PROMPT] * len(samplings),
        proposer=proposer,
        sampling=samplings,
        max_new_tokens=3,
        key=jax.random.key(5),
    )
    for g, joint in enumerate(group_laws):
        rows = result.tokens[g * ROWS_PER_GROUP : (g + 1) * ROWS_PER_GROUP]
        check = assert_sequence_law(rows, joint, f"group {g}")
        assert check.detectable_shift < 0.135 and check.false_alarm < 5e-6, check
        assert len(joint) > 6, f"group {g} has too little spread to test"
    greedy = reference_greedy(TARGET, PROMPT, GREEDY, 3)
    assert result.tokens[-4:] == [greedy] * 4
    if name != "none":
        assert result.metrics.drafted.sum() > 0
    if name == "mtp":  # its sampled drafts (q the warped MTP distribution) were accepted too
        check_drafted_acceptance(result.metrics, 0.2, 0.6)  # 37% here
    if name == "oracle_tree":  # the later-sibling paths were really taken
        assert result.metrics.accept_hist[:, 2].sum() > 100


def test_penalties_change_the_law():
    """The reference laws above differ from the unpenalised one: the options are not no-ops."""
    plain = reference_joint(TARGET, PROMPT, specjax.Sampling(temperature=1.0, top_k=5), 2)
    for s in GROUPS[1:]:
        law = reference_joint(TARGET, PROMPT, s, 2)
        distance = sum(abs(law.get(q, 0) - plain.get(q, 0)) for q in set(law) | set(plain))
        assert distance > 0.05, s


# Each option set back to its neutral value. top_k is left out: without it the law of three tokens
# has 97^3 sequences, too many to enumerate.
NEUTRAL = dict(
    temperature=1.0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    logit_bias=None,
)


def test_the_mixed_batch_law_check_catches_a_lost_option(group_laws):
    """What the check of test_mixed_batch_follows_the_reference_law catches at ROWS_PER_GROUP =
    1,500 rows per group, beyond the 11.5% to 13.3% shift of mass that its G-test detects in any
    direction: a group sampled with another group's options, or with any one of its options lost
    (set to its neutral value). Each such law moves 0.3% to 94% of the mass and is rejected with
    probability above 0.99: by the G-test (its power from the noncentral chi-square), or because it
    puts mass on sequences that the group's law forbids and one of the 1,500 draws lands there."""
    n = ROWS_PER_GROUP
    for g, law in enumerate(group_laws):
        probs = np.array(list(law.values()))
        assert detectable_shift(n, pool(n * probs).max() + 1) < 0.135
        alternatives = {f"group {h}'s options": group_laws[h] for h in range(len(GROUPS)) if h != g}
        for option, neutral in NEUTRAL.items():
            lost = dataclasses.replace(GROUPS[g], **{option: neutral})
            if lost != GROUPS[g]:
                alternatives[f"no {option}"] = reference_joint(TARGET, PROMPT, lost, 3)
        for name, other in alternatives.items():
            alternative = np.array([other.get(seq, 0.0) for seq in law])
            forbidden = max(1.0 - alternative.sum(), 0.0)  # the mass it puts outside the law's support
            caught = max(power_against(n, probs, alternative), 1 - (1 - forbidden) ** n)
            assert caught > 0.99, (g, name, caught)


GREEDY_ROWS = [
    specjax.Sampling(repetition_penalty=1.6),
    specjax.Sampling(frequency_penalty=1.2, presence_penalty=0.6),
    specjax.Sampling(logit_bias={44: 3.0, 21: 2.0}, repetition_penalty=1.2),
    specjax.Sampling(),
]
GREEDY_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 9], [10, 11, 12, 13, 14, 10, 11, 12], [40, 41, 42, 40]]


@pytest.fixture(scope="module")
def greedy_with_options():
    result = specjax.generate(TARGET, GREEDY_PROMPTS, sampling=GREEDY_ROWS, max_new_tokens=20)
    return result.tokens


def test_plain_greedy_with_options_equals_the_reference(greedy_with_options):
    for prompt, s, got in zip(GREEDY_PROMPTS, GREEDY_ROWS, greedy_with_options, strict=True):
        assert got == reference_greedy(TARGET, prompt, s, 20)
    plain = specjax.generate(TARGET, GREEDY_PROMPTS, max_new_tokens=20).tokens
    assert all(a != b for a, b in zip(plain[:3], greedy_with_options[:3], strict=True))  # options bite


@pytest.mark.parametrize(
    "name, k",
    [("ngram", 3), ("draft", 3), ("self", 3)]
    + [pytest.param(name, k, marks=pytest.mark.slow) for name in ("ngram", "draft", "self") for k in (1, 6)],
)
def test_speculative_greedy_with_options_equals_plain(greedy_with_options, name, k):
    result = specjax.generate(
        TARGET, GREEDY_PROMPTS, proposer=proposers(k)[name], sampling=GREEDY_ROWS, max_new_tokens=20
    )
    assert result.tokens == greedy_with_options
    assert result.metrics.accepted.sum() > 0


def test_mixed_options_share_one_program():
    from specjax.programs import compiled_program_count

    model = tiny_model(seed=11, num_layers=3)  # a config no other test compiles
    first = [specjax.Sampling(temperature=0.5, top_k=3, frequency_penalty=0.2), specjax.Sampling()]
    second = [specjax.Sampling(temperature=1.3, top_k=9, frequency_penalty=-1.0), specjax.Sampling(0.2, 2)]
    specjax.generate(model, [[1, 2], [3, 4]], sampling=first, max_new_tokens=4, key=jax.random.key(0))
    programs = compiled_program_count()
    again = specjax.generate(
        model, [[1, 2], [3, 4]], sampling=second, max_new_tokens=4, key=jax.random.key(0)
    )
    assert compiled_program_count() == programs and again.metrics.compile_time_s == 0


# ---------------------------------------------------------------------------------------------
# Seeds


@pytest.mark.parametrize("name", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_a_seeded_row_does_not_depend_on_the_key_or_the_batch(name):
    """A seeded row draws from its own stream: alone or beside other rows (which draft or miss
    their n-gram lookups differently), under any key, it samples the same tokens."""
    seeded = specjax.Sampling(temperature=1.0, seed=1234)
    other = specjax.Sampling(temperature=1.0)
    proposer = proposers(3)[name]
    alone = specjax.generate(TARGET, [[1, 2, 3]], sampling=[seeded], proposer=proposer, max_new_tokens=12)
    alone = alone.tokens[0]
    for key in (1, 2):
        batch = specjax.generate(
            TARGET,
            [[9, 9, 9, 9], [1, 2, 3], [4, 5, 4, 5]],
            sampling=[other, seeded, other],
            proposer=proposer,
            max_new_tokens=12,
            key=jax.random.key(key),
        )
        assert batch.tokens[1] == alone
    reseeded = specjax.Sampling(temperature=1.0, seed=1235)
    assert specjax.generate(TARGET, [[1, 2, 3]], sampling=[reseeded], max_new_tokens=12).tokens[0] != alone


# ---------------------------------------------------------------------------------------------
# Stops


WORDY = specjax.Model(TARGET.config, TARGET.params, tiny_tokenizer(), name="tiny-wordy")
WORDY_DRAFT = specjax.Model(DRAFT.config, DRAFT.params, WORDY.tokenizer, name="tiny-wordy-draft")


@pytest.fixture(scope="module")
def free_text():
    """Greedy output without stops: (tokens, text) per row."""
    result = specjax.generate(WORDY, GREEDY_PROMPTS, max_new_tokens=30)
    return result.tokens, result.texts


def stop_string_for(text: str, start: int, length: int = 3) -> str:
    """A substring of the text that first occurs at or after `start`."""
    for i in range(start, len(text) - length):
        candidate = text[i : i + length]
        if text.find(candidate) == i:
            return candidate
    raise AssertionError(f"no fresh substring in {text!r}")


@pytest.mark.parametrize(
    "name",
    [
        "none",
        "ngram",
        pytest.param("target", marks=pytest.mark.slow),
        pytest.param("self", marks=pytest.mark.slow),
    ],
)
def test_stop_strings_end_rows_at_the_first_occurrence(free_text, name):
    tokens, texts = free_text
    stops = [stop_string_for(text, 6 + 2 * b) for b, text in enumerate(texts)]
    samplings = [specjax.Sampling(stop=[s, "never-there"]) for s in stops]
    proposer = {
        "none": None,
        "ngram": specjax.NGram(k=4),
        "target": specjax.DraftModel(WORDY, k=8),  # accepts every draft: stops land mid-draft
        "self": specjax.SelfDraft(layers=1, k=3),
    }[name]
    result = specjax.generate(WORDY, GREEDY_PROMPTS, proposer=proposer, sampling=samplings, max_new_tokens=30)
    for b, stop in enumerate(stops):
        cut = texts[b].find(stop)
        # the shortest prefix of the free output whose text holds the stop string
        n = next(n for n in range(1, len(tokens[b]) + 1) if stop in WORDY.tokenizer.decode(tokens[b][:n]))
        assert result.tokens[b] == tokens[b][:n], (b, stop)
        assert result.texts[b] == texts[b][:cut]
    m = result.metrics
    assert m.emitted.tolist() == [len(t) for t in result.tokens]  # nothing after a stop is counted
    if name == "target":  # drafts were accepted past the stop, and not emitted
        assert (m.accepted + m.steps + 1 > m.emitted).any()


def test_stop_token_ids_per_row(free_text):
    tokens, _ = free_text
    stop_ids = [tokens[0][5], tokens[1][3]]
    samplings = [
        specjax.Sampling(stop_token_ids=[stop_ids[0]]),
        specjax.Sampling(stop_token_ids=[stop_ids[1]]),
    ]
    for proposer in (None, specjax.DraftModel(WORDY, k=6)):
        result = specjax.generate(
            WORDY, GREEDY_PROMPTS[:2], proposer=proposer, sampling=samplings, max_new_tokens=30
        )
        for b in range(2):
            assert result.tokens[b] == tokens[b][: tokens[b].index(stop_ids[b]) + 1]


def test_stop_automaton_against_brute_force():
    """The token-level automaton stops where the concatenated text first holds a pattern, for
    random token sequences over tokens that split and merge the patterns' characters."""
    from specjax.speculate.stops import token_tables

    texts = ["a", "b", "c", "ab", "bc", "ca", "abc", "x", "", "cab", "aa", "bca"]
    patterns = ["abc", "ca", "bb", "aab"]
    next_state, matches = token_tables(texts, patterns)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        seq = rng.integers(len(texts), size=12)
        mask = int(rng.integers(1, 1 << len(patterns)))
        wanted = [p for i, p in enumerate(patterns) if mask >> i & 1]
        state, got = 0, None
        for i, token in enumerate(seq):
            if matches[state, token] & mask:
                got = i
                break
            state = next_state[state, token]
        text, expected = "", None
        for i, token in enumerate(seq):
            text += texts[token]
            if any(p in text for p in wanted):
                expected = i
                break
        assert got == expected, ([texts[t] for t in seq], wanted)


# ---------------------------------------------------------------------------------------------
# Errors from inside the loop


def corrupted(model, token, value=np.nan):
    """The model with one embedding row corrupted to NaN, as a damaged checkpoint might be."""
    embed = model.params.embed.at[token].set(value)
    return specjax.Model(model.config, model.params.replace(embed=embed), name="corrupted")


@pytest.mark.parametrize("proposer", [None, specjax.NGram(k=3)], ids=["plain", "ngram"])
def test_nonfinite_logits_name_the_row_and_the_step(proposer):
    prompts = [[1, 2, 3], [4, 60, 5], [7, 8, 9]]
    free = specjax.generate(TARGET, prompts, max_new_tokens=3).tokens
    bad = free[2][1]  # row 2 feeds it at step 2; row 1 has it in its prompt (if distinct)
    prompts[1][1] = bad
    # The rows are chosen so that only rows 1 and 2 ever feed that token.
    assert bad not in free[0] + prompts[0] + prompts[2] + free[2][:1]
    with pytest.raises(FloatingPointError) as error:
        specjax.generate(corrupted(TARGET, bad), prompts, proposer=proposer, max_new_tokens=3)
    message = str(error.value)
    assert "row 1 at step 0 (the prefill)" in message
    assert "row 2 at step 2" in message
    assert "row 0" not in message


def test_a_cache_too_big_for_the_device_is_refused_before_allocating(monkeypatch):
    import specjax.api

    monkeypatch.setattr(specjax.planner, "available_memory_bytes", lambda: 1 << 20)
    message = r"8 rows with prompts padded to 16 tokens .* needs about [\d,]+ bytes \(0\.\d\d GiB: .*\), but"
    with pytest.raises(ValueError, match=message):
        specjax.generate(TARGET, [[1, 2, 3]] * 8, max_new_tokens=200, prefill_chunk=None)


def test_the_memory_check_counts_attentions_working_memory():
    """A prefill's scores: quadratic in the prompt on the CPU (its chunks of [chunk, T] scores),
    linear where the prefill is blocked (an accelerator); a decoding pass over the whole cache with
    XLA, the filled part only with a kernel. Llama-3-8B's shapes, batch 8, 8,192 prompt tokens."""
    from specjax.kernels.backend import Backend
    from specjax.models import LlamaConfig
    from specjax.models.attention import attention_workspace_bytes

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
    )
    cpu, tpu = Backend(("cpu",), "xla"), Backend(("tpu",), "auto")

    def workspace(on, T, width=1):
        return attention_workspace_bytes(config, 8, T, width, T + 256, "bfloat16", on)

    assert workspace(cpu, 8192) == 2 * 8 * 32 * 1024 * 8192 * 4  # 17.2 GB of scores
    assert workspace(cpu, 16384) == 4 * workspace(cpu, 8192)
    assert workspace(tpu, 16384) == 2 * workspace(tpu, 8192)
    assert workspace(tpu, 8192) < workspace(cpu, 8192) / 4
    # Decoding 5 tokens over 32,768 slots: XLA's scores cover every slot, the kernel's do not.
    xla_decode = attention_workspace_bytes(config, 8, 16, 5, 32768, "bfloat16", Backend(("tpu",), "xla"))
    assert xla_decode == 2 * 8 * 32 * 5 * (32768 + 5) * 4
    assert attention_workspace_bytes(config, 8, 16, 5, 32768, "bfloat16", tpu) < xla_decode / 50


def test_a_prompt_whose_prefill_does_not_fit_is_refused(monkeypatch):
    """A prompt of 400 tokens (bucket 448): the check counts its prefill's scores."""
    import specjax.api
    from specjax.speculate.spec import memory_bytes

    seen = []
    real = specjax.planner.check_memory
    check = lambda spec, *rest: seen.append(spec) or real(spec, *rest)  # noqa: E731
    monkeypatch.setattr(specjax.planner, "check_memory", check)
    specjax.generate(TARGET, [[1] * 400], max_new_tokens=2, prefill_chunk=None)
    spec = seen[0]
    from specjax.models.cache import cache_bytes

    cache = cache_bytes(TARGET.config, 1, spec.capacity)
    assert memory_bytes(spec) > cache + 2 * TARGET.config.num_heads * 64 * 448 * 4
    monkeypatch.setattr(specjax.planner, "available_memory_bytes", lambda: memory_bytes(spec) - 1)
    with pytest.raises(ValueError, match=r"1 rows with prompts padded to 448 tokens"):
        specjax.generate(TARGET, [[1] * 400], max_new_tokens=2, prefill_chunk=None)


def test_memory_estimate_counts_the_caches():
    from specjax.models.cache import cache_bytes
    from specjax.speculate.proposers import resolve
    from specjax.speculate.spec import LoopSpec, memory_bytes

    warp = WarpSpec.of(specjax.Sampling())
    plain = LoopSpec(TARGET.config, 4, 16, 256, warp)
    draft_spec, _ = resolve(specjax.DraftModel(DRAFT, k=4), TARGET, warp)
    drafted = LoopSpec(TARGET.config, 4, 16, 256, warp, draft_spec)
    assert memory_bytes(plain) >= cache_bytes(TARGET.config, 4, 256)
    assert memory_bytes(drafted) - memory_bytes(plain) >= cache_bytes(DRAFT.config, 4, 256)


# ---------------------------------------------------------------------------------------------
# Bad input at the door


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=-1.0), "repetition_penalty must be a finite number > 0"),
        (dict(frequency_penalty=2.5), r"frequency_penalty must be a number in \[-2, 2\]"),
        (dict(presence_penalty=-3), r"presence_penalty must be a number in \[-2, 2\]"),
        (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids >= 0, got -1"),
        (dict(logit_bias={"a": 1.0}), "logit_bias keys must be token ids >= 0, got 'a'"),
        (dict(logit_bias={3: float("nan")}), r"logit_bias\[3\] must be a finite number"),
        (dict(stop=[""]), "stop must be a non-empty string or a list of non-empty strings"),
        (dict(stop=[3]), "stop must be a non-empty string"),
        (dict(stop_token_ids=[-2]), "stop_token_ids must be a list of token ids >= 0"),
        (dict(seed=1.5), r"seed must be None or an integer in \[0, 2\*\*32\)"),
        (dict(seed="7"), "seed must be None or an integer"),
        (dict(seed=-1), "seed must be None or an integer"),
        (dict(top_k=2.0), "top_k must be an integer >= 0"),
    ],
)
def test_bad_sampling_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        specjax.Sampling(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sampling=[specjax.Sampling()]), "a list of 1 Sampling values for 2 prompts"),
        (dict(sampling=[specjax.Sampling(), "greedy"]), r"sampling\[1\] must be a specjax.Sampling"),
        (dict(sampling="greedy"), "sampling must be a specjax.Sampling or a list"),
        (dict(sampling=specjax.Sampling(logit_bias={97: 1.0})), "logit_bias has token id 97 outside"),
        (dict(sampling=specjax.Sampling(stop_token_ids=[500])), "stop_token_ids has token id 500 outside"),
        (dict(sampling=specjax.Sampling(stop="x")), "stop needs a tokenizer"),
        (dict(sampling=[specjax.Sampling(), specjax.Sampling(temperature=1.0)]), "key is required"),
        (dict(key=7), "key must be one jax PRNG key"),
    ],
)
def test_bad_per_row_sampling(kwargs, message):
    with pytest.raises(ValueError, match=message):
        specjax.generate(TARGET, **(dict(prompts=[[1, 2], [3]], max_new_tokens=4) | kwargs))


def test_seeded_rows_need_no_key():
    samplings = [specjax.Sampling(temperature=1.0, seed=1), specjax.Sampling(temperature=1.0, seed=2)]
    result = specjax.generate(TARGET, [[1, 2], [1, 2]], sampling=samplings, max_new_tokens=6)
    assert result.tokens[0] != result.tokens[1]
