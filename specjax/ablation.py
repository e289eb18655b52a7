"""Research sweeps: run a grid of proposers, k, sampling settings and seeds, get one tidy table.

    df = specjax.ablate(model, {"code": [...], "chat": [...]}, proposers=[specjax.NGram(k=4)],
                        ks=[2, 4, 8], samplings=[specjax.Sampling(), specjax.Sampling(temperature=0.7)],
                        seeds=[0, 1], max_new_tokens=64)

`ablate` returns a pandas DataFrame with one row per (proposer, k, sampling, seed, prompt category).
Plain decoding is always run too, once per (sampling, seed, category), so every row has a
`speedup` over the plain tokens/s measured in the same sweep (plain rows have speedup 1).
Seeds: every (configuration, seed) is its own row, with a `seed` column (key =
jax.random.key(seed), folded with the batch index for each batch); average over seeds with
`df.groupby(...)` when you want one number. At temperature 0 the seed changes nothing but the
timing noise, which is itself worth seeing.

Columns (K = the largest k in the sweep; per-position columns past a row's own k are NaN):

    category, proposer (a readable label without k), k (0 for plain), forced_acceptance (the
    synthetic acceptance rate of a ForcedAcceptance proposer, NaN otherwise), temperature, top_k,
    top_p, min_p, seed, num_prompts, max_new_tokens, batch_size, chat,
    tokens_per_second (emitted tokens / run time, compile excluded), speedup, acceptance_rate,
    mean_acceptance_length (1 + accepted / drafts, bonus included), tokens_per_target_forward,
    compile_time_s (seconds compiling during this row's calls: 0 when an earlier row had already
    compiled every program it needed), run_time_s, steps, num_drafts, num_draft_tokens,
    num_accepted_tokens, num_emitted_tokens, target_forwards,
    acceptance_1..K (unconditional: accepted at position i per draft),
    conditional_acceptance_1..K (per draft that reached position i, EAGLE's definition),
    expected_acceptance_1..K (analytic: mean of sum_v min(p, q) at position i),
    accept_hist_0..K (drafting steps that accepted 0..K drafts; steps without a draft are not counted),
    counterfactual_mean_acceptance_length_1..K (what k' <= k would have given, from this row's
    histogram: 1 + E[min(n, k')], exact in expectation for i.i.d. acceptance),
    counterfactual_continuation_mean_acceptance_length_1..K (the same assuming a matched run
    continues past a step boundary, as with prompt lookup; see
    SpecMetrics.counterfactual_mean_acceptance_length),
    specjax_version, jax_version, backend, device_count.

The metrics of a category's prompts (several batches) are combined by summing counters, never by
averaging rates. Each configuration's programs are compiled by a warm-up call before the timed one
(a call that compiled is run again and only the second is timed).

Sweep files (YAML or JSON, the `specjax ablate` command) are read by specjax/sweep.py.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from specjax.api import GenerateResult, generate
from specjax.checks import check_int, is_int
from specjax.models.model import Model
from specjax.speculate.metrics import SpecMetrics
from specjax.speculate.proposers import ForcedAcceptance
from specjax.speculate.sampling import Sampling

SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p")


# ---------------------------------------------------------------------------------------------
# Checking the arguments


def _check_prompts(prompts) -> dict[str, list]:
    """{category: prompts} from a list (category "all") or a dict of lists."""
    if isinstance(prompts, Mapping):
        categories = dict(prompts)
    elif isinstance(prompts, Sequence) and not isinstance(prompts, str | bytes):
        categories = {"all": list(prompts)}
    else:
        raise ValueError(
            f"prompts must be a list of prompts (category 'all') or a dict {{category: [prompts]}}, "
            f"got {type(prompts).__name__}"
        )
    if not categories:
        raise ValueError("prompts must not be empty: got an empty dict; give {category: [prompts]}")
    for category, rows in categories.items():
        if not isinstance(category, str):
            raise ValueError(
                f"prompts: category {category!r} is a {type(category).__name__}; categories must be str"
            )
        if isinstance(rows, str | bytes) or not isinstance(rows, Sequence) or len(rows) == 0:
            raise ValueError(
                f"prompts[{category!r}] must be a non-empty list of prompts, got {type(rows).__name__} "
                f"{rows!r:.60}"
            )
        categories[category] = list(rows)
    return categories


def _check_samplings(samplings) -> list[Sampling]:
    if samplings is None:
        return [Sampling()]
    if isinstance(samplings, Sampling):
        return [samplings]
    if isinstance(samplings, str) or not isinstance(samplings, Sequence) or len(samplings) == 0:
        raise ValueError(f"samplings must be a non-empty list of specjax.Sampling, got {samplings!r}")
    for i, sampling in enumerate(samplings):
        if not isinstance(sampling, Sampling):
            raise ValueError(
                f"samplings[{i}] must be a specjax.Sampling (e.g. Sampling(temperature=0.7)), "
                f"got {type(sampling).__name__} {sampling!r}"
            )
    return list(samplings)


def _check_int_list(name: str, values, minimum: int, what: str) -> list[int]:
    if isinstance(values, str) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty list of {what}, got {values!r}")
    for i, value in enumerate(values):
        if not is_int(value) or value < minimum:
            raise ValueError(f"{name}[{i}] must be {what}, got {value!r}")
    return [int(v) for v in values]


# ---------------------------------------------------------------------------------------------
# Proposers: labels, descriptions, k


def _field_text(name: str, value) -> str | None:
    """`name=value` for a label, or None to leave the field out."""
    if value is None or isinstance(value, bool | int | float | str):
        return f"{name}={value!r}"
    if isinstance(value, Model):
        return f"{name}={value.name}"
    if dataclasses.is_dataclass(value) and (hasattr(value, "spec") or hasattr(value, "propose")):
        return f"{name}={proposer_label(value)}"  # a wrapped proposer (ForcedAcceptance, Dynamic)
    nodes = getattr(value, "num_nodes", None)
    if nodes is not None:  # a TokenTree
        return f"{name}=<{nodes() if callable(nodes) else nodes} nodes>"
    if isinstance(value, tuple) and len(repr(value)) > 40:  # a long list of tree paths
        return f"{name}=<{len(value)} paths>"
    if isinstance(value, tuple):
        return f"{name}={value!r}"
    return f"{name}={type(value).__name__}"


def proposer_label(proposer) -> str:
    """A readable label without k (its own column): "plain", "NGram(n_max=4, n_min=1)", ...
    A ForcedAcceptance's rate is left out too (the `forced_acceptance` column holds it)."""
    if proposer is None:
        return "plain"
    if not dataclasses.is_dataclass(proposer):
        return type(proposer).__name__
    parts = []
    for field in dataclasses.fields(proposer):
        if (
            not field.repr
            or field.name == "k"
            or (field.name == "acceptance" and _forced_rate(proposer) is not None)
        ):
            continue
        text = _field_text(field.name, getattr(proposer, field.name))
        if text is not None:
            parts.append(text)
    return f"{type(proposer).__name__}({', '.join(parts)})"


def _forced_rate(proposer) -> float | None:
    """A ForcedAcceptance's one rate for every position; None for other proposers, or for one
    with a rate per position (its label then lists them)."""
    if not isinstance(proposer, ForcedAcceptance):
        return None
    rates = tuple(np.atleast_1d(proposer.acceptance).tolist())
    return float(rates[0]) if len(set(rates)) == 1 else None


def _forced_acceptance(proposer) -> float:
    rate = _forced_rate(proposer)
    return math.nan if rate is None else rate


def _resolve_proposers(proposers, model: Model) -> list[tuple[str | None, Any]]:
    """(label or None, proposer) pairs from a list of proposers / descriptions or a dict
    {label: proposer or description}. Plain decoding (None, "plain") is dropped: it always runs."""
    if isinstance(proposers, Mapping):
        items = [(str(label), p) for label, p in proposers.items()]
    elif isinstance(proposers, Sequence) and not isinstance(proposers, str | bytes):
        items = [(None, p) for p in proposers]
    else:
        raise ValueError(
            f"proposers must be a list of proposers or descriptions (e.g. [specjax.NGram(k=4), "
            f"{{'name': 'ngram', 'k': 4}}]) or a dict {{label: proposer}}, got {proposers!r:.80}"
        )
    if not items:
        raise ValueError(
            "proposers must not be empty: give at least one proposer (None or 'plain' for plain "
            "decoding alone)"
        )
    resolved = []
    for i, (label, p) in enumerate(items):
        if isinstance(p, dict | str):
            from specjax.named import proposer_from_description

            p = proposer_from_description(p, model, where=f"proposers[{i}]")
        if p is not None:
            resolved.append((label, p))
    return resolved


def _apply_ks(configs: list[tuple[str | None, Any]], ks) -> list[tuple[str | None, Any]]:
    """Every proposer at each k of `ks` (None: as given)."""
    if ks is None:
        return configs
    ks = _check_int_list("ks", ks, 1, "an integer k >= 1")
    from specjax.speculate.proposers import with_k

    out = []
    for i, (label, p) in enumerate(configs):
        for k in ks:
            try:
                out.append((label, with_k(p, k)))
            except ValueError as error:
                raise ValueError(f"ks: proposers[{i}] ({proposer_label(p)}): {error}") from error
    return out


# ---------------------------------------------------------------------------------------------
# Running one cell of the grid


def combine_metrics(parts: Sequence[SpecMetrics]) -> SpecMetrics:
    """One SpecMetrics over several calls of the same configuration: the per-row counters are
    concatenated (so the summary sums them, which is correct for every rate), times added."""
    first = parts[0]
    arrays = {
        f.name: np.concatenate([getattr(m, f.name) for m in parts])
        for f in dataclasses.fields(SpecMetrics)
        if isinstance(getattr(first, f.name), np.ndarray)
    }
    return SpecMetrics(
        num_speculative_tokens=first.num_speculative_tokens,
        compile_time_s=sum(m.compile_time_s for m in parts),
        run_time_s=sum(m.run_time_s for m in parts),
        **arrays,
    )


def _timed_generate(run) -> SpecMetrics:
    """The metrics of a warm call: a call that compiled is run again and only the second timed;
    the compile time of the first is kept."""
    metrics = run().metrics
    if metrics.compile_time_s > 0:
        compile_time = metrics.compile_time_s
        metrics = run().metrics
        metrics.compile_time_s = compile_time
    return metrics


def _run_cell(model, prompts, proposer, sampling, seed, max_new_tokens, chat, batch_size, bar) -> SpecMetrics:
    """The combined metrics of `prompts` in batches of `batch_size`."""
    parts = []
    for index, start in enumerate(range(0, len(prompts), batch_size)):
        key = jax.random.fold_in(jax.random.key(seed), index)
        batch = prompts[start : start + batch_size]

        def run(batch=batch, key=key):
            return generate(
                model,
                batch,
                proposer=proposer,
                sampling=sampling,
                max_new_tokens=max_new_tokens,
                key=key,
                chat=chat,
            )

        parts.append(_timed_generate(run))
        bar.update(1)
    return combine_metrics(parts)


# ---------------------------------------------------------------------------------------------
# Rows


def _metric_row(metrics: SpecMetrics) -> dict:
    """The metric columns of one row; per-position values as lists (padded to K later)."""
    s = metrics.summary()
    k = metrics.num_speculative_tokens
    return {
        "k": k,
        "tokens_per_second": s["tokens_per_second"],
        "acceptance_rate": s["acceptance_rate"],
        "mean_acceptance_length": s["mean_acceptance_length"],
        "tokens_per_target_forward": s["tokens_per_target_forward"],
        "compile_time_s": s["compile_time_s"],
        "run_time_s": s["run_time_s"],
        "steps": s["steps"],
        "num_drafts": s["num_drafts"],
        "num_draft_tokens": s["num_draft_tokens"],
        "num_accepted_tokens": s["num_accepted_tokens"],
        "num_emitted_tokens": s["num_emitted_tokens"],
        "target_forwards": s["target_forwards"],
        "acceptance": s["acceptance_per_position"],
        "conditional_acceptance": s["conditional_acceptance_per_position"],
        "expected_acceptance": s["expected_acceptance_per_position"],
        "accept_hist": s["acceptance_length_histogram"],
        "counterfactual_mean_acceptance_length": [
            metrics.counterfactual_mean_acceptance_length(j) for j in range(1, k + 1)
        ],
        "counterfactual_continuation_mean_acceptance_length": [
            metrics.counterfactual_mean_acceptance_length(j, continuation=True) for j in range(1, k + 1)
        ],
    }


PER_POSITION = (  # (column prefix, first index)
    ("acceptance", 1),
    ("conditional_acceptance", 1),
    ("expected_acceptance", 1),
    ("accept_hist", 0),
    ("counterfactual_mean_acceptance_length", 1),
    ("counterfactual_continuation_mean_acceptance_length", 1),
)


def _environment() -> dict:
    import specjax

    return {
        "specjax_version": specjax.__version__,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
    }


def _table(rows: list[dict]):
    """The DataFrame, each per-position list spread over columns `<prefix>_<i>` up to the
    sweep's K (NaN past a row's own k), then the environment columns last."""
    import pandas as pd

    K = max(row["k"] for row in rows)
    environment = _environment()
    flat = []
    for row in rows:
        out = {name: value for name, value in row.items() if name not in dict(PER_POSITION)}
        for prefix, first in PER_POSITION:
            values = row[prefix]
            for i in range(first, K + 1):
                j = i - first
                out[f"{prefix}_{i}"] = float(values[j]) if j < len(values) else math.nan
        flat.append(out | environment)
    return pd.DataFrame(flat)


def ablate(
    model: Model,
    prompts: Sequence | Mapping[str, Sequence],
    proposers: Sequence | Mapping[str, Any] = (),
    ks: Sequence[int] | None = None,
    samplings: Sequence[Sampling] | None = None,
    seeds: Sequence[int] = (0,),
    max_new_tokens: int = 128,
    chat: bool = True,
    batch_size: int = 1,
    progress: bool = True,
):
    """Run the grid proposers x ks x samplings x seeds x prompt categories; see the module
    docstring for the columns. Returns a pandas DataFrame, one row per (configuration, category),
    plain decoding included (proposer "plain", k 0).

    proposers: proposer objects, descriptions ({"name": "ngram", "k": 4}, see
      specjax.named) or None (plain), or a dict {label: proposer} to name them.
    ks: optional; each proposer at each k (a proposer whose k is fixed, e.g. a Medusa head, fails).
    """
    if not isinstance(model, Model):
        raise ValueError(f"model must be a specjax.Model (from specjax.load), got {type(model).__name__}")
    categories = _check_prompts(prompts)
    configs = _apply_ks(_resolve_proposers(proposers, model), ks)
    samplings = _check_samplings(samplings)
    seeds = _check_int_list("seeds", seeds, -(2**63), "an integer seed")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    if not isinstance(chat, bool):
        raise ValueError(f"chat must be True or False, got {chat!r}")

    from tqdm import tqdm

    batches = sum(-(-len(rows) // batch_size) for rows in categories.values())
    total = (len(configs) + 1) * len(samplings) * len(seeds) * batches
    # The programs of a group (configuration, sampling's static part, category) are finished after
    # its last cell, once every group that used them is: they become the first the program cache
    # drops when it reaches its budget (specjax.set_program_cache), before programs still ahead.
    from specjax import programs
    from specjax.speculate.sampling import WarpSpec

    entries = [(None, None), *configs]
    remaining: dict[tuple, int] = {}  # group -> cells still to run
    for sampling in samplings:
        for category in categories:
            for index in range(len(entries)):
                group = (index, WarpSpec.of(sampling), category)
                remaining[group] = remaining.get(group, 0) + len(seeds)
    users: dict[tuple, set] = {}  # program key -> the groups that used it
    rows = []
    with tqdm(total=total, desc="ablate", file=sys.stderr, disable=not progress, leave=False) as bar:
        for sampling in samplings:
            for seed in seeds:
                for category, texts in categories.items():
                    common = {
                        "category": category,
                        **{name: getattr(sampling, name) for name in SAMPLING_COLUMNS},
                        "seed": seed,
                        "num_prompts": len(texts),
                        "max_new_tokens": max_new_tokens,
                        "batch_size": batch_size,
                        "chat": chat,
                    }
                    plain_speed = None
                    for index, (label, proposer) in enumerate(entries):
                        name = label or proposer_label(proposer)
                        bar.set_postfix_str(f"{category} {name} t={sampling.temperature} seed={seed}")
                        with programs.programs_used() as used:
                            metrics = _run_cell(
                                model, texts, proposer, sampling, seed, max_new_tokens, chat, batch_size, bar
                            )
                        group = (index, WarpSpec.of(sampling), category)
                        for key in used:
                            users.setdefault(key, set()).add(group)
                        remaining[group] -= 1
                        if remaining[group] == 0:
                            programs.retire_programs(
                                [k for k, groups in users.items() if all(remaining[g] == 0 for g in groups)]
                            )
                        row = _metric_row(metrics)
                        if proposer is None:  # runs first: the baseline of this cell's speedups
                            plain_speed = row["tokens_per_second"]
                        ident = {"proposer": name, "forced_acceptance": _forced_acceptance(proposer)}
                        rows.append(
                            common | ident | row | {"speedup": row["tokens_per_second"] / plain_speed}
                        )
    return _ordered(_table(rows))


def _ordered(df):
    """Identifying columns first, then the measurements, in a fixed order."""
    first = ["category", "proposer", "k", "forced_acceptance", *SAMPLING_COLUMNS, "seed", "num_prompts"]
    first += ["max_new_tokens", "batch_size", "chat", "tokens_per_second", "speedup"]
    return df[first + [c for c in df.columns if c not in first]]


# ---------------------------------------------------------------------------------------------
# Counterfactual k


GROUP_COLUMNS = ("category", "proposer", "forced_acceptance", *SAMPLING_COLUMNS, "seed")


def counterfactual(source):
    """Mean acceptance length at each k' = 1..K from one run at K (see
    SpecMetrics.counterfactual_mean_acceptance_length), as a small DataFrame.

    source: a SpecMetrics or GenerateResult -> columns k, counterfactual_mean_acceptance_length
      (i.i.d. acceptance), counterfactual_continuation_mean_acceptance_length (matched runs
      continue across steps), measured_mean_acceptance_length (the run's own value, at k = K only).
    source: an `ablate` DataFrame -> the same columns plus GROUP_COLUMNS, from the row with the
      largest k of each group; measured_mean_acceptance_length holds the group's real runs at
      smaller k where the sweep had them (NaN elsewhere), so the two compare side by side.
    """
    import pandas as pd

    if isinstance(source, GenerateResult):
        source = source.metrics
    if isinstance(source, SpecMetrics):
        K = source.num_speculative_tokens
        if K < 1:
            raise ValueError("counterfactual: the run decoded plainly (k=0); it needs a speculative run")
        return pd.DataFrame(
            {
                "k": list(range(1, K + 1)),
                "counterfactual_mean_acceptance_length": [
                    source.counterfactual_mean_acceptance_length(j) for j in range(1, K + 1)
                ],
                "counterfactual_continuation_mean_acceptance_length": [
                    source.counterfactual_mean_acceptance_length(j, continuation=True)
                    for j in range(1, K + 1)
                ],
                "measured_mean_acceptance_length": [math.nan] * (K - 1) + [source.mean_acceptance_length],
            }
        )
    if isinstance(source, pd.DataFrame):
        return _counterfactual_table(source)
    raise ValueError(
        f"counterfactual: source must be a SpecMetrics, GenerateResult or an ablate DataFrame, "
        f"got {type(source).__name__}"
    )


def _counterfactual_table(df):
    import pandas as pd

    missing = [c for c in (*GROUP_COLUMNS, "k", "mean_acceptance_length") if c not in df.columns]
    if missing:
        raise ValueError(f"counterfactual: the DataFrame lacks column {missing[0]!r}; pass an ablate table")
    rows = []
    speculative = df[df["k"] > 0]
    for _, group in speculative.groupby(list(GROUP_COLUMNS), dropna=False, sort=False):
        widest = group.loc[group["k"].idxmax()]
        measured = dict(zip(group["k"], group["mean_acceptance_length"], strict=True))
        for j in range(1, int(widest["k"]) + 1):
            rows.append(
                {c: widest[c] for c in GROUP_COLUMNS}
                | {
                    "run_k": int(widest["k"]),
                    "k": j,
                    "counterfactual_mean_acceptance_length": widest[
                        f"counterfactual_mean_acceptance_length_{j}"
                    ],
                    "counterfactual_continuation_mean_acceptance_length": widest[
                        f"counterfactual_continuation_mean_acceptance_length_{j}"
                    ],
                    "measured_mean_acceptance_length": measured.get(j, math.nan),
                }
            )
    if not rows:
        raise ValueError("counterfactual: the table has no speculative rows (k >= 1)")
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Saving


def _format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError(
                f"path {str(path)!r}: the suffix '.parquet' needs pyarrow, which is not installed "
                "(pip install pyarrow), or use '.csv'"
            ) from None
        return "parquet"
    raise ValueError(f"path {str(path)!r}: unknown suffix {suffix!r}; allowed: '.csv', '.parquet'")


def save_ablation(df, path: str | Path) -> Path:
    """Write an ablate table as CSV or parquet, by the path's suffix; returns the path."""
    path = Path(path)
    kind = _format(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "csv":
        df.to_csv(path, index=False)
    else:
        df.to_parquet(path, index=False)
    return path


def load_ablation(path: str | Path):
    """Read a table written by save_ablation (floats read back exactly)."""
    import pandas as pd

    path = Path(path)
    kind = _format(path)
    if not path.is_file():
        raise ValueError(f"path {str(path)!r}: no such file")
    if kind == "csv":
        # pandas 3 reads floats back exactly by default (and deprecates the option); 2.x needs it.
        exact = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}
        return pd.read_csv(path, **exact)
    return pd.read_parquet(path)
