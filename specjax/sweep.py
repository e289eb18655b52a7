"""Sweep files: an ablation grid described in YAML or JSON, run by `specjax.ablate`.

`run_sweep_file` (and the `specjax ablate` command) reads:

    model: smollm2-135m             # a built-in name, an HF folder or a .gguf file
    prompts:                        # {category: [prompt, ...]}, a list (category "all"), or a file:
      file: questions.jsonl         #   JSON lines, relative to the sweep file's folder
      field: turns                  #   the prompt field (a list takes its first element)
      category_field: category      #   optional; without it (or a missing key) the category is "all"
      per_category: 2               #   optional: the first N prompts of each category
      limit: 40                     #   optional: the first N records of the file
    proposers:                      # descriptions, see specjax.named
      - {name: ngram, k: 4}
      - {name: self_draft, layers: 8}
    ks: [2, 4]                      # optional: every proposer at each k
    samplings:                      # optional (default greedy); specjax.Sampling's fields
      - {temperature: 0.0}
      - {temperature: 0.7, top_p: 0.9}
    seeds: [0]                      # optional (default [0])
    max_new_tokens: 64              # optional (default 128)
    chat: true                      # optional (default true)
    batch_size: 1                   # optional (default 1)

`run_sweep_file` writes `ablation.csv` and the figures of specjax.plots (PNG) into the output folder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specjax.ablation import ablate, save_ablation
from specjax.checks import is_int
from specjax.models.model import Model
from specjax.speculate.sampling import Sampling

SWEEP_KEYS = (
    "model",
    "prompts",
    "proposers",
    "ks",
    "samplings",
    "seeds",
    "max_new_tokens",
    "chat",
    "batch_size",
)
PROMPT_FILE_KEYS = ("file", "field", "category_field", "per_category", "limit")


def _read_spec(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"sweep file {str(path)!r}: no such file")
    text = path.read_text()
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            spec = yaml.safe_load(text)
        elif path.suffix.lower() == ".json":
            spec = json.loads(text)
        else:
            raise ValueError(
                f"sweep file {str(path)!r}: unknown suffix {path.suffix!r}; allowed: .yaml, .yml, .json"
            )
    except (json.JSONDecodeError, ImportError) as error:
        raise ValueError(f"sweep file {str(path)!r}: cannot parse it: {error}") from None
    except Exception as error:  # yaml.YAMLError, without importing yaml at module level
        if type(error).__module__.startswith("yaml"):
            raise ValueError(
                f"sweep file {str(path)!r}: cannot parse it: {error}".replace("\n", " ")
            ) from None
        raise
    if not isinstance(spec, dict):
        raise ValueError(
            f"sweep file {str(path)!r}: the top level must be a mapping, got {type(spec).__name__}"
        )
    unknown = sorted(set(spec) - set(SWEEP_KEYS))
    if unknown:
        raise ValueError(
            f"sweep file {str(path)!r}: unknown key {unknown[0]!r}; allowed: {', '.join(SWEEP_KEYS)}"
        )
    for key in ("model", "prompts", "proposers"):
        if key not in spec:
            raise ValueError(f"sweep file {str(path)!r}: missing key {key!r}")
    return spec


def _prompt_file(options: dict, folder: Path) -> dict[str, list]:
    """{category: prompts} from a JSON-lines file (see the module docstring)."""
    unknown = sorted(set(options) - set(PROMPT_FILE_KEYS))
    if unknown:
        raise ValueError(f"prompts: unknown key {unknown[0]!r}; allowed: {', '.join(PROMPT_FILE_KEYS)}")
    if "field" not in options:
        raise ValueError("prompts: a prompt file needs 'field' (the record field holding the prompt)")
    file = folder / options["file"]
    if not file.is_file():
        raise ValueError(f"prompts.file {str(file)!r}: no such file")
    limit, per_category = options.get("limit"), options.get("per_category")
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and (not is_int(value) or value < 1):
            raise ValueError(f"prompts.{name} must be an integer >= 1, got {value!r}")
    records = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    categories: dict[str, list] = {}
    for i, record in enumerate(records[:limit]):
        if options["field"] not in record:
            raise ValueError(f"prompts.file {str(file)!r}: record {i} has no field {options['field']!r}")
        prompt = record[options["field"]]
        if isinstance(prompt, list):  # e.g. Spec-Bench's "turns": the first turn
            prompt = prompt[0]
        category = str(record.get(options.get("category_field") or "", "all"))
        categories.setdefault(category, []).append(prompt)
    if per_category is not None:
        categories = {c: rows[:per_category] for c, rows in categories.items()}
    if not categories:
        raise ValueError(f"prompts.file {str(file)!r}: no records")
    return categories


def _sweep_samplings(values) -> list[Sampling]:
    if values is None:
        return [Sampling()]
    if not isinstance(values, list) or not values:
        raise ValueError(
            f"samplings must be a non-empty list of mappings like {{temperature: 0.7}}, got {values!r}"
        )
    out = []
    for i, value in enumerate(values):
        if not isinstance(value, dict):
            raise ValueError(f"samplings[{i}] must be a mapping like {{temperature: 0.7}}, got {value!r}")
        try:
            out.append(Sampling(**value))
        except TypeError as error:  # an unknown field
            fields = ", ".join(f.name for f in dataclasses.fields(Sampling))
            raise ValueError(f"samplings[{i}]: {error}; allowed fields: {fields}") from None
        except ValueError as error:
            raise ValueError(f"samplings[{i}]: {error}") from None
    return out


def run_sweep_file(path: str | Path, out_dir: str | Path, progress: bool = True, model: Model | None = None):
    """Run the sweep a YAML or JSON file describes (format in the module docstring), write
    `out_dir/ablation.csv` and the figures as PNGs, and return the table. `model` overrides the
    file's model (tests pass a tiny one). Bad specs raise ValueError with one line."""
    import specjax
    from specjax import plots

    path = Path(path)
    spec = _read_spec(path)
    prompts = spec["prompts"]
    if isinstance(prompts, dict) and "file" in prompts:
        prompts = _prompt_file(prompts, path.parent)
    samplings = _sweep_samplings(spec.get("samplings"))
    if model is None:
        if not isinstance(spec["model"], str):
            raise ValueError(f"model must be a built-in name or a path, got {spec['model']!r}")
        model = specjax.load(spec["model"])
    df = ablate(
        model,
        prompts,
        proposers=spec["proposers"],
        ks=spec.get("ks"),
        samplings=samplings,
        seeds=spec.get("seeds", [0]),
        max_new_tokens=spec.get("max_new_tokens", 128),
        chat=spec.get("chat", True),
        batch_size=spec.get("batch_size", 1),
        progress=progress,
    )
    out_dir = Path(out_dir)
    save_ablation(df, out_dir / "ablation.csv")
    plots.save_figures(df, out_dir)
    return df
