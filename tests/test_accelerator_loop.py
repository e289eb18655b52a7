"""The whole loop with the accelerators' Pallas attention kernels, run in Pallas' interpreter on
this CPU (generate(kernels="pallas:tpu" / "pallas:cuda")), equals the plain-XLA path token for
token: decoding and verify passes read each row's filled cache blocks through the kernels, the
prefill goes through the blocked flash kernel, and the fresh tokens of chains and trees merge in.

Rows accept different counts in the same steps (n-gram drafts on repetitive prompts, and
ForcedAcceptance, which accepts drafts at a set rate whatever the target says), so cache lengths
are ragged; one model has sliding-window layers interleaved with full ones. The default set runs a
ragged chain (TPU kernels), a tree (CUDA kernels) and the windowed model on both; make test-all
runs every proposer at batch 1 and 4 on both kernels.
"""

from __future__ import annotations

import jax
import pytest
from tiny import tiny_model

import specjax
from specjax.models import DFlashHead, Eagle3Head, EagleHead, MedusaHead
from specjax.speculate.tree import TokenTree

TARGET = tiny_model(seed=21, num_layers=3)
# Sliding layers (window 6) between full ones: decoding passes see window starts per row.
WINDOWED = tiny_model(
    seed=22,
    num_layers=3,
    sliding_window=6,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
)
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [4] * 20]


def proposer(name: str):
    key = jax.random.key(0)
    if name == "plain":
        return None
    if name == "ngram":
        return specjax.NGram(k=3)
    if name == "forced":  # accepts the n-gram drafts at 60% a position: ragged by construction
        return specjax.ForcedAcceptance(0.6, proposer=specjax.NGram(k=3), k=3)
    if name == "draft":
        return specjax.DraftModel(tiny_model(seed=23, num_layers=1), k=3)
    if name == "self_draft":
        return specjax.SelfDraft(layers=1, k=2)
    if name == "medusa_tree":
        return specjax.Medusa(MedusaHead.init(TARGET, num_heads=2, key=key), tree=TokenTree.top_k((2, 2)))
    if name == "eagle":
        return specjax.Eagle(EagleHead.init(TARGET, key), k=3)
    if name == "eagle3_tree":
        head = Eagle3Head.init(TARGET, key, aux_layer_ids=(0, 1, 3), scale=1.0)
        return specjax.Eagle3(head, tree=TokenTree.top_k((2, 1)))
    if name == "dflash":
        head = DFlashHead.init(TARGET, key, block_size=4, num_layers=1, aux_layer_ids=(1, 2), scale=1.0)
        return specjax.DFlash(head)
    if name == "hybrid":
        return specjax.Hybrid(specjax.NGram(k=3, n_min=2), specjax.Eagle(EagleHead.init(TARGET, key), k=3))
    if name == "dynamic":
        return specjax.Dynamic(specjax.NGram(k=3))
    raise ValueError(name)


NAMES = (
    "plain",
    "ngram",
    "forced",
    "draft",
    "self_draft",
    "medusa_tree",
    "eagle",
    "eagle3_tree",
    "dflash",
    "hybrid",
    "dynamic",
)
DEFAULT = {("forced", "pallas:tpu", 4), ("eagle3_tree", "pallas:cuda", 4)}
CASES = [
    pytest.param(name, kernels, batch, marks=() if (name, kernels, batch) in DEFAULT else pytest.mark.slow)
    for name in NAMES
    for kernels in ("pallas:tpu", "pallas:cuda")
    for batch in (1, 4)
]


def run(model, name, kernels, batch):
    prompts = PROMPTS[-batch:]
    return specjax.generate(model, prompts, proposer=proposer(name), max_new_tokens=12, kernels=kernels)


@pytest.mark.parametrize("name, kernels, batch", CASES)
def test_the_loop_with_interpreted_kernels_equals_xla(name, kernels, batch):
    want = run(TARGET, name, "xla", batch)
    got = run(TARGET, name, kernels, batch)
    assert got.tokens == want.tokens
    assert counts(got) == counts(want)


COUNTS = ("steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length_histogram")


def counts(result):
    summary = result.metrics.summary()
    return {name: summary[name] for name in COUNTS}


@pytest.mark.parametrize("kernels", ["pallas:tpu", "pallas:cuda"])
def test_sliding_windows_through_the_kernels(kernels):
    want = run(WINDOWED, "forced", "xla", 4)
    got = run(WINDOWED, "forced", kernels, 4)
    assert got.tokens == want.tokens
    accepted = got.metrics.summary()
    assert 0 < accepted["acceptance_rate"] < 1, accepted  # ragged: some drafts rejected, some not
