"""Write a Llama-family specjax model as an HF checkpoint folder, without torch: what the CLI
tests read with `--model PATH`, and the sharded checkpoints of the streamed-loading test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specjax.models.checkpoint import flatten
from specjax.models.families import ATTENTION_TENSORS, DENSE_MLP_TENSORS, norm_tensors
from specjax.models.params import layer_to_checkpoint
from specjax.models.tensors import of_array, write_safetensors


def hf_tensors(model) -> dict[str, np.ndarray]:
    """The model's weights by HF name, in HF's layout ([out, in] matrices)."""
    c = model.config
    flat = {name: np.asarray(value) for name, value in flatten(model.params.replace(layers=())).items()}
    tensors = {"model.embed_tokens.weight": flat["embed"]}
    names = ATTENTION_TENSORS | norm_tensors(c) | DENSE_MLP_TENSORS
    for i, layer in enumerate(model.params.layers):  # q, k and v apart, as HF keeps them
        for ours, value in layer_to_checkpoint(layer, c, i).items():
            tensors[f"model.layers.{i}.{names[ours]}"] = np.asarray(value).T
    tensors["model.norm.weight"] = flat["final_norm"]
    if "lm_head" in flat:
        tensors["lm_head.weight"] = flat["lm_head"].T
    return tensors


def save_hf_folder(model, folder: Path, num_shards: int = 1) -> None:
    """config.json (model_type llama) and the weights, in one model.safetensors or in
    `num_shards` shards listed by model.safetensors.index.json, each written tensor by tensor."""
    c = model.config
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    (folder / "config.json").write_text(json.dumps(hf_config))
    tensors = {name: of_array(np.ascontiguousarray(v), name) for name, v in hf_tensors(model).items()}
    if num_shards == 1:
        write_safetensors(folder / "model.safetensors", tensors)
        return
    names = list(tensors)
    total = sum(t.nbytes for t in tensors.values())
    shards, current, size = [], [], 0
    for name in names:  # consecutive names, about total / num_shards bytes a shard
        current.append(name)
        size += tensors[name].nbytes
        if size >= total / num_shards and len(shards) < num_shards - 1:
            shards.append(current)
            current, size = [], 0
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / file, {name: tensors[name] for name in shard})
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
