"""Speculative decoding on Spec-Bench: specjax proposers against plain decoding and HF transformers.

    .venv/bin/python benchmarks/spec_bench.py [--per-category 2] [--max-new-tokens 128]
        [--methods plain,ngram,selfdraft,medusa,medusa-tree,eagle,eagle-tree,eagle3,dflash,hybrid]
        [--categories mt_bench] [--heads heads]

A fixed subset of Spec-Bench (the first --per-category questions of each category, MT-bench's
eight sub-categories taken round-robin as one "mt_bench" category; see common.py), first turn
only, chat template on, batch 1, greedy, float32, the built-in model. For each category: tokens/s
(new tokens over the wall time of a whole generate call, prefill included, median of --repeats
after a warm-up), speedup over specjax plain decoding, and mean acceptance length (tokens per
target forward pass, counting the bonus token). HF transformers runs its prompt lookup
(`prompt_lookup_num_tokens`) and its early-exit self-draft (`assistant_early_exit`) on the same
prompts and token ids. Every speculative output is checked against plain greedy output.

Trained heads (`make heads`) are read from --heads: `medusa/head`, `eagle/head`, `eagle3/head` and
`dflash/head` there. Each records in its meta the split it was distilled from; for the committed
heads that is specjax.bench.HEADS_SPLIT, Spec-Bench's questions less MT-bench's, so only the
mt_bench rows are held out for them: the other rows are marked "(trained)" and a note under the
table names the split (heads of no one named split mark no row, and the note says what each
trained on). The per-position table gives each method's conditional acceptance (EAGLE's
definition: accepted at position i among the drafts that reached it).

The benchmark itself is specjax.bench (also `specjax bench`, without the HF rows); this script
adds the HF transformers peers.
"""

from __future__ import annotations

from common import common_arguments, data_dir, load_hf_reference

import specjax
from specjax import bench


def hf_peers(args) -> dict:
    """HF transformers' plain decoding, prompt lookup and early-exit self-draft on the same token
    ids: display name -> a function of the prompt ids returning the number of new tokens."""
    import torch

    hf = load_hf_reference()

    def peer(**kwargs):
        def run(ids: list[int]) -> int:
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs
                )
            return out.shape[1] - len(ids)

        return run

    return {
        "HF plain": peer(),
        f"HF prompt lookup ({args.ngram_k})": peer(prompt_lookup_num_tokens=args.ngram_k),
        f"HF early exit ({args.self_draft_layers})": peer(assistant_early_exit=args.self_draft_layers),
    }


def main() -> None:
    parser = common_arguments(__doc__)
    bench.add_method_arguments(parser)
    args = parser.parse_args()
    try:
        categories = bench.parse_categories(args.categories)
        descriptions = bench.method_descriptions(**bench.method_options(args))
        prompts = bench.spec_bench_prompts(data_dir(args.data), args.per_category, categories)
        model = specjax.load("smollm2-135m")
        methods = bench.make_methods(model, descriptions)
    except ValueError as error:
        raise SystemExit(f"spec_bench.py: error: {error}") from None
    peers = None if args.no_hf else hf_peers(args)

    started = set()

    def progress(tick: bench.Tick) -> None:  # a line per prompt, after its first call
        if tick.prompt_index not in started:
            started.add(tick.prompt_index)
            print(f"[{tick.prompt_index + 1}/{tick.num_prompts}] {tick.category}", flush=True)

    result = bench.run_spec_bench(
        model,
        prompts,
        methods,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        peers=peers,
        progress=progress,
    )
    print()
    print(result.report("markdown"))


if __name__ == "__main__":
    main()
