"""Planted bugs: does the test suite catch the mistakes that matter most in speculative decoding?

Each bug below is one literal replacement (old text -> new text) in one file of the package. For
each, this script copies `specjax/` into a temporary folder, plants the bug there, and runs the
test selection that should catch it with the copy imported in place of the repository's package
(PYTHONPATH points at the copy; `python -P` keeps the working folder off sys.path; the copy's
`__init__.py` writes its own path to a marker file, which is checked after the run). A bug is
*caught* when its tests fail, *survived* when they pass. The script exits non-zero when a bug
survives, when an old text no longer occurs exactly once (code moved by a refactor: the bug list
must follow it, rather than silently planting nothing), or when a run errs for another reason
(no tests selected, a collection error, the copy not imported).

Most of these bugs leave greedy output intact (verification repairs whatever a broken proposer
drafts), so they are caught only by tests that check acceptance, drafts against a reference, or
sampled laws. The list and the latest results: docs/planted-bugs.md.

Usage (from the repository root):

    python tests/planted_bugs.py                 # every bug; the table at the end
    python tests/planted_bugs.py --list          # the bugs, their files and their tests
    python tests/planted_bugs.py --bug NAME ...  # some of them (repeat --bug)
    python tests/planted_bugs.py --baseline      # first run each selection on an unplanted copy

`make test-all` runs it after the whole suite has passed (so without --baseline). It lives beside
the tests rather than in benchmarks/ because it measures the tests, not the library; pytest does
not collect it (no test_ prefix).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER_ENV = "SPECJAX_PLANTED_MARKER"
# Appended to the copy's __init__.py: proves that the copy, not the repository's package, ran.
MARKER_CODE = f"""

import os as _os

if _os.environ.get("{MARKER_ENV}"):
    with open(_os.environ["{MARKER_ENV}"], "a") as _marker:
        _marker.write(__file__ + "\\n")
"""


@dataclasses.dataclass(frozen=True)
class Bug:
    name: str
    what: str  # the mistake, in words
    file: str  # relative to specjax/
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest paths or node ids, relative to the repository
    keyword: str | None = None  # pytest -k expression
    slow: bool = False  # the selection includes tests marked slow (run with -m "")

    def selection(self) -> str:
        keyword = f" -k '{self.keyword}'" if self.keyword else ""
        return " ".join(self.tests) + keyword + (" -m ''" if self.slow else "")


BUGS = [
    # -- verification (speculate/verify.py, speculate/tree.py)
    Bug(
        "accept-1.25",
        "a draft is accepted with probability min(1, 1.25 p/q) instead of min(1, p/q)",
        "speculate/verify.py",
        "num_accepted = _prefix_length(valid & (u * q_draft < p_draft))",
        "num_accepted = _prefix_length(valid & (u * q_draft < 1.25 * p_draft))",
        ("tests/test_verify.py",),
        "exact_laws",
    ),
    Bug(
        "replacement-from-p",
        "a rejected draft is replaced by a draw from p instead of normalize(max(p - q, 0))",
        "speculate/verify.py",
        "stop_probs = jnp.where(usable, residual, p_stop)",
        "stop_probs = jnp.where(usable, p_stop, p_stop)",
        ("tests/test_verify.py",),
        "exact_laws",
    ),
    Bug(
        "tree-stale-residual",
        "a tree row whose children were all rejected draws from the residual before its last "
        "sibling's rejection",
        "speculate/tree.py",
        "r_left = jnp.where(update, left, r_left)",
        "r_left = jnp.where(update, r, r_left)",
        ("tests/test_tree.py",),
        "tree_rejection_sample_law",
    ),
    # -- sampling (speculate/sampling.py): the sorted reference and the capped fast path
    Bug(
        "top-p-sorted",
        "top-p (full sort) drops the token whose mass crosses the threshold",
        "speculate/sampling.py",
        "keep_sorted &= (mass_before < top_p)",
        "keep_sorted &= (mass_before + probs < top_p)",
        ("tests/test_warp_candidates.py",),  # the sort is the reference the fast path must equal
        "capped_warp_equals_the_sorted_reference",
    ),
    Bug(
        "top-p-capped",
        "top-p (the largest candidates only, the default path) drops the token whose mass crosses "
        "the threshold",
        "speculate/sampling.py",
        "keep &= (mass_before < top_p)",
        "keep &= (mass_before + probs < top_p)",
        ("tests/test_sampling_options.py",),
        "adjust_and_warp_match_the_numpy_reference",
    ),
    # -- model drafts (speculate/proposers/draft.py). DraftModel and SelfDraft share DraftSpec's
    # code, so each rollback bug is confined to one of them by `shares_target_params`.
    Bug(
        "draft-advance-plus-one",
        "the draft's cache advances one slot more than it fed, at every draft step",
        "speculate/proposers/draft.py",
        "cache = cache.advance(jnp.full((B,), fed.shape[1], jnp.int32))",
        "cache = cache.advance(jnp.full((B,), fed.shape[1] + 1, jnp.int32))",
        ("tests/test_speculative.py",),
        "accepts_everything",
    ),
    Bug(
        "draftmodel-rollback",
        "DraftModel trusts its cache one slot too far (rolled back to L - 1, not L - 2)",
        "speculate/proposers/draft.py",
        "cache = state.cache.replace(lengths=lengths - 2)",
        "cache = state.cache.replace(lengths=lengths - 2 + (not self.shares_target_params))",
        ("tests/test_speculative.py",),
        "accepts_everything",
    ),
    Bug(
        "selfdraft-rollback",
        "SelfDraft trusts its cache one slot too far (rolled back to L - 1, not L - 2)",
        "speculate/proposers/draft.py",
        "cache = state.cache.replace(lengths=lengths - 2)",
        "cache = state.cache.replace(lengths=lengths - 2 + self.shares_target_params)",
        ("tests/test_speculative.py",),
        "accepts_everything",
    ),
    # -- head drafts: the pending features' rollback (EAGLE-1 and EAGLE-3 share EagleSpec's
    # code, so each bug is confined to one of them by its class)
    Bug(
        "eagle-rollback",
        "EAGLE-1's head cache is rolled back to one pair past the committed ones (a stale pair trusted)",
        "speculate/proposers/eagle.py",
        "state.cache.replace(lengths=start)\n",
        "state.cache.replace(lengths=start + (type(self) is EagleSpec))\n",
        ("tests/test_eagle.py",),
        "drafts_equal_a_from_scratch_reference",
    ),
    Bug(
        "eagle3-rollback",
        "EAGLE-3's head cache is rolled back to one pair past the committed ones (a stale pair trusted)",
        "speculate/proposers/eagle.py",
        "state.cache.replace(lengths=start)\n",
        "state.cache.replace(lengths=start + (type(self) is not EagleSpec))\n",
        ("tests/test_eagle3_loop.py",),
        "drafts_equal_a_from_scratch_reference",
        slow=True,
    ),
    Bug(
        "dflash-rollback",
        "DFlash's context cache is rolled back to one position past the committed ones",
        "speculate/proposers/dflash.py",
        "state.pending, positions, state.cache.replace(lengths=start)",
        "state.pending, positions, state.cache.replace(lengths=start + 1)",
        ("tests/test_dflash_loop.py",),
        "drafts_equal_a_from_scratch_reference",
    ),
    # -- token trees in the loop: the accepted path's keys and values moved into place
    Bug(
        "tree-move-sources",
        "the accepted path's cache entries are moved from one slot too far",
        "speculate/loop.py",
        "sources = state.lengths[:, None] - 1 + source",
        "sources = state.lengths[:, None] + source",
        ("tests/test_trees_in_the_loop.py",),
        "medusa_greedy_equals_plain",
    ),
    Bug(
        "mesh-move-sources",
        "on a mesh only, the accepted path's cache entries are moved from one slot too far",
        "sharding/forward.py",
        "return _per_device(mesh, KVCache.move_slots, cache, sources, row_spec())",
        "return _per_device(mesh, KVCache.move_slots, cache, sources if mesh is None else sources + 1, "
        "row_spec())",
        ("tests/test_sharding.py",),
        "tree",
    ),
    # -- penalties' running counts (speculate/history.py, speculate/loop.py)
    Bug(
        "counts-first-token-only",
        "the penalties' counts take only the first token a step commits, not its accepted drafts",
        "speculate/loop.py",
        "history = history.add(candidates, num_emitted)",
        "history = history.add(candidates, jnp.minimum(num_emitted, 1))",
        ("tests/test_sampling_options.py",),
        "speculative_greedy_with_options_equals_plain",
    ),
    Bug(
        "counts-drafts-twice",
        "the verify pass counts each draft on a token's path twice",
        "speculate/history.py",
        "return self.counts[:, None, :] + on_path",
        "return self.counts[:, None, :] + 2 * on_path",
        ("tests/test_sampling_options.py",),
        "counts_at_nodes",
    ),
    # -- stop strings (speculate/stops.py, speculate/loop.py)
    Bug(
        "stops-no-fail-links",
        "the stop-string automaton falls back to its root after a partial match fails",
        "speculate/stops.py",
        "fail[child] = delta[fail[state], column]",
        "fail[child] = 0",
        ("tests/test_sampling_options.py",),
        "stop_automaton_against_brute_force",
    ),
    Bug(
        "stops-state-past-emitted",
        "a row's automaton state is taken after every candidate, not after the last one emitted",
        "speculate/loop.py",
        "last = states_after[jnp.arange(B), jnp.maximum(num_emitted - 1, 0)]",
        "last = states_after[:, -1]",
        ("tests/test_sampling_options.py",),
        "stop_strings_end_rows_at_the_first_occurrence",
    ),
    # -- per-row seeds (speculate/loop.py)
    Bug(
        "seed-of-another-row",
        "a seeded row draws from the previous row's seed",
        "speculate/loop.py",
        "own = jax.vmap(lambda seed: jax.random.key(seed, impl=impl))(inputs.seeds)",
        "own = jax.vmap(lambda seed: jax.random.key(seed, impl=impl))(jnp.roll(inputs.seeds, 1))",
        ("tests/test_sampling_options.py",),
        "seeded_row",
    ),
    Bug(
        "seed-ignored",
        "a row's seed is ignored: every row draws from the call's key",
        "speculate/loop.py",
        "jnp.where(seeded, own, derived)",
        "jnp.where(seeded, derived, derived)",
        ("tests/test_sampling_options.py",),
        "seeded_row",
    ),
]


@dataclasses.dataclass
class Outcome:
    bug: Bug
    status: str  # "caught", "survived" or "error"
    seconds: float
    failed: list[str]  # the failing tests pytest named
    summary: str  # pytest's last line, e.g. "1 failed, 2 passed, 9 deselected"
    detail: str = ""


def copy_package(into: Path) -> Path:
    """A copy of specjax/ under `into`, its __init__ marking each import; returns the copy."""
    package = into / "specjax"
    shutil.copytree(REPO / "specjax", package, ignore=shutil.ignore_patterns("__pycache__"))
    with open(package / "__init__.py", "a") as f:
        f.write(MARKER_CODE)
    return package


def planted_text(bug: Bug) -> str:
    """The bug's file with the bug in it; a SystemExit unless its old text occurs exactly once."""
    text = (REPO / "specjax" / bug.file).read_text()
    count = text.count(bug.old)
    if count != 1:
        raise SystemExit(
            f"bug {bug.name}: {bug.old!r} occurs {count} times in specjax/{bug.file}, not once: "
            "the code moved; update the bug in tests/planted_bugs.py"
        )
    return text.replace(bug.old, bug.new)


def plant(package: Path, bug: Bug) -> None:
    (package / bug.file).write_text(planted_text(bug))


def run_tests(package: Path, bug: Bug, timeout: float, verbose: bool) -> tuple[int, str, float]:
    """Run the bug's selection against the copy: (pytest's exit code, its output, seconds)."""
    marker = package.parent / "imported.txt"
    marker.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package.parent), env.get("PYTHONPATH")]))
    env[MARKER_ENV] = str(marker)
    command = [sys.executable, "-P", "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider"]
    command += ["-p", "no:xdist", *(["-m", ""] if bug.slow else []), *bug.tests]
    if bug.keyword:
        command += ["-k", bug.keyword]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, output = -1, f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
    seconds = time.perf_counter() - start
    if verbose:
        print(output)
    imported = set(marker.read_text().split()) if marker.exists() else set()
    if code in (0, 1) and imported != {str(package / "__init__.py")}:
        raise SystemExit(
            f"bug {bug.name}: the tests imported {sorted(imported) or 'no marked specjax'}, not the copy"
        )
    return code, output, seconds


def failed_tests(output: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.MULTILINE)


def summary_line(output: str) -> str:
    """pytest's counts ("1 failed, 2 passed, 9 deselected"), without the time."""
    found = re.findall(
        r"^=*\s*(\d+ (?:failed|passed|error|deselected|skipped).*?) in [\d.]+s", output, re.MULTILINE
    )
    return found[-1] if found else ""


def run_bug(bug: Bug, timeout: float, verbose: bool, baseline: bool) -> Outcome:
    with tempfile.TemporaryDirectory(prefix=f"planted-{bug.name}-") as folder:
        package = copy_package(Path(folder))
        if baseline:
            code, output, seconds = run_tests(package, bug, timeout, verbose)
            if code != 0:
                failed, summary = failed_tests(output), summary_line(output)
                return Outcome(bug, "error", seconds, failed, summary, f"fails unplanted (exit {code})")
        plant(package, bug)
        code, output, seconds = run_tests(package, bug, timeout, verbose)
    failed, summary = failed_tests(output), summary_line(output)
    if code == 0:
        return Outcome(bug, "survived", seconds, failed, summary)
    if code == 1 and failed:
        return Outcome(bug, "caught", seconds, failed, summary)
    tail = output.strip().splitlines()[-1:] or [""]
    return Outcome(bug, "error", seconds, failed, summary, f"pytest exit {code}: {tail[0]}")


def table(outcomes: list[Outcome]) -> str:
    lines = [
        "| bug | file | tests run | result | pytest | seconds | failed first |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for o in outcomes:
        first = ", ".join(f"`{t.split('/')[-1]}`" for t in o.failed[:1]) or o.detail or "-"
        lines.append(
            f"| {o.bug.name} | `{o.bug.file}` | `{o.bug.selection()}` | {o.status} | {o.summary} | "
            f"{o.seconds:.0f} | {first} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    parser.add_argument("--bug", action="append", metavar="NAME", help="run this bug only (repeatable)")
    parser.add_argument("--baseline", action="store_true", help="first check each selection passes unplanted")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run (default 1200)")
    parser.add_argument("--verbose", action="store_true", help="print pytest's output")
    args = parser.parse_args(argv)

    if args.list:
        for bug in BUGS:
            print(f"{bug.name}  (specjax/{bug.file})\n    {bug.what}\n    tests: {bug.selection()}")
        return 0
    by_name = {bug.name: bug for bug in BUGS}
    unknown = [name for name in args.bug or () if name not in by_name]
    if unknown:
        parser.error(f"unknown bug {', '.join(unknown)}; --list shows the names")
    bugs = [by_name[name] for name in args.bug] if args.bug else BUGS

    for bug in bugs:  # every old text is checked before any test runs: a moved one fails at once
        planted_text(bug)

    outcomes, start = [], time.perf_counter()
    for bug in bugs:
        print(f"{bug.name}: {bug.selection()} ...", end=" ", flush=True)
        outcome = run_bug(bug, args.timeout, args.verbose, args.baseline)
        outcomes.append(outcome)
        print(f"{outcome.status} in {outcome.seconds:.0f} s {outcome.detail}".rstrip(), flush=True)
    print()
    print(table(outcomes))
    print(f"\n{len(outcomes)} bugs in {time.perf_counter() - start:.0f} s")
    bad = [o.bug.name for o in outcomes if o.status != "caught"]
    if bad:
        print(f"NOT CAUGHT: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
