"""Figures of an ablation table (specjax.ablate): each function takes the DataFrame and returns a
matplotlib Figure.

Figures are built on `matplotlib.figure.Figure` directly, not pyplot: no global figure state and
no GUI backend needed (`fig.savefig` works anywhere; in a notebook the Figure displays itself).
Values are averaged over the rows a line does not tell apart (categories, seeds, and temperatures
where the figure does not split by them); a line per proposer and k, per temperature when the
table has several.
"""

from __future__ import annotations

from pathlib import Path

METRICS = ("mean_acceptance_length", "speedup", "acceptance_rate", "tokens_per_second")


def _figure(title: str, xlabel: str, ylabel: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _speculative(df, what: str):
    rows = df[df["k"] > 0]
    if rows.empty:
        raise ValueError(f"{what}: the table has no speculative rows (k >= 1), only plain decoding")
    return rows


def _keys(df, base: list[str]) -> list[str]:
    """The grouping columns of the lines: `base`, plus temperature where the table has several."""
    return base + (["temperature"] if "temperature" not in base and df["temperature"].nunique() > 1 else [])


def _label(keys: list[str], values) -> str:
    values = values if isinstance(values, tuple) else (values,)
    parts = []
    for key, value in zip(keys, values, strict=True):
        parts.append(str(value) if key == "proposer" else f"{key}={value:g}" if key != "category" else value)
    return ", ".join(parts)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def acceptance_curves(df):
    """Conditional acceptance at each draft position (accepted / reached, EAGLE's definition),
    one line per proposer and k: where along the draft a proposer loses the target."""
    rows = _speculative(df, "acceptance_curves")
    fig, ax = _figure("Conditional acceptance per draft position", "draft position", "acceptance")
    keys = _keys(rows, ["proposer", "k"])
    for values, group in rows.groupby(keys, sort=True):
        k = int(group["k"].iloc[0])
        columns = [f"conditional_acceptance_{i}" for i in range(1, k + 1)]
        ax.plot(
            range(1, k + 1),
            group[columns].mean().to_numpy(),  # NaN where no draft reached a position
            marker="o",
            label=_label(keys, values),
        )
    ax.set_ylim(0, 1.02)
    _legend(ax)
    return fig


def speedup_vs_k(df):
    """Speedup over plain decoding against k, one line per proposer: the k that pays best."""
    rows = _speculative(df, "speedup_vs_k")
    fig, ax = _figure("Speedup over plain decoding", "k (speculative tokens)", "speedup")
    keys = _keys(rows, ["proposer"])
    for values, group in rows.groupby(keys, sort=True):
        mean = group.groupby("k")["speedup"].mean()
        ax.plot(mean.index, mean.to_numpy(), marker="o", label=_label(keys, values))
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    _legend(ax)
    return fig


def temperature_effect(df, metric: str = "mean_acceptance_length"):
    """`metric` (one of METRICS) against temperature, one line per proposer and k."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    rows = _speculative(df, "temperature_effect")
    fig, ax = _figure(
        f"{metric.replace('_', ' ')} against temperature", "temperature", metric.replace("_", " ")
    )
    keys = ["proposer", "k"]
    for values, group in rows.groupby(keys, sort=True):
        mean = group.groupby("temperature")[metric].mean()
        ax.plot(mean.index, mean.to_numpy(), marker="o", label=_label(keys, values))
    _legend(ax)
    return fig


def counterfactual_k(source):
    """Counterfactual mean acceptance length against k from each group's run at its largest k:
    solid for i.i.d. acceptance, dashed assuming matched runs continue across steps (prompt
    lookup); markers for the real runs at each k. `source` is an ablate table or a table from
    specjax.ablation.counterfactual."""
    from specjax.ablation import counterfactual

    table = source if "counterfactual_mean_acceptance_length" in source.columns else counterfactual(source)
    fig, ax = _figure("Counterfactual k (lines) and real runs (markers)", "k", "mean acceptance length")
    keys = [
        c for c in ("proposer", "category", "temperature") if c in table.columns and table[c].nunique() > 1
    ]
    groups = table.groupby(keys, sort=True) if keys else [((), table)]
    columns = [
        "counterfactual_mean_acceptance_length",
        "counterfactual_continuation_mean_acceptance_length",
        "measured_mean_acceptance_length",
    ]
    for values, group in groups:
        label = _label(keys, values) if keys else "counterfactual"
        mean = group.groupby("k")[[c for c in columns if c in group.columns]].mean()
        (line,) = ax.plot(mean.index, mean[columns[0]].to_numpy(), label=label)
        if columns[1] in mean.columns:
            ax.plot(mean.index, mean[columns[1]].to_numpy(), "--", color=line.get_color())
        ax.plot(mean.index, mean[columns[2]].to_numpy(), "o", color=line.get_color())
    _legend(ax)
    return fig


def forced_acceptance_overhead(df):
    """Tokens/s against the forced acceptance rate of ForcedAcceptance rows, one line per proposer
    and k, with plain decoding's tokens/s dashed: the loop's overhead at a known acceptance."""
    if "forced_acceptance" not in df.columns or df["forced_acceptance"].isna().all():
        raise ValueError("forced_acceptance_overhead: the table has no ForcedAcceptance rows")
    rows = df[df["forced_acceptance"].notna()]
    fig, ax = _figure("Speed at a forced acceptance rate", "forced acceptance rate", "tokens / s")
    keys = _keys(rows, ["proposer", "k"])
    for values, group in rows.groupby(keys, sort=True):
        mean = group.groupby("forced_acceptance")["tokens_per_second"].mean()
        ax.plot(mean.index, mean.to_numpy(), marker="o", label=_label(keys, values))
    plain = df.loc[df["k"] == 0, "tokens_per_second"]
    if not plain.empty:
        ax.axhline(plain.mean(), color="gray", linestyle="--", linewidth=1, label="plain")
    _legend(ax)
    return fig


FIGURES = {
    "acceptance_curves": acceptance_curves,
    "speedup_vs_k": speedup_vs_k,
    "temperature_effect": temperature_effect,
    "counterfactual_k": counterfactual_k,
    "forced_acceptance_overhead": forced_acceptance_overhead,
}


def save_figures(df, out_dir: str | Path, dpi: int = 120) -> list[Path]:
    """Write every figure the table has data for as `<name>.png` in out_dir; returns the paths.
    A figure without data (no ForcedAcceptance rows, only plain decoding) is skipped."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in FIGURES.items():
        try:
            fig = make(df)
        except ValueError:
            continue
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        written.append(path)
    return written
