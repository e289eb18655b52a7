"""The engine's loop programs and which one a chunk runs (specjax/serve/engine.py).

The engine compiles its decoding loop in a few variants, each a `LoopSpec` named by its kind:

- "resume": every sampling option the engine serves (`EngineConfig.warp`);
- "lean": for chunks whose requests are all greedy without penalties or logit bias (the common
  case), without the sampling paths: the full program's filters and draws cost every row's
  logits a sort and a softmax per step;
- "...-quiet": with a Dynamic proposer that can skip drafting, each kind splits in two
  (DynamicSpec.chunk_programs): chunks in which no row may draft run a quiet program of plain
  decoding's one-token steps, and end as soon as a row may draft; the others end as soon as none
  may;
- "resume+logprobs" (and "resume-quiet+logprobs"): with `EngineConfig.logprobs`, the full
  loop also computes the committed tokens' logprobs and top N, for chunks in which a running
  request asked for them (`Request.logprobs`). The others compute none: the top N of every row's
  distribution at every verified position costs a top-k over the vocabulary per position, which
  no request pays for unless one asks. There is no lean variant with logprobs: each variant is
  one more program per width to compile before serving (about 20 s each for the built-in model
  on this CPU), and a chunk that computes logprobs already pays a softmax over the vocabulary
  per position. Every variant runs on the same state (its logprob buffers are written only by
  the "+logprobs" ones), so a chunk may run any of them.
"""

from __future__ import annotations

import dataclasses

import jax

from specjax.speculate.proposers import resolve
from specjax.speculate.sampling import WarpSpec
from specjax.speculate.spec import LoopSpec

QUIET, WITH_LOGPROBS = "-quiet", "+logprobs"


def loop_specs(spec: LoopSpec, proposer, model, proposer_params) -> dict[str, LoopSpec]:
    """The loop's variants by kind (the module docstring) for the engine's `spec`, whose
    `logprobs` (None: off) is what the "+logprobs" variants compute and what the prefill
    records for each request's first token."""
    plain = dataclasses.replace(spec, logprobs=None)
    loops = {"resume": plain}
    lean = _lean_loop(plain, proposer, model, proposer_params)
    if lean is not None:
        loops["lean"] = lean
    for kind, loop in list(loops.items()):
        programs = None if loop.proposer is None else loop.proposer.chunk_programs()
        if programs is not None:
            drafting, quiet = (dataclasses.replace(loop, proposer=p) for p in programs)
            loops |= {kind: drafting, kind + QUIET: quiet}
    if spec.logprobs is not None:
        counted = {
            kind + WITH_LOGPROBS: dataclasses.replace(loop, logprobs=spec.logprobs)
            for kind, loop in loops.items()
            if kind.startswith("resume")
        }
        loops |= counted
    return loops


def _lean_loop(spec: LoopSpec, proposer, model, proposer_params) -> LoopSpec | None:
    """The "lean" variant: the loop compiled without the sampling paths. Its state is the full
    program's (penalty counts kept up to date, unread). None where the full loop is lean
    already, or where the proposer's params differ without the sampling paths."""
    if spec.warp == WarpSpec():
        return None
    lean_proposer, lean_params = resolve(proposer, model, WarpSpec(), spec.mesh)
    if jax.tree.structure(lean_params) != jax.tree.structure(proposer_params):
        return None
    return dataclasses.replace(spec, warp=WarpSpec(), proposer=lean_proposer)


def chunk_kind(loops: dict[str, LoopSpec], samplings, logprobs: bool) -> str:
    """The kind of loop a chunk runs before Dynamic's quiet check: "resume+logprobs" where a
    running request asked for logprobs (`logprobs`), else "lean" where every running request's
    sampling (`samplings`, the running slots') is greedy without penalties or bias and the engine
    has a lean variant, else "resume"."""
    if logprobs:
        return "resume" + WITH_LOGPROBS
    lean = "lean" in loops and all(WarpSpec.of(s) == loops["lean"].warp for s in samplings)
    return "lean" if lean else "resume"


def quiet_kind(kind: str) -> str:
    """The quiet variant of a kind ("resume+logprobs" -> "resume-quiet+logprobs")."""
    if kind.endswith(WITH_LOGPROBS):
        return kind.removesuffix(WITH_LOGPROBS) + QUIET + WITH_LOGPROBS
    return kind + QUIET


def is_quiet(kind: str) -> bool:
    return QUIET in kind
