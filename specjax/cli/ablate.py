"""`specjax ablate`: a sweep from a spec file."""

from __future__ import annotations

import argparse
from pathlib import Path

ABLATE_HELP = """Run an ablation sweep from a YAML or JSON spec (see specjax.ablation): every
combination of its proposers and settings on its prompts, with specjax.ablate.

    specjax ablate sweeps/k.yaml --out results/k

Writes the table to DIR/ablation.csv and the figures to DIR/*.png, then prints where they went
and the table's main columns (speed, speedup and acceptance of each configuration).
"""


# The columns of the table printed after a sweep (all of them are in ablation.csv).
ABLATE_SUMMARY_COLUMNS = (
    "category",
    "proposer",
    "k",
    "temperature",
    "seed",
    "tokens_per_second",
    "speedup",
    "acceptance_rate",
    "mean_acceptance_length",
)


def ablate_command(args: argparse.Namespace) -> None:
    spec = Path(args.spec)
    if not spec.is_file():
        raise ValueError(f"no such file {args.spec!r} (a YAML or JSON sweep spec)")
    if spec.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise ValueError(f"{args.spec!r}: a sweep spec is a .yaml, .yml or .json file")
    try:
        from specjax.sweep import run_sweep_file
    except ImportError as error:
        raise ValueError(
            f"ablation sweeps are not available here ({error}); they need pandas and matplotlib"
        ) from None
    out = Path(args.out)
    frame = run_sweep_file(spec, out, progress=True)
    figures = sorted(out.glob("*.png"))
    print(f"table: {out / 'ablation.csv'} ({len(frame)} rows)")
    print(f"figures: {', '.join(str(f) for f in figures) or 'none'}")
    summary = [c for c in ABLATE_SUMMARY_COLUMNS if c in frame.columns]
    print(frame[summary].to_string(max_rows=20, float_format=lambda x: f"{x:.3g}"))


def add_ablate_command(commands) -> None:
    command = commands.add_parser(
        "ablate",
        help="run an ablation sweep from a YAML or JSON spec; write its table and figures",
        description=ABLATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("spec", metavar="SPEC", help="the sweep spec, a .yaml or .json file")
    command.add_argument(
        "--out", required=True, metavar="DIR", help="folder for ablation.csv and the figures"
    )
    command.set_defaults(run=ablate_command)
