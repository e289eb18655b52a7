"""generate's prefill in chunks of one row inside the compiled program (LoopSpec.prefill_chunk,
speculate/prefill.py `chunked_prefill`) against the prompts in one pass (`prefill_chunk=None`):
the same tokens and the same accepted counts for every kind of proposer state (none, a draft
model's cache, the target's features for an EAGLE or EAGLE-3 head, MTP layers), over prompts
that end inside, at and past chunk boundaries, in a ragged batch; and programs that depend on the
prompts' lengths only through the capacity's coarse steps (counted)."""

import jax
import numpy as np
import pytest
from drafters import (
    first_layer_eagle,
    first_layer_eagle3,
    first_layer_mtp,
    layered_target,
    noisy_copy,
    quiet_target,
)
from tiny import tiny_model

import specjax
from specjax import planner, programs

LAYERED = layered_target(seed=11)
QUIET = quiet_target(seed=11, num_layers=4)
MTP_TARGET = first_layer_mtp(layered_target(seed=12))
RNG = np.random.default_rng(5)
# Chunks of 16: lengths inside a first chunk, at a boundary, one past it, several chunks.
LENGTHS = (5, 16, 17, 61, 40)


def _prompts(model, lengths=LENGTHS):
    vocab = model.config.vocab_size
    return [list(map(int, RNG.integers(0, vocab, n))) for n in lengths]


PROPOSERS = {
    "plain": (LAYERED, lambda: None),
    "ngram": (LAYERED, lambda: specjax.NGram(k=3)),
    "draft-model": (LAYERED, lambda: specjax.DraftModel(noisy_copy(LAYERED, 0.02), k=3)),
    "self-draft": (LAYERED, lambda: specjax.SelfDraft(layers=1, k=3)),
    "eagle": (LAYERED, lambda: specjax.Eagle(first_layer_eagle(LAYERED), k=3)),
    "eagle3": (QUIET, lambda: specjax.Eagle3(first_layer_eagle3(QUIET, (1, 2, 4)), k=3)),
    "mtp": (MTP_TARGET, lambda: specjax.MTP(k=1)),
}


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_chunks_equal_one_pass(name):
    model, make = PROPOSERS[name]
    prompts = _prompts(model)
    proposer = make()
    whole = specjax.generate(model, prompts, proposer=proposer, max_new_tokens=12, prefill_chunk=None)
    chunked = specjax.generate(model, prompts, proposer=proposer, max_new_tokens=12, prefill_chunk=16)
    assert chunked.tokens == whole.tokens
    assert chunked.metrics.accepted.tolist() == whole.metrics.accepted.tolist()
    assert chunked.metrics.target_forwards.tolist() == whole.metrics.target_forwards.tolist()
    if proposer is not None and name != "ngram":  # drafts were accepted and rejected
        assert 0 < sum(chunked.metrics.accepted.tolist()) < sum(chunked.metrics.drafted.tolist())


def test_sampled_rows_draw_the_same_tokens():
    prompts = _prompts(LAYERED)
    sampling = specjax.Sampling(temperature=0.8, top_p=0.95)
    runs = [
        specjax.generate(
            LAYERED,
            prompts,
            proposer=specjax.SelfDraft(layers=1, k=3),
            sampling=sampling,
            max_new_tokens=12,
            key=jax.random.key(4),
            prefill_chunk=chunk,
        )
        for chunk in (None, 32)
    ]
    assert runs[0].tokens == runs[1].tokens


def test_sliding_window_and_sinks_across_chunks():
    """A window shorter than a chunk, and one longer, and attention sinks: the chunks attend as
    one pass does."""
    for window in (8, 40):
        model = tiny_model(seed=3, sliding_window=window, layer_types=("sliding_attention", "full_attention"))
        prompts = _prompts(model, (70, 33, 9))
        runs = [specjax.generate(model, prompts, max_new_tokens=10, prefill_chunk=c) for c in (None, 16)]
        assert runs[0].tokens == runs[1].tokens


def test_programs_depend_on_the_capacity_alone():
    """Prompts of 40 to 4,000 tokens compile one program per capacity step (256, ..., 4096 slots
    here), and lengths within a step share it; one pass compiles one per prompt bucket."""
    model = tiny_model(seed=23, num_layers=1, max_position_embeddings=8192)  # a config no other test compiles
    lengths = (40, 41, 100, 130, 300, 700, 1000, 1500, 2100, 3000, 4000)
    capacities = {planner.chunked_capacity(n, 8, None) for n in lengths}
    assert capacities == {256, 512, 1024, 2048, 4096}
    count = programs.compiled_program_count()
    for n in lengths:
        result = specjax.generate(model, _prompts(model, (n,)), max_new_tokens=8)
        assert len(result.tokens[0]) == 8
    assert programs.compiled_program_count() == count + len(capacities)
    count = programs.compiled_program_count()
    for n in (40, 41, 100, 130):
        specjax.generate(model, _prompts(model, (n,)), max_new_tokens=8, prefill_chunk=None)
    assert programs.compiled_program_count() == count + len(
        {planner.prompt_bucket(n) for n in (40, 41, 100, 130)}
    )


def test_a_long_batch_against_one_pass():
    """Rows of very different lengths in one batch (several chunks of 256 beside one short row)."""
    model = tiny_model(seed=23, num_layers=1, max_position_embeddings=8192)
    prompts = _prompts(model, (900, 12, 300))
    runs = [specjax.generate(model, prompts, max_new_tokens=8, prefill_chunk=c) for c in (None, "auto")]
    assert runs[0].tokens == runs[1].tokens


@pytest.mark.parametrize(
    "lengths, chunk",
    [
        ((6,) * 1000, None),  # every prompt's bucket (16) under a chunk: one pass, 16x less work
        ((5, 120), None),  # bucket 128
        ((6,), planner.PREFILL_CHUNK),  # a single row keeps its chunk (programs by capacity alone)
        ((200, 3), planner.PREFILL_CHUNK),  # bucket 256: one pass saves nothing
        ((900, 12, 300), planner.PREFILL_CHUNK),  # ragged: chunks 2,048 positions (B = 4), one pass 3,840
    ],
)
def test_auto_runs_one_pass_where_chunks_save_no_work(lengths, chunk):
    """On one CPU device "auto" runs chunks of 256 tokens of one row, except for a batch whose prompts'
    bucket is shorter than a chunk, where each row's chunk would compute far more padding than one
    pass over the batch (1,000 rows of 6 tokens ran 256-token chunks, 18.6 s against 0.4 s)."""
    model = tiny_model(seed=23, num_layers=1, max_position_embeddings=8192)
    prompts = [[1] * n for n in lengths]
    spec = planner.plan(model, prompts, max_new_tokens=4).spec
    assert spec.prefill_chunk == chunk
    if chunk is None:
        assert spec.prompt_bucket == planner.prompt_bucket(max(lengths)) < planner.PREFILL_CHUNK


@pytest.mark.parametrize("bad", [10, 0, -16, "256", 16.0, True])
def test_bad_prefill_chunk(bad):
    with pytest.raises(ValueError, match="prefill_chunk"):
        specjax.generate(LAYERED, [[1, 2, 3]], max_new_tokens=2, prefill_chunk=bad)


def test_one_program_a_chunk_loop_then_the_decoding_loop():
    """The chunks are a while_loop of their own inside the one program, before the decoding loop;
    no callback, no host round trip."""
    from specjax.speculate.loop import GenerationInputs, generate_program
    from specjax.speculate.sampling import Sampling, SamplingParams, WarpSpec
    from specjax.speculate.spec import LoopSpec

    model = tiny_model()
    sampling = [Sampling(), Sampling(temperature=0.7)]
    spec = LoopSpec(model.config, 2, 128, 128, WarpSpec.of(sampling), prefill_chunk=16)
    inputs = GenerationInputs.simple(
        prompt_tokens=jax.numpy.zeros((2, 128), jax.numpy.int32),
        prompt_lengths=jax.numpy.array([3, 50], jax.numpy.int32),
        max_new_tokens=jax.numpy.array([8, 8], jax.numpy.int32),
        sampling=SamplingParams.of(sampling, 2, model.config.vocab_size),
        key=jax.random.key(0),
    )
    jaxpr = jax.make_jaxpr(generate_program, static_argnums=0)(spec, model.params, None, inputs)
    top_level = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
    assert top_level.count("while") == 2
    assert not any("callback" in name for name in top_level)
