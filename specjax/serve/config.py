"""`specjax serve --speculative-config JSON`: the speculative-decoding config of vLLM and FastDeploy,
mapped onto specjax's proposers.

Both servers take one JSON object whose "method" names the drafting method and whose other keys
configure it. The keys read here are those the two share, so a config written for either server
starts specjax with the matching proposer:

    method                  ngram | draft_model | eagle | eagle3 | medusa | dflash | mlp_speculator |
                            mtp, or
                            specjax's own: self_draft | specjax (any proposer, see below)
    num_speculative_tokens  k, the drafts per step (default: the proposer's own default)
    model                   draft_model: a model (a built-in name, an HF folder or a .gguf file);
                            eagle, eagle3, medusa, dflash, mlp_speculator: the folder of a head
                            (`specjax.load_head`: specjax's own or a published release)
    prompt_lookup_max       ngram: the longest n-gram matched (NGram n_max)
    prompt_lookup_min       ngram: the shortest n-gram matched (NGram n_min)
    layers                  self_draft: the target's layers that draft (SelfDraft layers)
    proposer                specjax: a proposer description of `specjax.named` (e.g. {"name":
                            "hybrid", "first": "ngram", "then": {...}}), for what the flat keys cannot
                            say (Hybrid, Dynamic, token trees, confidence thresholds)

Without "method", a config with a "model" is a draft model, as vLLM reads it. Any other key, or a
key the method does not use, is an error: a key silently ignored would serve another proposer than
the one asked for.
"""

from __future__ import annotations

from typing import Any

from specjax.models import Model, load, load_head
from specjax.named import proposer_from_description
from specjax.speculate.proposers import (
    MAX_SPECULATIVE_TOKENS,
    MTP,
    DFlash,
    DraftModel,
    Eagle,
    Eagle3,
    Medusa,
    MLPSpeculator,
    NGram,
    SelfDraft,
    WithNGram,
)
from specjax.speculate.tree import TokenTree

WHERE = "speculative_config"

# method -> the keys it reads besides "method"
METHOD_KEYS: dict[str, tuple[str, ...]] = {
    "ngram": ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
    "draft_model": ("model", "num_speculative_tokens"),
    "eagle": ("model", "num_speculative_tokens"),
    "eagle3": ("model", "num_speculative_tokens"),
    "medusa": ("model", "num_speculative_tokens"),
    "dflash": ("model", "num_speculative_tokens"),
    "mlp_speculator": ("model", "num_speculative_tokens"),
    "mtp": ("num_speculative_tokens", "num_model_steps", "mtp_strategy"),
    "self_draft": ("layers", "num_speculative_tokens"),
    "specjax": ("proposer",),
}
HEAD_METHODS = {
    "eagle": Eagle,
    "eagle3": Eagle3,
    "medusa": Medusa,
    "dflash": DFlash,
    "mlp_speculator": MLPSpeculator,
}


def _keys(config: dict, method: str) -> dict:
    """The config's keys besides "method", refusing one the method does not read."""
    options = {key: value for key, value in config.items() if key != "method"}
    allowed = METHOD_KEYS[method]
    for key in options:
        if key not in allowed:
            raise ValueError(
                f"{WHERE}: unknown key {key!r} for method {method!r}; allowed: method, {', '.join(allowed)}"
            )
    return options


def _required(options: dict, key: str, method: str, what: str) -> Any:
    if key not in options:
        raise ValueError(f"{WHERE}: method {method!r} needs {key!r} ({what})")
    return options[key]


def _int(options: dict, key: str, low: int, high: int | None = None) -> int | None:
    """options[key] checked to be an integer in [low, high] (None when absent)."""
    value = options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
        raise ValueError(f"{WHERE}: {key!r} must be {allowed}, got {value!r}")
    return value


def _k(options: dict) -> dict:
    """{"k": num_speculative_tokens} when given, else {} (the proposer's own default k)."""
    k = _int(options, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    return {} if k is None else {"k": k}


def _head_proposer(method: str, options: dict, target: Model):
    path = _required(options, "model", method, "the folder of a saved or published head")
    if not isinstance(path, str):
        raise ValueError(f"{WHERE}: 'model' must be a path (a string), got {path!r}")
    head = load_head(path, target)
    k = _k(options).get("k")
    if method == "medusa":  # one draft per head: k takes the first k heads as a chain
        if k is None:
            return Medusa(head)
        if k > head.config.num_heads:
            raise ValueError(
                f"{WHERE}: 'num_speculative_tokens' of this Medusa head must be in "
                f"1..{head.config.num_heads} (one draft per head), got {k}"
            )
        return Medusa(head, tree=TokenTree.chain(k))
    if method == "dflash":  # one forward drafts a block: the anchor and k drafts
        return DFlash(head) if k is None else DFlash(head, block=k + 1)
    return HEAD_METHODS[method](head, **_k(options))


def speculative_config_to_proposer(config: dict | None, target: Model):
    """The specjax proposer a vLLM / FastDeploy `--speculative-config` object asks for (None for
    None or {}: plain decoding). `target` is the served model: a draft model is loaded in its
    dtype, and a head is checked against it. Errors are ValueErrors naming the key, the value and
    what is allowed."""
    if config is None or config == {}:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"{WHERE} must be a JSON object, got {config!r}")
    method = config.get("method", "draft_model" if "model" in config else None)
    if method is None:
        raise ValueError(f"{WHERE} needs 'method' (one of {', '.join(METHOD_KEYS)})")
    if method not in METHOD_KEYS:
        raise ValueError(f"{WHERE}: unknown method {method!r}; allowed: {', '.join(METHOD_KEYS)}")
    options = _keys(config, method)
    if method == "ngram":
        lookup = {"n_max": "prompt_lookup_max", "n_min": "prompt_lookup_min"}
        sizes = {name: _int(options, key, 1) for name, key in lookup.items() if key in options}
        k = _k(options)
        if sizes.get("n_min", 1) > sizes.get("n_max", NGram.n_max):
            raise ValueError(
                f"{WHERE}: prompt_lookup_min ({sizes['n_min']}) must not exceed prompt_lookup_max "
                f"({sizes.get('n_max', NGram.n_max)}{'' if 'n_max' in sizes else ', the default'})"
            )
        return NGram(**k, **sizes)
    if method == "draft_model":
        source = _required(options, "model", method, "a built-in name, an HF folder or a .gguf file")
        return DraftModel(load(source, dtype=target.params.dtype.name), **_k(options))
    if method in HEAD_METHODS:
        return _head_proposer(method, options, target)
    if method == "self_draft":
        _required(options, "layers", method, "how many of the target's first layers draft")
        return SelfDraft(layers=_int(options, "layers", 1), **_k(options))
    if method == "specjax":
        description = _required(options, "proposer", method, "a specjax.named proposer description")
        return proposer_from_description(description, target, where=f"{WHERE}.proposer")
    return _mtp(options)


def _mtp(options: dict):
    """The target's own multi-token-prediction layers (DeepSeek-V3, GLM-4.5): specjax.MTP, with
    FastDeploy's keys: `num_model_steps` (the MTP layers' drafts) and `mtp_strategy`: "default"
    (the MTP layers draft all num_speculative_tokens; num_model_steps equal to it when given) or
    "with_ngram" (specjax.WithNGram: the MTP layers draft num_model_steps, default 1, and prompt
    lookup extends the chain to num_speculative_tokens)."""
    strategy = options.get("mtp_strategy", "default")
    if strategy not in ("default", "with_ngram"):
        raise ValueError(
            f"{WHERE}: mtp_strategy {strategy!r} is not supported; allowed: 'default', 'with_ngram'"
        )
    k = _k(options).get("k")
    steps = _int(options, "num_model_steps", 1, MAX_SPECULATIVE_TOKENS)
    if strategy == "with_ngram":
        steps = 1 if steps is None else steps
        if k is None or k <= steps:
            raise ValueError(
                f"{WHERE}: mtp_strategy 'with_ngram' needs num_speculative_tokens greater than "
                f"num_model_steps ({steps}): the lookup drafts the rest, got {k}"
            )
        return WithNGram(MTP(k=steps), NGram(k=k - steps))
    if steps is not None and k is not None and steps != k:
        raise ValueError(
            f"{WHERE}: num_model_steps={steps} differs from num_speculative_tokens={k}; with "
            "mtp_strategy 'default' the MTP layers draft them all: give equal values, one of them, or "
            "mtp_strategy 'with_ngram'"
        )
    k = steps if k is None else k
    return MTP() if k is None else MTP(k=k)


__all__ = ["METHOD_KEYS", "speculative_config_to_proposer"]
