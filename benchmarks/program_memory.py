"""What one compiled generation program holds, where it comes from, and what two cheap changes save.

    .venv/bin/python benchmarks/program_memory.py                     # the sizes table
    .venv/bin/python benchmarks/program_memory.py --parts dynamic     # Dynamic: one switch or two
    .venv/bin/python benchmarks/program_memory.py --parts prefill     # prefill chunks of 64 or 128

sizes: for each program (SmolLM2-135M-Instruct, float32, the CPU kernels, greedy), compiled the way
`generate` compiles it: the compile time; the instructions of its optimized HLO, split into the
prefill and the decoding loop, and the share inside the model's decoder layers; the decoder layers
compiled into the loop (calls of the attention kernel: 30 per target pass); what its memory
analysis reports (generated code, temporaries); the growth of resident memory over its compilation
(after returning freed heap with malloc_trim, before and after); what it really held (resident
memory freed when it is dropped); what the program cache records for it (`programs._measured_bytes`);
its memory maps.

dynamic: a Dynamic proposer compiled with one `lax.switch` over its widths whose branches each
draft, then verify or make a one-token pass under a `lax.cond` (as before), against two switches
(draft at the width, then verify it or make the one pass: what loop.py does now). Sizes, then the
time per decoding step of each, called alternately (A, B, A, B, ...) on the same inputs; the
outputs must be equal.

prefill: MIN_PREFILL_CHUNK (models/attention.py) 64 (now) against 128: sizes and the time of a prefill
(a call with max_new_tokens=1), alternately.

Linux only (it reads /proc/self/statm and /proc/self/maps).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, markdown_table

import specjax
from specjax import programs
from specjax.models import EagleHead, MedusaHead
from specjax.models import attention as attention_module
from specjax.speculate import loop

MB = 1 << 20
LIBC = ctypes.CDLL("libc.so.6")
LAYER_FILES = (  # frames inside the decoder layers
    "models/llama.py",
    "models/attention.py",
    "models/attention_primitives.py",
    "models/passes.py",
    "models/mlp.py",
    "models/norms.py",
    "models/rotary.py",
    "models/products.py",
    "kernels/layouts.py",
    "kernels/__init__.py",
    "cache.py",
)


def resident() -> int:
    gc.collect()
    LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def memory_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


class _Captured(Exception):
    pass


def program_arguments(model, prompts, proposer=None, max_new_tokens=128, sampling=None):
    """(spec, params, proposer_params, inputs) exactly as `generate` builds them for this call."""
    captured = {}
    real = programs.compile_program

    def intercept(*args):
        captured["args"] = args
        raise _Captured

    programs.clear_compiled_programs()
    programs.compile_program = intercept
    try:
        specjax.generate(model, prompts, proposer=proposer, max_new_tokens=max_new_tokens, sampling=sampling)
    except _Captured:
        pass
    finally:
        programs.compile_program = real
    return captured["args"]


def _frames(text: str) -> dict[int, str]:
    """stack frame id -> the file of its innermost location, from the HLO text's tables."""
    files, locations, frames, section = {}, {}, {}, None
    for line in text.splitlines():
        if line.startswith(("%", "ENTRY")):
            break
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        match = re.match(r"^(\d+) (.*)$", line)
        if not match:
            continue
        index, rest = int(match.group(1)), match.group(2)
        fields = dict(re.findall(r"(\w+)=(\d+)", rest))
        if section == "FileNames":
            files[index] = rest.strip('"')
        elif section == "FileLocations":
            locations[index] = files[int(fields["file_name_id"])]
        elif section == "StackFrames":
            frames[index] = locations[int(fields["file_location_id"])]
    return frames


def hlo_census(text: str) -> dict:
    """Instructions of an optimized HLO module (every computation, fused ones included): in all,
    in the prefill (outside the while loop), in the loop, inside decoder layers; attention kernel
    calls. An instruction without metadata (a fusion's parameters) counts where most of its
    computation's instructions do."""
    frames = _frames(text)
    counts = {"instructions": 0, "prefill": 0, "loop": 0, "layers": 0}
    computation: list[tuple[str, bool] | None] = []

    def close():
        known = [t for t in computation if t is not None]
        default = max(set(known), key=known.count) if known else ("prefill", False)
        for tag in computation:
            where, in_layer = tag or default
            counts["instructions"] += 1
            counts[where] += 1
            counts["layers"] += in_layer

    for line in text.splitlines():
        if line.startswith(("%", "ENTRY")) and line.rstrip().endswith("{"):
            close()
            computation = []
        elif re.match(r"^\s+(ROOT )?%\S+ = ", line):
            op = re.search(r'op_name="([^"]*)"', line)
            frame = re.search(r"stack_frame_id=(\d+)", line)
            if op is None:
                computation.append(None)
                continue
            where = "loop" if "/while/" in op.group(1) else "prefill"
            file = frames.get(int(frame.group(1)), "") if frame else ""
            computation.append((where, file.endswith(LAYER_FILES)))
    close()
    counts["attention_calls"] = text.count('custom_call_target="specjax_cache_attention"')
    return counts


def measure(args) -> dict:
    """Compile the program for `args`, measure it, drop it."""
    before, maps_before = resident(), memory_maps()
    start = time.perf_counter()
    compiled = programs.compile_program(*args)
    compile_time = time.perf_counter() - start
    after, maps_after = resident(), memory_maps()
    analysis = compiled.memory_analysis()
    row = {
        "compile_s": compile_time,
        **hlo_census(compiled.as_text()),
        "code_MB": analysis.generated_code_size_in_bytes / MB,
        "temp_MB": analysis.temp_size_in_bytes / MB,
        "growth_MB": (after - before) / MB,
        "recorded_MB": programs._measured_bytes(compiled, after - before) / MB,
        "maps": maps_after - maps_before,
    }
    held_before = resident()
    del compiled
    row["held_MB"] = (held_before - resident()) / MB
    row["bytes_per_instruction"] = row["held_MB"] * MB / row["instructions"]
    return row


def filler_prompt(approx_tokens: int) -> str:
    sentences = [
        f"Sentence {i}: the river town of Alder{i % 7} grew wheat, traded salt and kept {i} boats."
        for i in range(max(1, approx_tokens // 25))
    ]
    return "Summarize the following text in one paragraph.\n" + " ".join(sentences)


def size_cases(model):
    medusa = specjax.Medusa(MedusaHead.init(model, num_heads=3), tree=specjax.TokenTree.top_k((3, 2)))
    head = EagleHead.init(model, jax.random.key(0), vocab=np.arange(8192))
    eagle = specjax.Eagle(head, tree=specjax.TokenTree.top_k((3, 2, 1)))
    short, long = filler_prompt(10), filler_prompt(480)
    return [
        ("plain, bucket 16", None, [short]),
        ("plain, bucket 512", None, [long]),
        ("plain, batch 3, bucket 16", None, [short] * 3),
        ("NGram(k=5), bucket 16", specjax.NGram(k=5), [short]),
        ("NGram(k=5), bucket 512", specjax.NGram(k=5), [long]),
        ("SelfDraft(8, k=4)", specjax.SelfDraft(layers=8, k=4), [short]),
        ("Dynamic(NGram(k=8))", specjax.Dynamic(specjax.NGram(k=8)), [short]),
        ("Dynamic(SelfDraft(8, k=4))", specjax.Dynamic(specjax.SelfDraft(layers=8, k=4)), [short]),
        ("Medusa, top_k((3, 2)) tree", medusa, [short]),
        ("Eagle, top_k((3, 2, 1)) tree", eagle, [short]),
    ]


SIZE_COLUMNS = [
    ("compile s", "compile_s", "{:.1f}"),
    ("HLO instructions", "instructions", "{:,}"),
    ("prefill", "prefill", "{:,}"),
    ("loop", "loop", "{:,}"),
    ("in decoder layers", "layers", "{:,}"),
    ("layers in the loop", "attention_calls", "{}"),
    ("analysis: code MB", "code_MB", "{:.1f}"),
    ("temp MB", "temp_MB", "{:.1f}"),
    ("resident growth MB", "growth_MB", "{:.0f}"),
    ("held MB", "held_MB", "{:.0f}"),
    ("bytes/instruction", "bytes_per_instruction", "{:,.0f}"),
    ("recorded MB", "recorded_MB", "{:.0f}"),
    ("maps", "maps", "{}"),
]


def size_table(rows: list[tuple[str, dict]]) -> str:
    header = ["program"] + [name for name, _, _ in SIZE_COLUMNS]
    return markdown_table(
        header, [[label] + [fmt.format(row[key]) for _, key, fmt in SIZE_COLUMNS] for label, row in rows]
    )


def part_sizes(model) -> None:
    rows = []
    for label, proposer, prompts in size_cases(model):
        rows.append((label, measure(program_arguments(model, prompts, proposer))))
        print(f"  {label}: {rows[-1]}", flush=True)
    print(size_table(rows))


def _one_switch(spec, params, proposer_params, state, inputs, keys):
    """Dynamic widths as loop.py compiled them before: one switch, each branch drafting at its
    width and then verifying, or making a one-token pass under a cond (so once per width)."""
    running = ~state.done
    widths = spec.proposer.widths
    need = spec.proposer.needed_width(state.proposer_state, running)
    branch = jnp.searchsorted(jnp.asarray(widths), need)

    def at_width(width, state):
        proposal, proposer_state = loop._propose(
            spec, params, proposer_params, state, inputs, keys, width=width
        )
        skip = functools.partial(loop._skip, spec, params, inputs=inputs, keys=keys, write=False)
        verify = functools.partial(
            loop._verify, spec, params, inputs=inputs, keys=keys, width=width, write=False
        )
        if width == 0:
            verdict = skip(state, proposal)
        else:
            drafted = jnp.any(proposal.valid & running[:, None])
            verdict = jax.lax.cond(drafted, verify, skip, state, proposal)
        return verdict, proposer_state, proposal.valid

    return jax.lax.switch(branch, [functools.partial(at_width, w) for w in widths], state)


def alternate(programs: dict, args, repeats: int) -> dict:
    """Seconds per call of each compiled program, called in turn `repeats` times: the median per
    program, and each later program's median ratio to the first with the ratios' range."""
    times = {name: [] for name in programs}
    for _ in range(repeats):
        for name, program in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(program(*args))
            times[name].append(time.perf_counter() - start)
    first = next(iter(programs))
    out = {name: statistics.median(t) for name, t in times.items()}
    for name in list(programs)[1:]:
        ratios = [b / a for a, b in zip(times[first], times[name], strict=True)]
        out[f"{name}/{first}"] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def part_dynamic(model, repeats: int) -> None:
    prompt = filler_prompt(150)
    for proposer in (
        specjax.Dynamic(specjax.NGram(k=8)),
        specjax.Dynamic(specjax.SelfDraft(layers=8, k=4)),
    ):
        for batch in (1, 3):
            args = program_arguments(model, [prompt] * batch, proposer, max_new_tokens=128)
            sizes, programs = {}, {}
            for name, widths in (("one switch", _one_switch), ("two switches", None)):
                two = loop._propose_and_verify_widths
                if widths is not None:
                    loop._propose_and_verify_widths = widths
                try:
                    sizes[name] = measure(args)
                    programs[name] = programs.compile_program(*args)
                finally:
                    loop._propose_and_verify_widths = two
            outputs = [jax.device_get((p(*args[1:]).tokens, p(*args[1:]).lengths)) for p in programs.values()]
            assert all(np.array_equal(a, b) for a, b in zip(outputs[0], outputs[1], strict=True))
            steps = int(np.max(jax.device_get(programs["two switches"](*args[1:]).metrics.steps)))
            timing = alternate(programs, args[1:], repeats)
            print(f"\n{specjax.ablation.proposer_label(proposer)}, batch {batch}, {steps} steps")
            print(size_table(list(sizes.items())))
            for name in programs:
                print(f"  {name}: {timing[name] / steps * 1e3:.2f} ms per step (call / steps)")
            ratio, low, high = timing["two switches/one switch"]
            print(f"  two switches / one switch: median {ratio:.3f} (range {low:.3f}-{high:.3f})", flush=True)
            del programs


def part_prefill(model, repeats: int) -> None:
    for tokens in (130, 260, 520, 800):
        args = program_arguments(model, [filler_prompt(tokens)], None, max_new_tokens=1)
        sizes, programs = {}, {}
        for chunk in (64, 128):
            old = attention_module.MIN_PREFILL_CHUNK
            attention_module.MIN_PREFILL_CHUNK = chunk
            try:
                sizes[f"chunks of >= {chunk}"] = measure(args)
                programs[f"chunks of >= {chunk}"] = programs.compile_program(*args)
            finally:
                attention_module.MIN_PREFILL_CHUNK = old
        timing = alternate(programs, args[1:], repeats)
        print(f"\nprefill, bucket {args[0].prompt_bucket}")
        print(size_table(list(sizes.items())))
        for name in programs:
            print(f"  {name}: {timing[name] * 1e3:.0f} ms per call (prefill + one token)")
        ratio, low, high = timing["chunks of >= 128/chunks of >= 64"]
        print(f"  128 / 64: median {ratio:.3f} (range {low:.3f}-{high:.3f})", flush=True)
        del programs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", nargs="+", default=["sizes"], choices=["sizes", "dynamic", "prefill"])
    parser.add_argument("--repeats", type=int, default=15)
    options = parser.parse_args()
    print(machine())
    model = specjax.load("smollm2-135m")
    specjax.generate(model, [[1, 2, 3]], max_new_tokens=2)  # pack the panel weights once
    programs.clear_compiled_programs()
    for part in options.parts:
        if part == "sizes":
            part_sizes(model)
        elif part == "dynamic":
            part_dynamic(model, options.repeats)
        else:
            part_prefill(model, options.repeats)


if __name__ == "__main__":
    main()
