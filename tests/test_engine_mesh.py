"""The engine on a ("data", "model") mesh of fake CPU devices (`Engine(..., mesh=)`): the target
split over "model" as `generate` splits it, the slots over "data", every kind of proposer state
placed as on one device's engine; each request gets the tokens and accepted drafts (position by
position) it gets on one device."""

import re

import jax
import numpy as np
import pytest
from test_engine import NOISY_DRAFT, TARGET, _prompts, drive
from test_engine_pages import PREFIX_CASES

import specjax
from specjax import sharding
from specjax.serve import Engine, Request
from specjax.speculate.sampling import Sampling

if jax.device_count() < 4:  # conftest.py sets the flag; a jax imported earlier would miss it
    raise RuntimeError(
        f"tests/test_engine_mesh.py needs 4 devices, found {jax.device_count()}: XLA_FLAGS="
        "--xla_force_host_platform_device_count=8 must be set before jax is imported (tests/conftest.py)"
    )

# A 40-token prompt runs in chunks of 32 (beside the running rows), the others in one pass.
OPTIONS = dict(max_batch=4, max_model_len=112, chunk_steps=4, prefill_chunk=32)
MESHES = {"model2": (1, 2), "data2-model2": (2, 2)}
CASES = {
    **PREFIX_CASES,
    "draft-tensor-parallel": lambda: (TARGET, specjax.DraftModel(NOISY_DRAFT, k=3, tensor_parallel=True)),
}


def _grid(fast: set[tuple[str, str]]) -> list:
    """Every (proposer, mesh) pair, those outside `fast` marked slow: the default set runs each
    fast proposer on one of the meshes and each mesh with several proposers (make test-all runs all)."""
    return [
        pytest.param(name, mesh, id=f"{name}-{mesh}", marks=() if (name, mesh) in fast else pytest.mark.slow)
        for name in CASES
        for mesh in MESHES
    ]


DENSE_FAST = {
    ("plain", "model2"),
    ("ngram", "data2-model2"),
    ("eagle-tree", "data2-model2"),
    ("draft-tensor-parallel", "model2"),
}
# pages: the preemption check (plain) and the heavier proposers on data groups
PAGES_FAST = {
    ("plain", "data2-model2"),
    ("ngram", "model2"),
    ("eagle-tree", "data2-model2"),
    ("draft-tensor-parallel", "data2-model2"),
}


def _requests(vocab: int) -> list[Request]:
    prompts = [[t % vocab for t in p] for p in _prompts(3, 4)]
    prompts.append([int(t) for t in np.random.default_rng(5).integers(0, vocab, 40)])
    requests = [Request(p, max_new_tokens=n) for p, n in zip(prompts, (18, 9, 22, 14, 12), strict=True)]
    sampled = Sampling(temperature=0.8, top_p=0.9, seed=17)
    return [*requests, Request(prompts[1], max_new_tokens=16, sampling=sampled)]


def _run(target, proposer, mesh, requests=None, **options):
    engine = Engine(target, proposer, mesh=mesh, **OPTIONS, **options)
    requests = _requests(target.config.vocab_size) if requests is None else requests
    tokens, finals = drive(engine, requests, seed=2)
    accepted = {i: np.asarray(u.metrics.accepted_at).tolist() for i, u in finals.items()}
    return tokens, accepted, engine, finals


def _drafts_accepted_part_of_the_time(finals) -> bool:
    """Some drafts accepted and some rejected: acceptance and rollback both ran (not none, not all)."""
    accepted = sum(int(np.sum(u.metrics.accepted)) for u in finals.values())
    drafted = sum(int(np.sum(u.metrics.drafted)) for u in finals.values())
    return 0 < accepted < drafted


@pytest.mark.parametrize(("name", "mesh_name"), _grid(DENSE_FAST))
def test_the_engine_on_a_mesh_gives_one_devices_tokens_and_accepted_drafts(name, mesh_name):
    """Greedy and seeded sampled requests, one in chunks, added at random moments: tokens and
    accepted drafts by position equal one device's engine's. (A sampled row could differ at a
    float near-tie, the all-reduces summing in another order; these do not meet one.)"""
    target, proposer = CASES[name]()
    data, model = MESHES[mesh_name]
    mesh = sharding.make_mesh(model=model, data=data)
    one_tokens, one_accepted, *_ = _run(target, proposer, None)
    tokens, accepted, engine, finals = _run(target, proposer, mesh)
    assert tokens == one_tokens
    assert accepted == one_accepted
    if proposer is not None:  # drafts accepted part of the time: the comparison means something
        assert 0 < sum(np.sum(a) for a in accepted.values())
        assert _drafts_accepted_part_of_the_time(finals)
    # the target's weights and caches are split: each device holds half of each layer's kv heads
    cache = engine._batch.state.cache.k[0]
    assert cache.addressable_shards[0].data.shape[0] == cache.shape[0] // (data * model)


# Per mesh, the pool's usable pages of 16 slots (a request of max_model_len takes 8): 9, and on
# data 2 eight a group (its rows spread over the groups, each with fewer to share)
POOLS = {"model2": 9, "data2-model2": 16}


@pytest.mark.parametrize(("name", "mesh_name"), _grid(PAGES_FAST))
def test_pages_on_a_mesh_give_one_devices_tokens_and_accepted_drafts(name, mesh_name):
    """The engine on pages on a mesh: the pool split by kv head over "model" (each device every
    page of its half of the heads) and, on data 2, by page over "data" (each group a pool of its
    own, its slots' rows reading only its pages). 9 or 8 usable pages a group, too few for every
    request at once (rows wait, and two long answers outgrow it: the newest is preempted and
    starts again; on data 2, four), prompts sharing their first page (prefix hits): every request's tokens and
    accepted drafts equal one device's dense engine's, and every page is back at the end."""
    target, proposer = CASES[name]()
    requests = _requests(target.config.vocab_size)
    shared = requests[4].prompt[:16]  # two more requests beginning with the 40-token prompt's first page
    requests += [Request(shared + p[:8], max_new_tokens=10) for p in (requests[0].prompt, requests[2].prompt)]
    data, model = MESHES[mesh_name]
    long = (0, 3) if data == 1 else (0, 2, 3, 6)  # (on data 2, two of them in one group's pool)
    requests += [Request(requests[i].prompt, max_new_tokens=80) for i in long]  # (they outgrow the pool)
    one_tokens, one_accepted, *_ = _run(target, proposer, None, requests)
    mesh = sharding.make_mesh(model=model, data=data, devices=jax.devices()[: data * model])
    tokens, accepted, engine, finals = _run(
        target, proposer, mesh, requests, page_size=16, num_pages=POOLS[mesh_name]
    )
    assert tokens == one_tokens
    assert accepted == one_accepted
    pools = engine.kv_cache.pools
    assert len(pools) == data and all(pool.usable_pages == POOLS[mesh_name] // data for pool in pools)
    for pool in pools:
        pool.check()
        assert pool.available_pages == pool.usable_pages
    assert engine.kv_cache.prefix_counts[1] > 0  # the shared page was found
    if proposer is not None:
        assert _drafts_accepted_part_of_the_time(finals)
    if proposer is None:  # the two long answers outgrow the pool beside the others (with drafts
        # accepted, rows end sooner and whether they meet depends on the proposer)
        assert engine.stats.preemptions > 0
    # each device holds its group's pages of its half of the kv heads
    pages = engine._batch.state.cache.k[0]
    assert pages.addressable_shards[0].data.shape[0] == pages.shape[0] // (data * model)


@pytest.mark.parametrize("page_size", [None, 16])
def test_on_a_mesh_nothing_compiles_while_serving_after_precompile(page_size):
    """Precompiled for the prompts' lengths, an engine on a mesh of data 2 x model 2 (dense, or on
    pages) serves requests of every length and kind without compiling anything more: each
    program is compiled once for the state's shardings, which every program keeps."""
    mesh = sharding.make_mesh(model=2, data=2, devices=jax.devices()[:4])
    engine = Engine(TARGET, specjax.NGram(k=3), mesh=mesh, **OPTIONS, page_size=page_size)
    requests = _requests(TARGET.config.vocab_size)
    engine.precompile(sorted({len(r.prompt) for r in requests}))
    compiled = engine.num_compiles
    drive(engine, requests, seed=3)
    assert engine.num_compiles == compiled, sorted(engine.compiled)


def test_a_mesh_the_engine_cannot_use_is_refused_naming_it():
    mesh = sharding.make_mesh(model=2, data=2)
    with pytest.raises(ValueError, match=r"max_batch=3: .* 2 data groups; give a multiple of 2"):
        Engine(TARGET, None, mesh=mesh, max_batch=3, max_model_len=64)
    with pytest.raises(
        ValueError, match="num_kv_heads=2 does not divide over the mesh axis 'model' of size 4"
    ):
        Engine(TARGET, None, mesh=sharding.make_mesh(model=4, data=1), max_batch=4, max_model_len=64)
    with pytest.raises(
        ValueError, match="num_pages=9: on a mesh of 2 data groups the pool splits into equal"
    ):
        Engine(TARGET, None, mesh=mesh, max_batch=4, max_model_len=64, page_size=16, num_pages=9)
    with pytest.raises(
        ValueError,
        match=r"num_pages=8: a data group's part of the pool, 4 pages of 16 slots \(64 tokens; 8 over 2 "
        r"groups\), cannot hold one request of max_model_len=64 \(5 pages",
    ):
        Engine(TARGET, None, mesh=mesh, max_batch=4, max_model_len=64, page_size=16, num_pages=8)
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        Engine(TARGET, None, mesh="2x2", max_batch=4, max_model_len=64)


def test_a_step_all_reduces_twice_per_layer_over_the_model_groups():
    """Counted in the compiled loop's HLO (data 2 x model 2, plain decoding): one float32 sum
    of [B/d, T, D] after attention and one after the MLP in every layer, each over a model group
    ({0, 1} and {2, 3}); the loop's other all-reduces are integers and flags (whether rows are
    done, the token buffer), none of them a layer's."""
    mesh = sharding.make_mesh(model=2, data=2, devices=jax.devices()[:4])
    engine = Engine(TARGET, None, mesh=mesh, max_batch=4, max_model_len=64)
    engine.precompile([])
    text = engine._batch.programs[("lean", 4)].as_text()
    sums = re.findall(r"= (\w+)\[[^\]]*\]\S* all-reduce\(.*?replica_groups=(\{[{}0-9,]*\})", text)
    over_model = [dtype for dtype, groups in sums if groups == "{{0,1},{2,3}}"]
    assert over_model == ["f32"] * (2 * TARGET.config.num_layers)
    assert all(dtype in ("s32", "pred") for dtype, groups in sums if groups != "{{0,1},{2,3}}")
    # each device holds a quarter of the slots' caches: its rows' half of the kv heads
    cache = engine._batch.state.cache.k[0]
    assert cache.addressable_shards[0].data.nbytes * 4 == cache.nbytes
