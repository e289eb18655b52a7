"""Structured output's automata on the built-in model's vocabulary (SmolLM2, 49,152 tokens):
outlines-core (a token-level DFA built ahead of time, what specjax puts on the device) against
llguidance (an Earley parser that computes each step's token mask on the host), for a few regexes
and JSON schemas. The numbers of docs/structured.md.

    .venv/bin/python benchmarks/structured_tables.py [--repeats 3]

Per constraint: outlines-core's build time (JSON schema -> regex, then the token index; the
vocabulary is built once and reported apart), the automaton's states and transitions, and the
device tables specjax makes of it (`build_grammar`: the allowed-token bitmask [S, V/32] uint32 and
the sorted transition list [E] x 2 int32, S and E rounded up to their power-of-two budgets);
llguidance's grammar compile time and its mean host time per token mask along an example output
(what a compiled loop would have to call back to the host for, every step). Needs no network: the
tokenizer is read from the built-in model's GGUF.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specjax.models import gguf_loader
from specjax.models.loading import builtin_path
from specjax.speculate import grammar

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "[A-Z]{2}[0-9]{6}"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "express": {"type": "boolean"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
            },
            "maxItems": 4,
        },
    },
    "required": ["id", "status", "express", "items"],
}
# (name, kind, constraint, an output it allows)
CASES = [
    ("choice of 3", "choice", ["positive", "negative", "neutral"], "neutral"),
    ("phone regex", "regex", r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"),
    ("email regex", "regex", r"[a-z0-9._]{1,20}@[a-z]{1,10}\.(com|org)", "john.doe@mail.com"),
    ("JSON person", "json_schema", PERSON, '{"name":"Ada","age":36}'),
    (
        "JSON order",
        "json_schema",
        ORDER,
        '{"id":"AB123456","status":"shipped","express":true,"items":[{"sku":"X1","qty":2}]}',
    ),
]


def regex_of(kind, constraint) -> str:
    return grammar.constraint_regex(*(constraint if kind == k else None for k in grammar.CONSTRAINTS))


def outlines_row(tokenizer, vocab_size, eos, kind, constraint, repeats):
    times = []
    for _ in range(repeats):
        grammar._AUTOMATA.clear()  # the index, not the vocabulary (built once, timed apart)
        start = time.perf_counter()
        automaton = grammar.compile_constraint(regex_of(kind, constraint), tokenizer, vocab_size, eos)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    tables = grammar.build_grammar(tokenizer, vocab_size, eos, [regex_of(kind, constraint)])
    tables_s = time.perf_counter() - start
    table_bytes = sum(x.nbytes for x in (tables.allowed, tables.edge_keys, tables.edge_next))
    return {
        "outlines build s": min(times),
        "states": automaton.num_states,
        "transitions": len(automaton.tokens),
        "budget S x E": f"{tables.allowed.shape[0]} x {tables.edge_keys.shape[0]}",
        "device MiB": table_bytes / 2**20,
        "tables s": tables_s,
    }


def llguidance_row(ll_tokenizer, hf_tokenizer, kind, constraint, example, repeats):
    import llguidance
    import llguidance.numpy as llnp

    if kind == "json_schema":
        source = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(constraint))
    else:
        source = llguidance.LLMatcher.grammar_from_regex(regex_of(kind, constraint))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tokenizer, source)
        times.append(time.perf_counter() - start)
    bitmask = llnp.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    masks = []
    for token in hf_tokenizer(example, add_special_tokens=False)["input_ids"]:
        start = time.perf_counter()
        llnp.fill_next_token_bitmask(matcher, bitmask, 0)
        masks.append(time.perf_counter() - start)
        if not matcher.consume_token(token):
            return {"llguidance compile s": min(times), "mask ms": float("nan"), "note": matcher.get_error()}
    return {"llguidance compile s": min(times), "mask ms": 1e3 * statistics.mean(masks), "steps": len(masks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = gguf_loader.read_tokenizer(builtin_path("smollm2-135m"))
    vocab_size, eos = len(tokenizer), (tokenizer.eos_token_id,)
    start = time.perf_counter()
    grammar._vocabulary(tokenizer, vocab_size, eos)
    print(f"outlines-core vocabulary of {vocab_size} tokens: {time.perf_counter() - start:.2f} s (once)")
    import llguidance.hf

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    print(f"llguidance tokenizer: {time.perf_counter() - start:.2f} s (once)\n")
    for name, kind, constraint, example in CASES:
        row = outlines_row(tokenizer, vocab_size, eos, kind, constraint, args.repeats)
        row |= llguidance_row(ll_tokenizer, tokenizer, kind, constraint, example, args.repeats)
        cells = [f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()]
        print(f"{name:12s} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
