"""`generate()`: the host side of a generation (and `load()`, which places a model's weights on a
mesh for it).

Plan the call (specjax/planner.py: validate, tokenize, right-pad to a length bucket, the program's
spec and arguments), find or compile its program (specjax/programs.py), make one call, fetch the
result once, detokenize. All per-step work happens on the device inside that one call.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from specjax import models, planner, programs, sharding
from specjax.models.model import Model
from specjax.speculate.logprobs import Logprobs
from specjax.speculate.metrics import SpecMetrics
from specjax.speculate.sampling import Sampling
from specjax.speculate.stops import cut_text
from specjax.text import Message


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per row, ending at a stop (its token included) or the limit
    texts: list[str] | None  # decoded new tokens, cut before a stop string (None without a tokenizer)
    metrics: SpecMetrics
    prompt_tokens: list[list[int]]  # the token ids each row was fed
    # Why each row ended: "stop" (EOS, a stop token id or a stop string) or "length" (it reached
    # max_new_tokens). A row whose last allowed token is a stop ends with "stop".
    finish_reasons: list[str]
    # With `generate(..., logprobs=N)`: per row, its emitted tokens' logprobs and each position's
    # N most likely tokens (speculate/logprobs.py's `Logprobs`); None when logprobs were off.
    logprobs: list[Logprobs] | None = None
    # With `generate(..., prompt_logprobs=N)`: per row, its prompt tokens from the second on, each
    # with its logprob given those before it and the N most likely tokens there; None when off.
    prompt_logprobs: list[Logprobs] | None = None


def load(
    source,
    dtype: Any = "float32",
    cache_dir=None,
    mesh=None,
    quantization: str | None = None,
    group_size: int | None = None,
    tokenizer=None,
) -> Model:
    """Load a model with its tokenizer (`specjax.models.load`), placed on `mesh` when given one.

    source: a built-in name (e.g. "smollm2-135m"), an HF checkpoint folder (`config.json` +
        safetensors) or a `.gguf` file.
    dtype: "float32", "bfloat16" or "float16" (or the jnp dtype) for weights and activations; norm
        statistics, softmax, logits, sampling and verification stay float32.
    cache_dir: where converted GGUF weights are kept; default `$SPECJAX_CACHE` or `~/.cache/specjax`.
    mesh: a jax Mesh from `specjax.sharding.make_mesh`: each device receives only its slice of
        each weight, ready for `generate(..., mesh=mesh)`; on a mesh that spans processes, each
        process reads from the checkpoint only the slices its own devices hold. The model's heads
        and ffw size must divide the mesh's model axis.
    quantization: None (the source's own weights: float, or an FP8 checkpoint's FP8 as
        released), "gguf" (keep a .gguf file's blocks: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), "int8",
        "int4" or "fp8" (quantize the projections and the LM head at load, from any source; an
        FP8 checkpoint's own FP8 weights are kept by "fp8", requantized by the others);
        `group_size`: int4's groups, 32 (default) or 128. See docs/models.md, "Quantized weights".
    tokenizer: an HF tokenizer to use instead of the source's own: for a GGUF whose tokenizer
        specjax does not rebuild (a ValueError names it), e.g.
        `transformers.AutoTokenizer.from_pretrained("the HF repo")`. Its ids must be the model's.
    """
    options = dict(dtype=dtype, cache_dir=cache_dir, quantization=quantization, group_size=group_size)
    if mesh is None:
        return models.load(source, **options, tokenizer=tokenizer)
    sharding.check_mesh(mesh)

    def placer_for(config):
        sharding.check_model_split(mesh, config)  # before any weight is read
        return sharding.slice_placer(config, mesh)  # this process reads only its devices' slices

    return models.load(source, **options, placer_for=placer_for, tokenizer=tokenizer)


def generate(
    model: Model,
    prompts: str | Sequence[str] | Sequence[Sequence[int]] | Sequence[Message] | Sequence[Sequence[Message]],
    proposer=None,
    sampling: Sampling | Sequence[Sampling] | None = None,
    max_new_tokens: int = 128,
    key: jax.Array | None = None,
    chat: bool = False,
    mesh=None,
    cache_dtype=None,
    kernels: str = "auto",
    matmul_precision: str | None = None,
    batch_buckets: Sequence[int] | None = None,
    scan_layers: bool | None = None,
    prefill_chunk: int | str | None = "auto",
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    page_size: int | None = None,
) -> GenerateResult:
    """Generate up to `max_new_tokens` tokens per prompt; see DESIGN.md section 3.

    `prompts` is one prompt or a list of them. A prompt is a str, a list of token ids, or, with
    `chat=True`, a conversation: a list of messages `{"role": "system" | "user" | "assistant",
    "content": str}` rendered by the tokenizer's chat template with the assistant's turn opened
    (`specjax.chat_prompt_ids`). With `chat=True` a str is one user message; token ids are fed as
    they are. So a list of dicts is one conversation, a list of lists of dicts a batch of them.
    `result.finish_reasons[b]` is "stop" where row b ended at EOS, a stop token id or a stop
    string, "length" where it reached `max_new_tokens`.

    Which proposer to try first: `NGram(k=8)`, or `Dynamic(NGram(k=8))` to let each row lower k
    where drafts fail, for input-grounded work (edits, summaries, RAG, code): drafting is free
    and the answer repeats the prompt (`make demo`: 2.4x plain decoding on edits on a 2-core CPU).
    A trained head (`Eagle3`, `Eagle`, `Medusa`, `DFlash`) where its acceptance is high and a
    verify pass costs little more than a step (an accelerator). `proposer=None` (plain decoding)
    for short open-ended chat on a CPU, where few drafts are right and each verify pass over
    k + 1 tokens costs more than a plain step. Every proposer is lossless.

    `sampling` is one Sampling for every row or a list with one per prompt; rows may mix greedy
    and sampled decoding and any options in one compiled program. `cache_dtype` ("float32",
    "bfloat16" or "float16"; default: the model's dtype) is the dtype of the target's KV cache; a
    proposer's own cache (a draft model's, an EAGLE head's) follows its own weights.

    `kernels` picks the kernels (specjax/kernels/backend.py): "auto" (the platform's own: the CPU
    kernels on a CPU, Pallas attention on a GPU or TPU for heads 64, 128 or 256 wide, plain XLA
    attention for other heads), "xla" (plain XLA everywhere), or
    "pallas:tpu" / "pallas:cuda" (that accelerator's Pallas kernels, interpreted where the program
    runs elsewhere: slow, for checking their numerics). `matmul_precision` (jax's names:
    "default", "high", "highest", ...) is the precision of the products; default "highest" for a
    float32 model, so that its products are float32 on every platform (accelerators otherwise use
    TF32 or bfloat16 passes), and the platform's default for bfloat16 and float16 models.

    The batch is padded to a bucket so that a new number of prompts rarely compiles a new program:
    `batch_buckets` lists the batch sizes to pad to (increasing), default 1, 2, 4, 8, ...; on a
    mesh, the smallest that is a multiple of its data-parallel degree. Padding rows are done from
    the start: they cost their share of each step's compute and appear nowhere in the result.

    `scan_layers`: run each run of decoder layers of one shape as one loop over their stacked weights
    (True), so that the program and its compile time stay the same size whatever the depth, or
    unrolled (False). Default (None): unrolled on every platform, since XLA copies each layer's
    slice out of the stack before its products: a decoding step 1.8x slower on the CPU, 2.5x on
    an H200 (a bfloat16 8B model: 11.9 against 4.8 ms). Scanning stacks the layers' weights once
    per call: a copy of them in device memory while the program runs.

    `prefill_chunk`: the prompts go through the target in chunks of this many tokens of one row,
    inside the compiled program (a multiple of 16), so that no row is padded to the longest prompt
    and the program depends on the prompts' lengths only through the cache's capacity, which steps
    coarsely (256, 512, ..., 4096, then multiples of 4096 slots: prompts of 40 to 4,000 tokens
    share six programs). None: every prompt in one pass, the batch padded to a prompt bucket (16,
    32, 64, then multiples of 64 tokens: a program per bucket). Default "auto": chunks of 256 on
    one CPU device, except for a batch whose prompts all fit a bucket shorter than a chunk, which
    runs in one pass (each row's chunk would compute mostly padding); one pass on a mesh or an
    accelerator (where chunks are not yet measured).

    `logprobs`: None (off: the program computes none), or N >= 0: `result.logprobs[b]` holds each
    emitted token's logprob and, at its position, the N most likely tokens and their logprobs
    (N = 0: the token's own only), computed inside the compiled loop from the logits of the passes
    it makes anyway. The distribution is the one the token was drawn from: the target's logits
    after logit bias and penalties, then temperature, top-k, top-p and min-p (filtered tokens:
    -inf); for a greedy row, the log-softmax of the logits after bias and penalties, at temperature
    1 and unfiltered. A rejection-sampling correction token (drawn from the residual max(p - q, 0))
    reports its logprob under the target's distribution p, as vLLM does, so every proposer reports
    the logprobs plain decoding reports for the same tokens (to float rounding).

    `prompt_logprobs`: None (off), or N >= 0: `result.prompt_logprobs[b]` holds row b's prompt
    tokens from the second on, each with its logprob given the tokens before it and the N most
    likely tokens there, under the model's own distribution (the log-softmax of the raw logits,
    temperature 1, no bias, penalty or filter: the prompt was not sampled), as vLLM reports them;
    taken from the prefill's pass (then one pass over the padded prompts, not chunks).

    `page_size`: None (the target's KV cache dense: each row's slots in one buffer), or the slots
    per page of a paged cache (a power of two, at least 16): the cache is a pool of pages read and
    written through each row's page table, as the serving engine's (docs/serving.md); here each
    row holds its own pages in order, so the tokens are the dense layout's. Where the attention
    kernel reads pages in place (the CPU's), a chunked prefill packs the rows' prompts end to end,
    `prefill_chunk` tokens a pass whatever rows they belong to, so the batch's prompts are padded
    once in all rather than each row to whole chunks. One device only, not under latent attention
    (MLA).

    On a mesh that spans processes (after `jax.distributed.initialize`), every process makes the
    same call and receives the whole result; a process whose prompts, options or mesh differ from
    the others' makes every process raise a ValueError before anything is compiled
    (specjax/sharding/processes.py).
    """
    agreement = sharding.CallAgreement(mesh, "generate")
    try:
        options = dict(
            proposer=proposer,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            key=key,
            chat=chat,
            mesh=mesh,
            cache_dtype=cache_dtype,
            kernels=kernels,
            matmul_precision=matmul_precision,
            batch_buckets=batch_buckets,
            scan_layers=scan_layers,
            prefill_chunk=prefill_chunk,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            page_size=page_size,
        )
        return _generate(model, prompts, options, agreement)
    except Exception:
        agreement.fail()  # the other processes must not wait for this one's fingerprint
        raise


def _generate(model, prompts, options: dict, agreement) -> GenerateResult:
    return _run(model, planner.plan(model, prompts, **options, agreement=agreement))


def _run(model: Model, prepared: planner.Plan) -> GenerateResult:
    """Compile (or find) the planned program, run it and make the result."""
    spec, params, proposer_params, inputs = (
        prepared.spec,
        prepared.params,
        prepared.proposer_params,
        prepared.inputs,
    )
    rows, samplings, mesh, k = prepared.rows, prepared.samplings, spec.mesh, spec.k
    num_rows = len(rows)  # the batch's real rows; the program's spec.batch_size pads them
    program, compile_time = programs.compiled(spec, params, proposer_params, inputs)
    start = time.perf_counter()
    state = program(params, proposer_params, inputs)
    fetch = jax.device_get if mesh is None else sharding.fetch  # the latter spans hosts too
    # A proposer's own counts (a Hybrid's per part), or None
    own = None if spec.proposer is None else spec.proposer.counters(state.proposer_state)
    tokens, lengths, max_lengths, nonfinite_step, counters, own, kept, scored = fetch(
        (
            state.tokens,
            state.lengths,
            state.max_lengths,
            state.nonfinite_step,
            state.metrics,
            own,
            state.logprobs,
            state.prompt_logprobs,
        )
    )
    run_time = time.perf_counter() - start
    # Drop the padding rows: every per-row array, the metrics' counters included.
    nonfinite_step, counters, own = jax.tree.map(lambda x: x[:num_rows], (nonfinite_step, counters, own))

    if (nonfinite_step >= 0).any():
        bad = ", ".join(
            f"row {b} at step {nonfinite_step[b]}" + (" (the prefill)" if nonfinite_step[b] == 0 else "")
            for b in np.flatnonzero(nonfinite_step >= 0)
        )
        raise FloatingPointError(
            f"the model produced non-finite logits (NaN or inf) for {bad}: check its weights "
            f"(model {model.name!r})"
        )
    new_tokens = [tokens[b, len(row) : lengths[b]].tolist() for b, row in enumerate(rows)]
    texts, cut = None, [False] * num_rows
    if model.tokenizer is not None:
        whole = [model.tokenizer.decode(t, skip_special_tokens=True) for t in new_tokens]
        texts = [cut_text(text, s.stop) for text, s in zip(whole, samplings, strict=True)]
        cut = [len(a) < len(b) for a, b in zip(texts, whole, strict=True)]
    at_limit = (lengths >= max_lengths)[:num_rows].tolist()
    metrics = SpecMetrics.from_counters(
        counters, k=k, compile_time_s=compile_time, run_time_s=run_time, proposer=own
    )
    logprobs = None
    if kept is not None:
        logprobs = [Logprobs.of_row(kept, new_tokens[b], b, len(row)) for b, row in enumerate(rows)]
    prompt_logprobs = None
    if scored is not None:
        prompt_logprobs = [Logprobs.of_row(scored, row[1:], b, 0) for b, row in enumerate(rows)]
    return GenerateResult(
        tokens=new_tokens,
        texts=texts,
        metrics=metrics,
        prompt_tokens=rows,
        finish_reasons=planner.finish_reasons(model, new_tokens, samplings, at_limit, cut),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
