"""The engine on a paged KV cache (EngineConfig.page_size; specjax/serve/engine_pages.py): rows
hold the pages their lengths need, a pool too small for every request preempts the newest and
starts it again, and every request still gets what the dense engine (and `generate` alone)
gives it."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from drafters import (
    first_layer_dflash,
    first_layer_eagle,
    first_layer_eagle3,
    first_layer_mtp,
    layered_target,
    noisy_copy,
    quiet_target,
    trained_medusa,
    trained_mlp_speculator,
)
from test_engine import NOISY_DRAFT, TARGET, _prompts, accepted_and_drafted, alone, drive

import specjax
from specjax.serve import Engine, EngineConfig, Request
from specjax.speculate.sampling import Sampling

OPTIONS = dict(max_batch=4, max_model_len=96, chunk_steps=4)
LENGTHS = (30, 12, 25, 40, 8, 20)


def _requests(seed: int) -> list[Request]:
    prompts = _prompts(seed, len(LENGTHS))
    return [Request(p, max_new_tokens=n) for p, n in zip(prompts, LENGTHS, strict=True)]


def _accepted(finals) -> list[int]:
    return [int(finals[i].metrics.accepted.sum()) for i in sorted(finals)]


def _all_pages_back(engine: Engine) -> None:
    """Every page is free again once every request has ended (none held, none leaked)."""
    pool = engine._pages.pools[0]
    pool.check()
    assert pool.available_pages == pool.usable_pages


@pytest.mark.parametrize(
    "proposer",
    [
        None,
        specjax.NGram(k=3),
        pytest.param(  # (a head on pages: the default set's on a mesh, tests/test_engine_mesh.py)
            specjax.Eagle(first_layer_eagle(TARGET), k=3, tree=specjax.TokenTree.top_k((2, 2, 1))),
            id="eagle-tree",
            marks=pytest.mark.slow,
        ),
        pytest.param(specjax.DraftModel(NOISY_DRAFT, k=3), id="draft", marks=pytest.mark.slow),
        pytest.param(specjax.SelfDraft(layers=1, k=3), id="self-draft", marks=pytest.mark.slow),
    ],
)
def test_paged_engine_gives_the_dense_engines_tokens_and_accepted_counts(proposer):
    """Requests joining at random steps: on pages of 16 slots, with a pool for every slot's
    max_model_len (no preemption), the same tokens and accepted drafts as the dense engine, and
    greedy = generate alone."""
    requests = _requests(3)
    dense_tokens, dense_finals = drive(Engine(TARGET, proposer, **OPTIONS), requests, seed=0)
    engine = Engine(TARGET, proposer, **OPTIONS, page_size=16)
    tokens, finals = drive(engine, requests, seed=0)
    assert tokens == dense_tokens
    assert _accepted(finals) == _accepted(dense_finals)
    assert engine.stats.preemptions == 0
    if proposer is not None:  # drafts accepted part of the time: rollbacks happened on pages
        accepted, drafted = accepted_and_drafted(finals)
        assert 0 < accepted < drafted, (accepted, drafted)
    for i in (0, 3):
        assert tokens[i] == alone(TARGET, requests[i], proposer)
    _all_pages_back(engine)


def test_a_pool_too_small_for_every_request_preempts_the_newest_and_starts_it_again():
    """Seven pages of 16 slots hold one request of max_model_len but not four: rows grow into
    the pool, the newest running request is preempted when an older one cannot grow, and starts
    again from its prompt later. Each request's tokens are still the dense engine's: greedy ones,
    seeded sampled ones and ones drawn from the engine's key, none sent twice; with logprobs, each
    token's are the dense engine's. Every page is back at the end."""
    rng = np.random.default_rng(0)
    sampled = Sampling(temperature=1.0, top_p=0.9)
    requests = _requests(5)
    for i in (1, 4):  # two seeded, one drawn from the engine's key (by its request id)
        requests[i] = dataclasses.replace(
            requests[i], sampling=dataclasses.replace(sampled, seed=int(rng.integers(99)))
        )
    requests[2] = dataclasses.replace(requests[2], sampling=sampled, logprobs=2)
    requests[3] = dataclasses.replace(requests[3], logprobs=1)
    options = dict(OPTIONS, logprobs=2)

    def run(engine):
        ids = [engine.add(r) for r in requests]  # all at once: the same ids in both engines
        tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
        while engine.has_work:
            for update in engine.step():
                tokens[update.request_id] += update.tokens
                if update.logprobs is not None:
                    assert list(update.logprobs.token_ids) == update.tokens
                    logprobs[update.request_id] += list(update.logprobs.logprobs)
        return [tokens[i] for i in ids], [logprobs[i] for i in ids]

    dense_tokens, dense_logprobs = run(Engine(TARGET, **options))
    engine = Engine(TARGET, **options, page_size=16, num_pages=7)
    assert engine.kv_cache.capacity_tokens == 7 * 16
    tokens, logprobs = run(engine)
    assert engine.stats.preemptions > 0
    assert tokens == dense_tokens
    for got, want in zip(logprobs, dense_logprobs, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert tokens[0] == alone(TARGET, requests[0])
    _all_pages_back(engine)


def test_long_prompts_in_chunks_on_pages():
    """Prompts longer than prefill_chunk are prefilled in chunks beside the running rows, then
    written into their pages: the dense engine's tokens."""
    rng = np.random.default_rng(1)
    requests = [
        Request(rng.integers(0, 64, n).tolist(), max_new_tokens=m) for n, m in ((70, 10), (20, 30), (90, 6))
    ]
    options = dict(OPTIONS, max_model_len=160, prefill_chunk=32)
    dense, _ = drive(Engine(TARGET, **options), requests, seed=2)
    engine = Engine(TARGET, **options, page_size=16, num_pages=14)
    tokens, _ = drive(engine, requests, seed=2)
    assert tokens == dense
    assert engine.stats.prompt_chunks > 0
    _all_pages_back(engine)


def test_an_aborted_request_frees_its_pages_at_once():
    engine = Engine(TARGET, **OPTIONS, page_size=16)
    pool = engine._pages.pools[0]
    ids = [engine.add(r) for r in _requests(7)[:3]]
    engine.step()
    held = pool.usable_pages - pool.available_pages
    assert held > 0
    pages = len(pool.pages(ids[1]))
    [final] = engine.abort(ids[1])
    assert final.finish_reason == "abort"
    assert pool.usable_pages - pool.available_pages == held - pages
    while engine.has_work:
        engine.step()
    _all_pages_back(engine)


def test_pages_move_no_pool_and_compile_nothing_new():
    """Widths change as requests come and go: the programs that resize the batch run on it
    without the pool (the pool's buffer is the one allocated at start), and nothing compiles
    while serving beyond the prefill buckets and loops the dense engine compiles too."""
    engine = Engine(TARGET, **OPTIONS, page_size=16, narrow_after=0)
    pool = engine._batch.state.cache.k[0].unsafe_buffer_pointer()
    at_start = engine.compiled
    widths = []
    requests = [Request(p, max_new_tokens=n) for p, n in zip(_prompts(9, 4), (2, 3, 40, 2), strict=True)]
    ids = [engine.add(r) for r in requests]
    while engine.has_work:
        engine.step()
        widths.append(engine.width)
    ids.append(engine.add(requests[0]))  # and back to a wider state
    while engine.has_work:
        engine.step()
        widths.append(engine.width)
    assert widths[0] == 4 and 1 in widths, widths
    assert engine._batch.state.cache.k[0].unsafe_buffer_pointer() == pool
    assert {kind for kind, _ in engine.compiled - at_start} <= {"pool_row", "resume", "lean"}
    assert {kind for kind, _ in at_start} >= {"pool_chunks", "write", "write_paged", "move"}


def test_bad_page_options_are_refused_naming_them():
    for options, match in (
        (dict(page_size=24), "page_size must be None or a power of two"),
        (dict(page_size=8), "page_size must be None or a power of two"),
        (dict(num_pages=10), "num_pages=10 sizes a paged cache: give a page_size"),
        (dict(kv_cache_memory=0.5), "kv_cache_memory=0.5 sizes a paged cache"),
        (dict(page_size=16, num_pages=10, kv_cache_memory=1 << 20), "num_pages or kv_cache_memory, not both"),
        (dict(page_size=16, kv_cache_memory=1.5), "kv_cache_memory must be bytes"),
        (dict(page_size=16, kv_cache_memory=0), "kv_cache_memory must be bytes"),
        (dict(page_size=16, num_pages=0), "num_pages"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**options)
    with pytest.raises(
        ValueError, match=r"num_pages=6: a pool of 6 pages of 16 slots \(96 tokens\) cannot hold one"
    ):
        Engine(TARGET, **OPTIONS, page_size=16, num_pages=6)
    with pytest.raises(
        ValueError,
        match=r"prompt of 90 tokens it exceeds the engine's max_model_len of 96 tokens \(its KV cache's "
        r"pool holds 112 tokens\)",
    ):
        Engine(TARGET, **OPTIONS, page_size=16, num_pages=7).add(Request([1] * 90, max_new_tokens=7))
    page = specjax.models.cache.cache_bytes(TARGET.config, 1, 16, 4)
    engine = Engine(TARGET, **OPTIONS, page_size=16, kv_cache_memory=9 * page)
    assert engine.kv_cache.capacity_tokens == 8 * 16  # (the null page is counted in the bytes)


def test_free_slots_write_into_the_null_page():
    """A finished row's table is all null pages before the next chunk, so that the stale writes a
    pass makes for it never land in pages another request now holds."""
    engine = Engine(TARGET, **OPTIONS, page_size=16)
    engine.run(_requests(11)[:2])
    tables = np.asarray(jax.device_get(engine._batch.state.cache.pages))
    engine.add(_requests(12)[0])
    engine.step()
    tables = np.asarray(jax.device_get(engine._batch.state.cache.pages))
    assert (tables[1:] == 0).all() and (tables[0] > 0).any()


# ----- the prefix cache -------------------------------------------------------------------------

# Targets of the slow cases, made on first use (not where the default set imports the module)
QUIET = functools.cache(lambda: quiet_target(seed=11, num_layers=4))
MTP_TARGET = functools.cache(lambda: first_layer_mtp(layered_target(seed=12)))
CONSTANT_QUERIES = functools.cache(
    lambda: quiet_target(seed=21, num_layers=3, embed_scale=0.01, constant_queries=True)
)
PREFIX_CASES = {  # name: (target, proposer), every kind of proposer state
    "plain": lambda: (TARGET, None),
    "ngram": lambda: (TARGET, specjax.NGram(k=3)),
    "eagle-tree": lambda: (
        TARGET,
        specjax.Eagle(first_layer_eagle(TARGET), k=3, tree=specjax.TokenTree.top_k((2, 2, 1))),
    ),
    "draft-model": lambda: (TARGET, specjax.DraftModel(NOISY_DRAFT, k=3)),
    "draft-from-target": lambda: (
        TARGET,
        specjax.DraftModel(noisy_copy(TARGET, noise=0.05, extra_layers=0), k=3, prompt_from_target=True),
    ),
    "self-draft": lambda: (TARGET, specjax.SelfDraft(layers=1, k=3)),
    "eagle3": lambda: (QUIET(), specjax.Eagle3(first_layer_eagle3(QUIET(), (1, 2, 4)), k=3)),
    "mtp": lambda: (MTP_TARGET(), specjax.MTP(k=1)),
    "dflash": lambda: (
        CONSTANT_QUERIES(),
        specjax.DFlash(first_layer_dflash(CONSTANT_QUERIES(), block_size=4, aux_layer_ids=(0, 2))),
    ),
    "medusa": lambda: (TARGET, specjax.Medusa(trained_medusa(TARGET, num_heads=2))),
    "mlp-speculator": lambda: (
        TARGET,
        specjax.MLPSpeculator(
            trained_mlp_speculator(TARGET, steps=300, n_predict=3, positions_per_sequence=None)
        ),
    ),
}
FAST_PREFIX = ("plain", "ngram", "eagle-tree")  # the others in make test-all


@pytest.mark.parametrize(
    "name", [n if n in FAST_PREFIX else pytest.param(n, marks=pytest.mark.slow) for n in PREFIX_CASES]
)
def test_a_prefix_hit_drafts_as_a_miss(name):
    """Three requests one after the other, whose prompts share three pages (48 tokens) and one of
    which is the first again: on a hit the prefill runs only past the cached pages, and each
    request gets the tokens and the accepted drafts (position by position) it gets with the
    prefix cache off, which are generate's alone. The features a head reads are kept with the
    pages; a draft model's own cache is made again; the n-gram history is the row's tokens."""
    target, proposer = PREFIX_CASES[name]()
    rng = np.random.default_rng(4)
    vocab = target.config.vocab_size
    shared = rng.integers(0, vocab, 48).tolist()
    prompts = [shared + rng.integers(0, vocab, 5).tolist(), shared + rng.integers(0, vocab, 9).tolist()]
    requests = [Request(p, max_new_tokens=16) for p in (*prompts, prompts[0])]

    def one_by_one(engine):
        runs = []
        for request in requests:
            ids, finals = [engine.add(request)], {}
            tokens = []
            while engine.has_work:
                for update in engine.step():
                    tokens += update.tokens
                    if update.finished:
                        finals[update.request_id] = update.metrics
            metrics = finals[ids[0]]
            runs.append((tokens, np.asarray(metrics.accepted_at).tolist(), int(np.sum(metrics.drafted))))
        return runs

    options = dict(OPTIONS, page_size=16)
    cached = Engine(target, proposer, **options)
    with_cache = one_by_one(cached)
    without = one_by_one(Engine(target, proposer, **options, prefix_caching=False))
    assert with_cache == without
    assert with_cache[0][0] == alone(target, requests[0], proposer)
    pool = cached._pages.pools[0]
    assert pool.hits == 3 * 16 + 3 * 16  # the second and third requests found the shared pages
    assert pool.queries == sum(len(r.prompt) for r in requests)
    if proposer is not None:
        assert sum(np.sum(accepted) for _, accepted, _ in with_cache) > 0
        # part of the drafts, not all: hits and misses both reject and roll back
        assert sum(np.sum(accepted) for _, accepted, _ in with_cache) < sum(d for *_, d in with_cache)
    _all_pages_back(cached)


def test_pages_of_generated_tokens_are_shared_by_a_follow_up_turn():
    """A conversation's next turn repeats the previous prompt and answer: where the proposer reads
    no features, the answer's full pages are cached too, and the next turn prefills only what
    follows them (same tokens as without the cache)."""
    first = Request(_prompts(21, 1)[0] * 3, max_new_tokens=40)
    engine = Engine(TARGET, specjax.NGram(k=3), **OPTIONS, page_size=16)
    answer = engine.run([first])[0]
    turn = Request([*first.prompt, *answer, 5, 6, 7], max_new_tokens=10)
    hits = engine._pages.pools[0].hits
    followed = engine.run([turn])[1]
    assert engine._pages.pools[0].hits - hits == (len(turn.prompt) - 3) // 16 * 16
    assert followed == alone(TARGET, turn, specjax.NGram(k=3))


def test_a_restart_that_regenerates_other_tokens_ends_with_an_error_alone():
    """A preempted request whose new start does not give back the tokens it had reported (here
    made so by changing what it reported: on real weights a near tie) ends with finish_reason
    "error" and a warning, sending nothing more; the others get the dense engine's tokens."""
    requests = _requests(5)
    dense, _ = drive(Engine(TARGET, **OPTIONS), requests, seed=3)
    engine = Engine(TARGET, **OPTIONS, page_size=16, num_pages=7)
    ids = [engine.add(r) for r in requests]
    tokens, finals, changed = {i: [] for i in ids}, {}, None
    with pytest.warns(RuntimeWarning, match="did not regenerate the tokens it had reported"):
        while engine.has_work:
            for update in engine.step():
                tokens[update.request_id] += update.tokens
                if update.finished:
                    finals[update.request_id] = update.finish_reason
            sent = [(i, r) for i, r in engine._restarts.items() if r.tokens]
            if changed is None and sent:
                changed, restart = sent[0]
                restart.tokens[0] = (restart.tokens[0] + 1) % TARGET.config.vocab_size
    assert finals[changed] == "error"
    for position, i in enumerate(ids):
        if i != changed:
            assert tokens[i] == dense[position], position
            assert finals[i] in ("stop", "length")
    _all_pages_back(engine)


@pytest.mark.parametrize("kernels", ["auto", "xla"])
def test_prompts_admitted_together_share_their_prefill_passes(kernels):
    """Four prompts admitted in one step, on pages the CPU kernel reads in place, are prefilled in
    one packed program call (their tokens end to end in the same passes), each from the end of
    what the prefix cache holds of it; under XLA's attention, one prompt at a time. The dense
    engine's tokens either way."""
    requests = _requests(17)[:4]
    requests[3] = dataclasses.replace(requests[3], prompt=requests[1].prompt + [7, 8])  # a hit
    dense, _ = drive(Engine(TARGET, **OPTIONS, kernels=kernels), [requests[1]] + requests, seed=0)
    engine = Engine(TARGET, **OPTIONS, kernels=kernels, page_size=16)
    engine.run([requests[1]])  # cached
    runs = []
    run = engine._batch.run
    engine._batch.run = lambda kind, *args: runs.append(kind) or run(kind, *args)
    tokens = engine.run(requests)
    assert [tokens[i] for i in sorted(tokens)] == [dense[i] for i in range(1, 5)]
    packed, alone_ = runs.count("pool_packed"), runs.count("pool_chunks")
    assert (packed, alone_) == ((1, 0) if kernels == "auto" else (0, 4)), runs
    assert engine.kv_cache.prefix_counts[1] > 0
    _all_pages_back(engine)
