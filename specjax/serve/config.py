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
    draft_tensor_parallel_size
                            draft_model: 1 (default) replicates the draft on each device of a model
                            group; the target's --tensor-parallel-size splits it as the target
                            (DraftModel tensor_parallel)
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

from specjax.models import Model
from specjax.named import proposer_from_description
from specjax.speculate.proposers.registry import BY_METHOD, WHERE, method_required

# method -> the keys it reads besides "method": the registry's methods, and specjax's own, which
# takes any proposer description
METHOD_KEYS: dict[str, tuple[str, ...]] = {
    **{method: entry.method_keys for method, entry in BY_METHOD.items()},
    "specjax": ("proposer",),
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


def speculative_config_to_proposer(config: dict | None, target: Model) -> Any:
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
    if method == "specjax":
        description = method_required(options, "proposer", method, "a specjax.named proposer description")
        return proposer_from_description(description, target, where=f"{WHERE}.proposer")
    return BY_METHOD[method].speculative_config(options, target)


__all__ = ["METHOD_KEYS", "speculative_config_to_proposer"]
