"""Continuous batching (specjax/serve/engine.py): requests that join a running batch at random
steps get what `generate` gives each of them alone.

The drafters accept part of the time by construction (tests/drafters.py), so accepted drafts,
rejections and the rollbacks of every proposer's state all happen while other rows join and
leave beside them."""

import dataclasses

import jax
import numpy as np
import pytest
from drafters import first_layer_eagle, layered_target, noisy_copy
from tiny import tiny_model, tiny_tokenizer

import specjax
from specjax.serve import Engine, Request
from specjax.serve.engine_config import admission_bucket
from specjax.speculate.sampling import WarpSpec

TARGET = layered_target(seed=11, late_scale=0.3)
NOISY_DRAFT = noisy_copy(TARGET, noise=0.05, seed=0)
VOCAB = TARGET.config.vocab_size


def test_admission_buckets_pad_little():
    """Multiples of 16 up to 64 tokens, then four buckets per doubling: at most 15 tokens of
    padding up to 64, under a quarter of the prompt past them."""
    lengths = (1, 16, 17, 48, 64, 65, 100, 128, 129, 200, 257)
    assert [admission_bucket(n) for n in lengths] == [16, 16, 32, 48, 64, 80, 112, 128, 160, 224, 320]
    for n in range(1, 5000):
        bucket = admission_bucket(n)
        assert bucket >= n and bucket % 16 == 0
        assert bucket - n < 16 if n <= 64 else bucket - n < n / 4


def _prompts(seed: int, count: int, repetitive: bool = True) -> list[list[int]]:
    """Prompts of varied lengths (several buckets); half repeat a phrase, so prompt lookup drafts."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(count):
        length = (5, 20, 37, 9, 33, 14, 26, 3)[(i + seed) % 8]  # buckets 16, 32 and 48
        if repetitive and i % 2:
            phrase = rng.integers(0, VOCAB, 5).tolist()
            prompts.append((phrase * 8)[:length])
        else:
            prompts.append(rng.integers(0, VOCAB, length).tolist())
    return prompts


def drive(engine: Engine, requests: list[Request], seed: int) -> tuple[dict, dict]:
    """Add the requests at random moments (0 to 2 before each engine step) and step until every
    one finished. Returns (tokens, finishing Update) by position in `requests`."""
    rng = np.random.default_rng(seed)
    pending = list(enumerate(requests))
    ids, tokens, final = {}, {}, {}
    while pending or engine.has_work:
        for _ in range(int(rng.integers(0, 3)) if engine.has_work else 1):
            if pending:
                position, request = pending.pop(0)
                ids[engine.add(request)] = position
        for update in engine.step():
            position = ids[update.request_id]
            tokens.setdefault(position, []).extend(update.tokens)
            if update.finished:
                final[position] = update
    return tokens, final


def alone(model, request: Request, proposer=None) -> list[int]:
    return specjax.generate(
        model, [request.prompt], proposer, request.sampling, request.max_new_tokens
    ).tokens[0]


def accepted_and_drafted(finals) -> tuple[int, int]:
    accepted = sum(int(u.metrics.accepted.sum()) for u in finals.values())
    drafted = sum(int(u.metrics.drafted.sum()) for u in finals.values())
    return accepted, drafted


PROPOSERS = {
    "plain": lambda: None,
    "draft": lambda: specjax.DraftModel(NOISY_DRAFT, k=3),
    # its cache starts as the target's over each admitted prompt
    "draft-prompt": lambda: specjax.DraftModel(
        noisy_copy(TARGET, noise=0.05, extra_layers=0), k=3, prompt_from_target=True
    ),
    "self": lambda: specjax.SelfDraft(layers=1, k=3),
    "ngram": lambda: specjax.NGram(k=3),
    "eagle-tree": lambda: specjax.Eagle(
        first_layer_eagle(TARGET), k=3, tree=specjax.TokenTree.top_k((2, 2, 1))
    ),
    "hybrid": lambda: specjax.Hybrid(specjax.NGram(k=4), specjax.Eagle(first_layer_eagle(TARGET), k=2)),
    "dynamic": lambda: specjax.Dynamic(specjax.DraftModel(NOISY_DRAFT, k=3)),
}
FAST = ("plain",)  # the others run in make test-all (20 to 60 s each here)


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in PROPOSERS]
)
def test_greedy_requests_joining_at_random_steps_equal_generate_alone(name):
    proposer = PROPOSERS[name]()
    limits = (24, 9, 31, 16, 1, 20, 12)
    requests = [Request(p, max_new_tokens=n) for p, n in zip(_prompts(1, 7), limits, strict=True)]
    engine = Engine(TARGET, proposer, max_batch=3, max_model_len=96, chunk_steps=3)
    tokens, finals = drive(engine, requests, seed=2)
    for i, request in enumerate(requests):
        assert tokens[i] == alone(TARGET, request, proposer), i
        assert finals[i].finish_reason == "length"
        assert len(tokens[i]) == request.max_new_tokens
    if proposer is not None:  # drafts were accepted in part while rows came and went
        accepted, drafted = accepted_and_drafted(finals)
        assert 0.1 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    # One prefill program per prompt bucket (and the free slots' row, bucket 16), the writes of a
    # row and the moves between widths compiled at start, the loop at the widths the occupied
    # slots needed; new prompts and arrivals never compile again (and a call whose shapes differ
    # would fail: programs are compiled ahead of time).
    buckets = {admission_bucket(len(r.prompt)) for r in requests}
    prefills = {bucket for kind, bucket in engine.compiled if kind == "prefill"}
    assert len(buckets) >= 2 and prefills == buckets | {specjax.planner.MIN_BUCKET}
    assert {width for kind, width in engine.compiled if kind == "write"} == set(engine._widths)
    widths = {width for kind, width in engine.compiled if kind == "lean"}
    assert widths <= set(engine._widths) and len(widths) >= 2  # chunks ran at the occupied width
    compiled = engine.num_compiles
    again = [dataclasses.replace(r, prompt=r.prompt[::-1]) for r in requests]  # same buckets
    tokens, _ = drive(engine, again, seed=3)
    assert engine.num_compiles == compiled
    assert tokens[2] == alone(TARGET, again[2], proposer)


@pytest.mark.parametrize(
    "name", ["plain", "plain-logprobs", pytest.param("dynamic-ngram", marks=pytest.mark.slow)]
)
def test_a_precompiled_engine_compiles_nothing_while_it_serves(name):
    """After `precompile` (the loop at every width, lean and full, with Dynamic the quiet variant of
    each, with logprobs the full loop computing them, and the prefill of the given prompt lengths'
    buckets, with logprobs the prefill scoring the prompt too), greedy and sampled requests
    arriving at random steps, some asking for logprobs, compile nothing: a compile while serving
    would stall every running request."""
    proposer = (
        None if name != "dynamic-ngram" else specjax.Dynamic(specjax.NGram(k=3), specjax.GoodputSchedule())
    )
    logprobs = 2 if name == "plain-logprobs" else None
    prompts = _prompts(5, 8)
    engine = Engine(TARGET, proposer, max_batch=4, max_model_len=96, chunk_steps=3, logprobs=logprobs)
    compiled = engine.precompile([len(p) for p in prompts])
    widths = set(engine._widths)
    loops = {"lean", "resume"} | (set() if proposer is None else {"lean-quiet", "resume-quiet"})
    loops |= set() if logprobs is None else {"resume+logprobs"}
    assert set(engine._batch.loops) == loops
    for loop in loops:
        assert {w for kind, w in engine.compiled if kind == loop} == widths
    buckets = {admission_bucket(len(p)) for p in prompts}
    assert {b for kind, b in engine.compiled if kind == "prefill"} == buckets | {specjax.planner.MIN_BUCKET}
    scored = {b for kind, b in engine.compiled if kind == "scored_prefill"}
    assert scored == (set() if logprobs is None else buckets)
    checks = {w for kind, w in engine.compiled if kind == "may_draft"}  # which of the two runs
    assert checks == (set() if proposer is None else widths)
    programs = len(loops) + (proposer is not None)
    prefills = len(buckets - {specjax.planner.MIN_BUCKET}) + len(scored)
    assert compiled == programs * len(widths) + prefills
    before = engine.num_compiles
    samplings = [specjax.Sampling(), specjax.Sampling(temperature=0.8, seed=3)]
    asks = {} if logprobs is None else {1: {"logprobs": 2}, 3: {"logprobs": 0, "prompt_logprobs": 1}}
    requests = [
        Request(p, samplings[i % 3 == 2], max_new_tokens=6 + i, **asks.get(i, {}))
        for i, p in enumerate(prompts)
    ]
    engine.stats.reset()
    tokens, finals = drive(engine, requests, seed=4)
    assert engine.num_compiles == before
    # Where the time went: every admission counted, and the steps by width add up to the
    # loop's own count of steps across the requests' rows (each row steps once per loop step).
    stats = engine.stats
    assert stats.admissions == len(requests) and stats.admission_s > 0
    assert set(stats.steps) <= widths and set(stats.chunk_s) == set(stats.steps)
    assert sum(stats.steps.values()) >= max(int(u.metrics.steps.sum()) for u in finals.values())
    assert all(stats.ms_per_step(w) > 0 for w in stats.steps)
    assert tokens[0] == alone(TARGET, requests[0], proposer)
    if proposer is not None:  # drafts were verified, and accepted in part
        accepted, drafted = accepted_and_drafted(finals)
        assert 0.1 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    assert engine.precompile([len(p) for p in prompts]) == 0  # nothing left to compile
    with pytest.raises(ValueError, match="prompt_lengths holds 97"):
        engine.precompile([97])


@pytest.mark.parametrize("name", ["plain", pytest.param("draft", marks=pytest.mark.slow)])
def test_seeded_sampled_request_is_the_same_whatever_runs_beside_it(name):
    """A seeded request draws the same tokens alone, in a crowd, and joining late; requests
    without a seed draw from the engine's key folded with their id."""
    proposer = PROPOSERS[name]()
    sampling = specjax.Sampling(temperature=0.9, top_p=0.95, seed=1234)
    probe = Request(_prompts(3, 1)[0], sampling=sampling, max_new_tokens=24)
    crowd = [
        Request(p, specjax.Sampling(temperature=1.0, top_k=20), max_new_tokens=15) for p in _prompts(4, 5)
    ]

    greedy = Request(_prompts(9, 1)[0], max_new_tokens=40)  # outlives the sampled: lean chunks follow
    crowd.append(greedy)

    lone = Engine(TARGET, proposer, max_batch=1, max_model_len=96, chunk_steps=4)
    by_itself, _ = drive(lone, [probe], seed=0)
    engine = Engine(TARGET, proposer, max_batch=3, max_model_len=96, chunk_steps=2)
    first, _ = drive(engine, [probe, *crowd], seed=5)
    late, _ = drive(engine, [*crowd[:3], probe, *crowd[3:]], seed=6)  # joins at a later step
    assert first[0] == by_itself[0] == late[3]
    assert len(set(map(tuple, (first[1], first[2], first[3])))) == 3  # unseeded rows differ
    assert first[6] == late[6] == alone(TARGET, greedy, proposer)
    assert {"resume", "lean"} <= {kind for kind, _ in engine.compiled}  # both programs ran

    # With the request's own options compiled in (as `specjax.stream` does), it is generate's.
    own = Engine(TARGET, proposer, max_batch=2, max_model_len=96, chunk_steps=4, warp=WarpSpec.of(sampling))
    tokens, _ = drive(
        own, [probe, dataclasses.replace(probe, sampling=dataclasses.replace(sampling, seed=7))], 1
    )
    assert tokens[0] == alone(TARGET, probe, proposer)


def _recording_programs(engine: Engine) -> list:
    """The kinds of every program the engine runs ("write", ("resize", 2), ...), as they run."""
    kinds: list = []
    run = engine._batch.run
    engine._batch.run = lambda kind, *args: kinds.append(kind) or run(kind, *args)
    return kinds


def _recording_chunks(engine: Engine) -> list[str]:
    """The kinds of program ("lean", "lean-quiet", ...) of the engine's loop chunks, as they run."""
    kinds: list[str] = []
    run = engine._batch.run
    engine._batch.run = lambda kind, *args: (
        (kind in engine._batch.loops and kinds.append(kind)) or run(kind, *args)
    )
    return kinds


# A verify pass cheap for one row and dear for more: alone a row drafts, two or three rows stop
# drafting (k = 0 for the batch) and probe now and then.
QUIETING = specjax.GoodputSchedule(verify_cost=0.05, verify_cost_by_rows=((1, 0.05), (2, 0.8)), probe_every=2)


@pytest.mark.slow
def test_quiet_chunks_step_as_the_full_program_would():
    """While the schedule lets no row draft, chunks run the quiet program (one-token steps) and end
    when a row may draft (a probe), which a full chunk then drafts. The batch decides as it would
    without quiet chunks: with every request there from the start (so that chunk boundaries
    cannot move an arrival), the tokens and each request's figures are the same with quiet
    programs and without, and greedy equals generate alone."""
    proposer = specjax.Dynamic(specjax.DraftModel(NOISY_DRAFT, k=3), QUIETING)  # catches up in quiet steps
    requests = [Request(p, max_new_tokens=n) for p, n in zip(_prompts(6, 3), (40, 28, 34), strict=True)]
    runs, runs_stats = [], []
    for quiet in (True, False):
        engine = Engine(TARGET, proposer, max_batch=3, max_model_len=96, chunk_steps=6)
        assert {"lean-quiet", "resume-quiet"} <= set(engine._batch.loops)
        if not quiet:  # every chunk generate's whole loop, as before quiet programs
            engine._batch.loops = {
                kind: dataclasses.replace(loop, proposer=dataclasses.replace(loop.proposer, program="whole"))
                for kind, loop in engine._batch.loops.items()
                if not kind.endswith("-quiet")
            }
        chunks = _recording_chunks(engine)
        ids = [engine.add(r) for r in requests]
        tokens, finals = {i: [] for i in ids}, {}
        while engine.has_work:
            for update in engine.step():
                tokens[update.request_id] += update.tokens
                if update.finished:
                    finals[update.request_id] = update.metrics
        runs.append(([tokens[i] for i in ids], [finals[i] for i in ids], chunks))
        runs_stats.append(engine.stats)
    (quiet_tokens, quiet_metrics, quiet_chunks), (full_tokens, full_metrics, full_chunks) = runs
    assert quiet_tokens == full_tokens
    for i, request in enumerate(requests):
        assert quiet_tokens[i] == alone(TARGET, request, proposer), i
        for field in ("steps", "drafting_steps", "drafted", "accepted", "emitted", "accepted_at"):
            np.testing.assert_array_equal(getattr(quiet_metrics[i], field), getattr(full_metrics[i], field))
    assert sum(int(m.drafting_steps.sum()) for m in quiet_metrics) > 0  # alone at first, and probes
    accepted = sum(int(m.accepted.sum()) for m in quiet_metrics)
    drafted = sum(int(m.drafted.sum()) for m in quiet_metrics)
    assert 0.1 * drafted < accepted < 0.95 * drafted, (accepted, drafted)  # rejections too
    assert quiet_chunks.count("lean-quiet") >= 3 and quiet_chunks.count("lean") >= 3, quiet_chunks
    stats = runs_stats[0]  # the quiet chunks' steps counted apart, within all of a width's
    assert 0 < sum(stats.quiet_steps.values()) < sum(stats.steps.values())
    assert all(
        stats.quiet_steps[w] <= stats.steps[w] and stats.quiet_s[w] <= stats.chunk_s[w]
        for w in stats.quiet_steps
    )
    assert "quiet" in stats.summary()
    assert set(full_chunks) == {"lean"}


@pytest.mark.slow
def test_arrivals_join_a_quiet_batch_at_its_k_and_greedy_still_equals_generate_alone():
    """Requests arriving at random steps into a batch whose schedule stopped drafting: each arrival
    takes the batch's k (0: the chunk after its admission stays quiet) and every request's greedy
    tokens equal generate's alone."""
    proposer = specjax.Dynamic(specjax.DraftModel(NOISY_DRAFT, k=3), QUIETING)  # catches up in quiet steps
    limits = (30, 12, 26, 18, 22, 9)
    requests = [Request(p, max_new_tokens=n) for p, n in zip(_prompts(8, 6), limits, strict=True)]
    engine = Engine(TARGET, proposer, max_batch=3, max_model_len=96, chunk_steps=4)
    chunks = _recording_chunks(engine)
    tokens, finals = drive(engine, requests, seed=9)
    for i, request in enumerate(requests):
        assert tokens[i] == alone(TARGET, request, proposer), i
    accepted, drafted = accepted_and_drafted(finals)
    assert 0.1 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    assert {"lean-quiet", "lean"} <= set(chunks), chunks

    # An arrival into two rows that stopped drafting (their next probe some 30 steps away): the
    # chunk after its admission is quiet, where the prior's k would have made the batch draft.
    engine = Engine(TARGET, proposer, max_batch=3, max_model_len=96, chunk_steps=4)
    chunks = _recording_chunks(engine)
    for request in requests[:2]:
        engine.add(dataclasses.replace(request, max_new_tokens=60))
    while chunks[-1:] != ["lean-quiet"]:
        engine.step()
    engine.add(requests[2])
    engine.step()  # admits it, then runs a chunk
    assert chunks[-1] == "lean-quiet" and engine.num_running == 3


WORDY = specjax.Model(TARGET.config, TARGET.params, tiny_tokenizer(), name="tiny-wordy")


def test_stop_strings_of_requests_that_come_and_go():
    """Each request stops at its own strings and token ids, while the automaton over the running
    requests' strings is rebuilt as they come and go; finish reasons say why each ended."""
    prompts = _prompts(7, 6, repetitive=False)
    options = [
        specjax.Sampling(stop=["e"]),
        specjax.Sampling(stop=["ab", "zz"]),
        specjax.Sampling(),
        specjax.Sampling(stop=["Q", "e"]),
        specjax.Sampling(stop_token_ids=[5, 17, 40]),
        specjax.Sampling(stop=["@"]),
    ]
    requests = [Request(p, s, max_new_tokens=40) for p, s in zip(prompts, options, strict=True)]
    engine = Engine(WORDY, max_batch=2, max_model_len=96, chunk_steps=3)
    tokens, finals = drive(engine, requests, seed=3)
    reasons = []
    for i, request in enumerate(requests):
        expected = alone(WORDY, request)
        assert tokens[i] == expected, i
        stopped = len(expected) < 40 or expected[-1] in request.sampling.stop_token_ids
        text = WORDY.tokenizer.decode(expected)
        stopped |= any(s in text for s in request.sampling.stop)
        assert finals[i].finish_reason == ("stop" if stopped else "length"), i
        reasons.append(finals[i].finish_reason)
    assert "stop" in reasons and "length" in reasons


def test_a_request_whose_stop_strings_do_not_fit_beside_the_running_ones_waits():
    """The automaton holds max_stop_states states: a request whose strings would overflow it
    beside the running requests' waits for them to finish; one that could never fit is refused."""
    engine = Engine(WORDY, max_batch=2, max_model_len=64, chunk_steps=2, max_stop_states=8)
    first = Request([10, 20, 30], specjax.Sampling(stop=["xyz12"]), max_new_tokens=12)
    second = Request([11, 21, 31], specjax.Sampling(stop=["QRS7"]), max_new_tokens=12)
    ids = [engine.add(first), engine.add(second)]
    updates = engine.step()
    assert [u.request_id for u in updates] == ids[:1] and engine.num_waiting == 1
    tokens = {i: [] for i in ids}
    for u in updates:
        tokens[u.request_id] += u.tokens
    while engine.has_work:
        for u in engine.step():
            tokens[u.request_id] += u.tokens
    assert [tokens[i] for i in ids] == [alone(WORDY, r) for r in (first, second)]
    with pytest.raises(ValueError, match="max_stop_states=8"):
        engine.add(Request([1], specjax.Sampling(stop=["abcdefghij"]), max_new_tokens=4))


@pytest.mark.slow  # 20 s; the server's test of the opt-out runs by default
def test_opted_out_request_decodes_plainly_in_a_speculating_batch():
    proposer = specjax.DraftModel(NOISY_DRAFT, k=3)
    prompts = _prompts(8, 4)
    requests = [Request(p, max_new_tokens=20, speculate=i != 1) for i, p in enumerate(prompts)]
    engine = Engine(TARGET, proposer, max_batch=4, max_model_len=96, chunk_steps=4)
    tokens, finals = drive(engine, requests, seed=4)
    for i, request in enumerate(requests):
        assert tokens[i] == alone(TARGET, request), i
    assert int(finals[1].metrics.drafted.sum()) == 0
    assert int(finals[1].metrics.steps.sum()) == 19  # one token per step after the prefill's
    assert all(int(finals[i].metrics.accepted.sum()) > 0 for i in (0, 2, 3))


def test_abort_and_counters():
    engine = Engine(TARGET, specjax.DraftModel(TARGET, k=2), max_batch=2, max_model_len=64, chunk_steps=2)
    first = engine.add(Request([1, 2, 3], max_new_tokens=30))
    waiting = [engine.add(Request([4, 5, 6], max_new_tokens=30)) for _ in range(2)]
    updates = engine.step()
    assert {u.request_id for u in updates} == {first, waiting[0]}
    # The target as its own draft accepts everything: counters are exact.
    u = updates[0]
    assert u.num_drafts == 2 and u.num_draft_tokens == 4 and u.num_accepted_tokens == 4
    assert u.accepted_per_pos == [2, 2] and len(u.tokens) == 1 + 2 * 3
    assert engine.num_waiting == 1 and engine.num_running == 2
    assert [(u.finished, u.finish_reason) for u in engine.abort(waiting[1])] == [(True, "abort")]
    assert engine.abort(first)[0].finish_reason == "abort"
    assert engine.abort(first) == []
    assert engine.num_running == 1 and engine.num_waiting == 0
    rest = []
    while engine.has_work:
        rest += engine.step()
    assert rest[-1].finished and rest[-1].finish_reason == "length"
    assert sum(len(u.tokens) for u in updates[1:] + rest) == 30


def test_chunks_are_short_while_a_slot_is_free_and_end_when_a_row_finishes():
    """A chunk runs admission_steps steps while a slot is free (an arrival waits at most that
    long for its prefill), chunk_steps when every slot is taken, and ends at the step where a row
    finishes (its last tokens reported at once), whether or not a request waits."""
    engine = Engine(TARGET, max_batch=2, max_model_len=64, chunk_steps=6, admission_steps=2)
    long = engine.add(Request([1, 2, 3], max_new_tokens=40))
    (update,) = engine.step()  # one row, a slot free: 2 steps
    assert update.request_id == long and len(update.tokens) == 1 + 2
    short = engine.add(Request([4, 5, 6], max_new_tokens=4))
    updates = {u.request_id: u for u in engine.step()}  # both slots taken: up to 6 steps
    assert updates[short].finished and len(updates[short].tokens) == 4  # its prefill's and 3 steps
    assert len(updates[long].tokens) == 3  # the chunk ended with the short request, nothing waiting
    (update,) = engine.step()  # a slot free again
    assert len(update.tokens) == 2 and sum(engine.stats.steps.values()) == 2 + 3 + 2
    while engine.has_work:
        engine.step()
    assert engine.admission_steps == 2
    assert Engine(TARGET, max_batch=1, max_model_len=64, chunk_steps=3).admission_steps == 3  # min(4, 3)
    with pytest.raises(ValueError, match="admission_steps=5 exceeds chunk_steps=3"):
        Engine(TARGET, max_batch=1, max_model_len=64, chunk_steps=3, admission_steps=5)
    with pytest.raises(ValueError, match="admission_steps must be an integer >= 1, got 0"):
        Engine(TARGET, max_batch=1, max_model_len=64, admission_steps=0)
    with pytest.raises(ValueError, match="narrow_after must be an integer >= 0, got -1"):
        Engine(TARGET, max_batch=1, max_model_len=64, narrow_after=-1)


def test_requests_left_past_a_narrower_width_move_down_into_free_slots():
    """When the requests before them finish, the last two requests (slots 2 and 3 of 4) move into
    slots 0 and 1 and the batch steps 2 wide: a greedy and a seeded sampled one, each still
    what it gives alone (its row, key and counters moved with it); nothing compiles for it."""
    sampling = specjax.Sampling(temperature=0.9, top_p=0.95, seed=77)
    sampled = Request(_prompts(12, 1)[0], sampling=sampling, max_new_tokens=30)
    greedy = Request(_prompts(13, 1)[0], max_new_tokens=26)
    lone = Engine(TARGET, max_batch=1, max_model_len=96, chunk_steps=4)
    by_itself, _ = drive(lone, [sampled], seed=0)
    engine = Engine(TARGET, max_batch=4, max_model_len=96, chunk_steps=4)
    at_start = set(engine.compiled)
    short = [Request(p, max_new_tokens=3) for p in _prompts(14, 2)]
    ids = [engine.add(r) for r in (*short, sampled, greedy)]
    tokens = {i: [] for i in ids}
    widths = []
    while engine.has_work:
        for update in engine.step():
            tokens[update.request_id] += update.tokens
        widths.append(engine.width)
    assert widths[0] == 4 and 2 in widths  # 4 wide, then 2 once the short ones finished
    assert tokens[ids[2]] == by_itself[0]
    assert tokens[ids[3]] == alone(TARGET, greedy)
    assert {w for kind, w in at_start if kind == "move"} == {2, 4}  # compiled at start
    assert {kind for kind, _ in set(engine.compiled) - at_start} <= {"prefill", "resume", "lean"}


def test_the_batch_narrows_only_after_narrow_after_chunks_and_arrivals_meanwhile_take_the_free_slots():
    """When requests finish, the state keeps its width for `narrow_after` chunks: requests that
    arrive meanwhile (a served client's next request, milliseconds later) take the free slots
    with no move, no narrowing and no growth; once the rows have fit a narrower width for longer,
    the state narrows. Every request still gives what it gives alone."""
    long = Request(_prompts(31, 1)[0], max_new_tokens=40)
    engine = Engine(TARGET, max_batch=4, max_model_len=96, chunk_steps=4, narrow_after=2)
    runs = []
    run = engine._batch.run
    engine._batch.run = lambda kind, *args: runs.append(kind) or run(kind, *args)
    short = [Request(p, max_new_tokens=2) for p in _prompts(32, 3)]
    ids = [engine.add(r) for r in (long, *short)]  # the long one in slot 0
    tokens = {i: [] for i in ids}

    def step():
        for update in engine.step():
            tokens[update.request_id] += update.tokens
        return engine.width

    assert step() == 4  # all four admitted
    while engine.num_running > 1:  # the short ones finish
        assert step() == 4
    runs.clear()
    assert step() == 4  # the long request alone, still 4 wide: one chunk of narrow_after
    later = [Request(p, max_new_tokens=6) for p in _prompts(33, 2)]
    ids += [engine.add(r) for r in later]
    tokens.update({i: [] for i in ids[4:]})
    assert step() == 4  # they took slots 1 and 2 where the state was
    assert not [kind for kind in runs if kind in ("move", "resize") or kind[0] in ("resize", "fill")]
    widths = [step() for _ in range(6)]  # the two finish; the long one runs alone again
    assert engine.num_running == 1 and widths[-1] == 1
    # once both had finished: narrow_after chunks still 4 wide, then 1
    assert widths[widths.index(1) - 2 :].count(4) == 2
    while engine.has_work:
        step()
    assert tokens[ids[0]] == alone(TARGET, long)
    assert [tokens[i] for i in ids[4:]] == [alone(TARGET, r) for r in later]


def test_the_batch_does_not_narrow_for_rows_that_end_within_a_chunk():
    """The tail of a burst: once the rows left all end within chunk_steps steps, the state keeps
    its width (a narrowing's moves and copy would cost more than its cheaper steps save); with
    more left to generate, it narrows after narrow_after chunks as before."""
    for left, narrows in ((6, False), (30, True)):
        engine = Engine(TARGET, max_batch=4, max_model_len=96, chunk_steps=8, narrow_after=0)
        runs = _recording_programs(engine)
        requests = [Request(p, max_new_tokens=2) for p in _prompts(34, 3)]
        requests.append(Request(_prompts(35, 1)[0], max_new_tokens=3 + left))
        tokens = engine.run(requests)
        narrowed = [kind for kind in runs if isinstance(kind, tuple) and kind[0] == "resize" and kind[1] < 4]
        assert bool(narrowed) == narrows, (left, runs)
        assert tokens[3] == alone(TARGET, requests[3])


def test_each_narrowing_waits_narrow_after_chunks_not_only_the_first():
    """Four requests finishing at three times: the state narrows 4 -> 2 once two rows have fit 2
    slots for longer than narrow_after chunks, and 2 -> 1 only after the last but one has finished
    and the long row has fit 1 slot for narrow_after chunks too. The medium request finishes in
    the first chunk at 2 slots, so a count carried over from the first narrowing would narrow
    again at once. Every request gives what it gives alone."""
    long, medium = (Request(p, max_new_tokens=n) for p, n in zip(_prompts(51, 2), (40, 8), strict=True))
    engine = Engine(TARGET, max_batch=4, max_model_len=96, chunk_steps=4, narrow_after=1)
    ids = [engine.add(r) for r in (long, medium, *[Request(p, max_new_tokens=2) for p in _prompts(52, 2)])]
    tokens = {i: [] for i in ids}
    running, widths = [], []
    while engine.has_work:
        running.append(engine.num_running)
        for update in engine.step():
            tokens[update.request_id] += update.tokens
        widths.append(engine.width)
    assert 2 in widths and 1 in widths, widths
    first_2, first_1 = widths.index(2), widths.index(1)
    # each narrowing came after a chunk at the wider width whose rows already fit the narrower one
    assert widths[first_2 - 1] == 4 and running[first_2 - 1] <= 2, (running, widths)
    assert widths[first_1 - 1] == 2 and running[first_1 - 1] == 1, (running, widths)
    assert [tokens[i] for i in ids[:2]] == [alone(TARGET, long), alone(TARGET, medium)]


def test_a_burst_back_to_max_batch_writes_into_the_widest_state_kept():
    """Once the batch has narrowed from max_batch, the max_batch-wide state's buffers are kept, and
    a burst of arrivals that needs max_batch slots again is written into them (the `fill` program,
    compiled at start) rather than into a new state: the request running through it and the new
    ones each still give what they give alone, and the slots left free are free rows again (a
    row that moved down stays behind in the kept buffers, not done)."""
    sampling = specjax.Sampling(temperature=0.9, top_p=0.95, seed=5)
    long = Request(_prompts(21, 1)[0], max_new_tokens=40)
    later = [Request(_prompts(22, 1)[0], max_new_tokens=12), Request(_prompts(23, 1)[0], sampling, 10)]
    lone = Engine(TARGET, max_batch=1, max_model_len=96, chunk_steps=4)
    by_itself, _ = drive(lone, [later[1]], seed=0)
    engine = Engine(TARGET, max_batch=4, max_model_len=96, chunk_steps=4)
    at_start = set(engine.compiled)
    runs = []
    run = engine._batch.run
    engine._batch.run = lambda kind, *args: runs.append(kind) or run(kind, *args)
    short = [Request(p, max_new_tokens=2) for p in _prompts(24, 3)]
    ids = [engine.add(r) for r in (*short, long)]  # the long one in slot 3
    tokens = {i: [] for i in ids}
    while engine.width > 1 or engine.num_running < 1:  # until it moved down and the batch narrowed
        assert engine.has_work, "the batch never narrowed to the long request alone"
        for update in engine.step():
            tokens[update.request_id] += update.tokens
    ids += [engine.add(r) for r in later]
    tokens.update({i: [] for i in ids[4:]})
    updates = engine.step()  # admits both: the state back to 4 slots (2 would not hold 3 rows)
    assert ("fill", 1) in runs and engine.width == 4
    done = np.asarray(engine._batch.state.done)
    assert all(done[b] for b, slot in enumerate(engine._slots) if slot is None)
    while True:
        for update in updates:
            tokens[update.request_id] += update.tokens
        if not engine.has_work:
            break
        updates = engine.step()
    assert tokens[ids[3]] == alone(TARGET, long)
    assert tokens[ids[4]] == alone(TARGET, later[0])
    assert tokens[ids[5]] == by_itself[0]
    assert {kind for kind, _ in set(engine.compiled) - at_start} <= {"prefill", "resume", "lean"}


def test_growth_back_to_a_width_below_max_batch_writes_into_the_state_it_narrowed_from():
    """The kept buffers are the widest state the batch narrowed from, whatever its width: an engine
    of 8 slots running 4 requests narrows to 1, and 3 arrivals grow it back to 4 in place (`fill`
    from 1 into the 4-wide buffers, no fresh state); every request gives what it gives alone."""
    long = Request(_prompts(41, 1)[0], max_new_tokens=36)
    later = [Request(p, max_new_tokens=8) for p in _prompts(42, 3)]
    engine = Engine(TARGET, max_batch=8, max_model_len=96, chunk_steps=4, narrow_after=0)
    runs = []
    run = engine._batch.run
    engine._batch.run = lambda kind, *args: runs.append((kind, args[0])) or run(kind, *args)
    ids = [engine.add(r) for r in (long, *[Request(p, max_new_tokens=2) for p in _prompts(43, 3)])]
    tokens = {i: [] for i in ids}
    while engine.width > 1 or engine.num_running < 1:
        assert engine.has_work, "the batch never narrowed to the long request alone"
        for update in engine.step():
            tokens[update.request_id] += update.tokens
    assert engine._batch.spare is not None and engine._batch.spare.done.shape[0] == 4
    runs.clear()
    ids += [engine.add(r) for r in later]
    tokens.update({i: [] for i in ids[4:]})
    while engine.has_work:
        for update in engine.step():
            tokens[update.request_id] += update.tokens
    assert (("fill", 1), 4) in runs and not [r for r in runs if r[0] in (("resize", 4), ("resize", 8))], runs
    assert tokens[ids[0]] == alone(TARGET, long)
    assert [tokens[i] for i in ids[4:]] == [alone(TARGET, r) for r in later]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(prompt=[]), "prompt must be a non-empty list"),
        (dict(prompt=[1, VOCAB]), f"token ids must be integers in \\[0, {VOCAB}\\)"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(max_new_tokens=60), "exceeds the engine's max_model_len of 64"),
        (dict(sampling=specjax.Sampling(logit_bias={VOCAB: 1.0})), "logit_bias has token id"),
        (dict(speculate=None), "speculate must be True or False"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(change, message):
    engine = _small_engine()
    with pytest.raises(ValueError, match=message):
        engine.add(dataclasses.replace(Request([1, 2, 3, 4, 5], max_new_tokens=8), **change))
    assert engine.num_waiting == 0


def test_engine_refuses_what_it_was_not_built_for():
    greedy_only = Engine(TARGET, max_batch=1, max_model_len=64, warp=WarpSpec())
    with pytest.raises(ValueError, match="built without temperature > 0"):
        greedy_only.add(Request([1, 2], specjax.Sampling(temperature=1.0, seed=1), max_new_tokens=8))
    with pytest.raises(ValueError, match="max_model_len=600 exceeds the model's context of 512"):
        Engine(TARGET, max_model_len=600)
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1, got 0"):
        Engine(TARGET, max_batch=0)


_ENGINE = {}


def _small_engine() -> Engine:
    if "engine" not in _ENGINE:
        _ENGINE["engine"] = Engine(tiny_model(0), max_batch=1, max_model_len=64)
    return _ENGINE["engine"]


def test_engine_keeps_jax_arrays_on_device_between_steps():
    """The batch's state stays a device pytree between chunks: nothing of it is a numpy copy."""
    engine = Engine(TARGET, max_batch=2, max_model_len=64, chunk_steps=2)
    engine.add(Request([3, 1, 4, 1, 5], max_new_tokens=10))
    engine.step()
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(engine._batch.state))
