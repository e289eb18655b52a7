"""The optimized XLA:CPU programs `generate` and the serving `Engine` compile, normalized, with a
digest each: to check that a change leaves the CPU programs (and so CPU decoding speed) exactly as
they were.

Run it in a checkout of each commit, then compare the digests (or diff the files):

    .venv/bin/python benchmarks/cpu_programs.py --model tiny --out /tmp/before      # at the old commit
    .venv/bin/python benchmarks/cpu_programs.py --model tiny --out /tmp/after       # at the new one
    diff -r /tmp/before /tmp/after

`--model tiny` (default) covers every proposer and wrapper on a tiny random Llama (greedy, and
sampled for the drafting ones), three families whose layers differ (Gemma 3's sliding and full
layers, DeepSeek-V3's latent attention and experts, gpt-oss's sinks), and the engine's programs;
`--model builtin` the built-in model's plain and n-gram programs.

Normalized: source metadata, stack-frame tables, dot precision attributes (XLA:CPU computes float32
products in float32 at every precision) and every instruction's and parameter's name (a
computation's parameters in its signature too) are dropped,
and the lines sorted: what is compared is the multiset of instructions (opcode, shapes, operands'
shapes, attributes), which a renumbering elsewhere in the program does not change. Programs are
captured where jax compiles them (`jax.stages.Lowered.compile`), so the script reads the same at
any commit, wherever the library keeps its compiled programs.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

sys.path[:0] = [".", "tests"]  # this checkout's package and its tests' tiny models

import jax  # noqa: E402

import specjax  # noqa: E402

PROMPTS = [[1, 2, 3, 1, 2, 3], [5, 6, 7]]


def normalized(text: str) -> str:
    for pattern in (
        r", metadata=\{[^}]*\}",
        r",? ?operand_precision=\{[^}]*\}",
        r", frontend_attributes=\{[^}]*\}",
    ):
        text = re.sub(pattern, "", text)
    text = re.sub(r"^HloModule.*$", "", text, flags=re.M)
    text = re.sub(r"%[\w.\-]+", "%", text)  # instruction and parameter names
    text = re.sub(r"\b[A-Za-z_]\w*(\.\d+)+: ", ": ", text)  # a computation's parameter names
    text = re.sub(r"\bparam_\d+\.\d+", "param", text)
    lines = (line.strip().rstrip(",") for line in text.splitlines())
    return "\n".join(sorted(line for line in lines if line and not re.match(r'^\d+ (\{|")', line)))


class Capture:
    """Every program jax compiles while it is installed, in order."""

    def __init__(self):
        self.compiled = []
        self._real = jax.stages.Lowered.compile
        capture = self

        def compile(lowered, *args, **kwargs):
            executable = capture._real(lowered, *args, **kwargs)
            capture.compiled.append(executable)
            return executable

        jax.stages.Lowered.compile = compile


def tiny_runs():
    """(name, model, proposer, sampling) for the tiny models: every proposer and wrapper."""
    from drafters import (
        first_layer_dflash,
        first_layer_eagle,
        first_layer_eagle3,
        first_layer_mtp,
        layered_target,
        noisy_copy,
        quiet_target,
    )
    from tiny import tiny_model

    from specjax.models import MedusaHead, MLPSpeculatorHead

    sampled = specjax.Sampling(temperature=0.8, top_k=20, seed=3)
    model = tiny_model(seed=1, num_layers=2)
    target = layered_target(num_layers=3)
    quiet = quiet_target(num_layers=3)
    constant = quiet_target(num_layers=3, embed_scale=0.01, constant_queries=True)
    eagle = first_layer_eagle(target)
    eagle3 = first_layer_eagle3(quiet, (0, 1, 3))
    dflash = first_layer_dflash(constant, 4, (0, 2))
    medusa = MedusaHead.init(target, 3, jax.random.key(2), scale=0.1)
    mlp = MLPSpeculatorHead.init(target, n_predict=3, key=jax.random.key(3))
    mtp_target = first_layer_mtp(target)
    draft = noisy_copy(target, 0.05)
    goodput = specjax.GoodputSchedule(draft_cost=0.05, verify_cost=0.1)
    runs = [
        ("plain", model, None, None),
        ("ngram", model, specjax.NGram(k=3), None),
        ("self_draft", model, specjax.SelfDraft(1, k=2), None),
        ("plain-sampled", target, None, sampled),
        ("ngram-sampled", target, specjax.NGram(k=3), sampled),
        ("draft_model", target, specjax.DraftModel(draft, k=3), None),
        ("draft_model-sampled", target, specjax.DraftModel(draft, k=3), sampled),
        ("draft_model-from-target", target, specjax.DraftModel(target, k=2, prompt_from_target=True), None),
        ("eagle", target, specjax.Eagle(eagle, k=3), None),
        ("eagle-tree", target, specjax.Eagle(eagle, tree=specjax.TokenTree.top_k((2, 2))), None),
        ("eagle-threshold", target, specjax.Eagle(eagle, k=3, confidence_threshold=0.2), None),
        ("eagle3", quiet, specjax.Eagle3(eagle3, k=3), None),
        ("eagle3-sampled", quiet, specjax.Eagle3(eagle3, k=3), sampled),
        ("dflash", constant, specjax.DFlash(dflash), None),
        ("medusa", target, specjax.Medusa(medusa), None),
        ("medusa-tree", target, specjax.Medusa(medusa, tree=[(0,), (1,), (0, 0)]), None),
        ("mlp_speculator", target, specjax.MLPSpeculator(mlp), None),
        ("mlp_speculator-sampled", target, specjax.MLPSpeculator(mlp), sampled),
        ("mtp", mtp_target, specjax.MTP(k=2), None),
        ("mtp-sampled", mtp_target, specjax.MTP(k=2), sampled),
        ("with_ngram", mtp_target, specjax.WithNGram(specjax.MTP(k=1), specjax.NGram(k=2)), None),
        ("dynamic-ngram", target, specjax.Dynamic(specjax.NGram(k=4)), None),
        ("dynamic-goodput", target, specjax.Dynamic(specjax.NGram(k=4), goodput), None),
        ("dynamic-eagle", target, specjax.Dynamic(specjax.Eagle(eagle, k=3)), None),
        ("hybrid", quiet, specjax.Hybrid(specjax.NGram(k=4, n_min=2), specjax.Eagle3(eagle3, k=1)), None),
        (
            "hybrid-gated",
            quiet,
            specjax.Hybrid(specjax.NGram(k=3), specjax.Eagle3(eagle3, k=3), gate=goodput),
            None,
        ),
        ("forced", model, specjax.ForcedAcceptance(0.5, k=3), None),
        ("forced-ngram", model, specjax.ForcedAcceptance(0.5, specjax.NGram(k=3)), None),
        ("forced-dynamic", model, specjax.ForcedAcceptance(0.5, specjax.Dynamic(specjax.NGram(k=3))), None),
        ("dynamic-forced", model, specjax.Dynamic(specjax.ForcedAcceptance(0.5, specjax.NGram(k=3))), None),
    ]
    return runs


def family_runs():
    """(name, model, proposer, sampling) for families whose layers differ from Llama's."""
    from tiny import tiny_model

    families = {
        "gemma3": dict(
            norm="gemma",
            qk_norm=True,
            sandwich_norms=True,
            embed_scale=True,
            hidden_act="gelu_tanh",
            sliding_window=4,
            layer_types=("sliding_attention", "full_attention", "sliding_attention"),
            local_rope_theta=10000.0,
            rope_theta=1e6,
        ),
        "deepseek_v3": dict(
            num_kv_heads=1,
            head_dim=24,
            rotary_dim=8,
            v_head_dim=24,
            kv_lora_rank=32,
            q_lora_rank=48,
            rope_interleave=True,
            num_experts=4,
            num_experts_per_tok=2,
            router_scoring="sigmoid",
            shared_expert_size=32,
            dense_layers=(0,),
        ),
        "gpt_oss": dict(
            attention_sinks=True,
            qkv_bias=True,
            o_bias=True,
            num_experts=4,
            num_experts_per_tok=2,
            moe_bias=True,
            norm="rms_float32",
            hidden_act="clamped_swiglu",
            sliding_window=4,
            layer_types=("sliding_attention", "full_attention"),
        ),
    }
    runs = []
    for name, overrides in families.items():
        layers = len(overrides.get("layer_types", (0, 0, 0)))
        model = tiny_model(seed=4, **{"num_layers": layers, **overrides})
        runs += [(f"{name}-plain", model, None, None), (f"{name}-ngram", model, specjax.NGram(k=3), None)]
    return runs


def engine_programs(capture: Capture, out: Path, label: str) -> None:
    """The engine's programs at start and after serving two requests, in the order compiled."""
    from tiny import tiny_model

    from specjax.serve import Engine, Request

    model = tiny_model(seed=1, num_layers=2)
    for name, proposer in (("plain", None), ("ngram", specjax.NGram(k=3))):
        start = len(capture.compiled)
        engine = Engine(model, proposer, max_batch=2, max_model_len=64, chunk_steps=4)
        engine.run([Request([1, 2, 3, 1, 2], max_new_tokens=6), Request([4, 5, 6], max_new_tokens=5)])
        for i, executable in enumerate(capture.compiled[start:]):
            write(out, f"{label}-engine-{name}-{i:02d}", executable)


def write(out: Path, name: str, executable) -> None:
    text = normalized(executable.as_text())
    (out / f"{name}.txt").write_text(text)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    print(f"{name}: {text.count(chr(10)) + 1} lines, sha256 {digest}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["tiny", "builtin"], default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", action="append", help="run only these names (repeat)")
    args = parser.parse_args()
    capture = Capture()
    if args.model == "tiny":
        runs = tiny_runs() + family_runs()
    else:
        model = specjax.load("smollm2-135m")
        runs = [("plain", model, None, None), ("ngram", model, specjax.NGram(k=3), None)]
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"specjax from {specjax.__file__}")
    for name, model, proposer, sampling in runs:
        if args.only and name not in args.only:
            continue
        start = len(capture.compiled)
        specjax.generate(model, PROMPTS, proposer=proposer, sampling=sampling, max_new_tokens=8)
        assert len(capture.compiled) > start, f"{name}: generate compiled nothing (a program was kept?)"
        write(args.out, f"{args.model}-{name}", capture.compiled[-1])
    if args.model == "tiny" and (not args.only or "engine" in args.only):
        engine_programs(capture, args.out, args.model)


if __name__ == "__main__":
    main()
