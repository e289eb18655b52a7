"""Tiny random models of every supported family, built by transformers from a config (no
download) and saved as HF folders: the references of tests/test_families*.py.

Each config is small (hidden 64, 3 or 4 layers, vocab 256) but keeps what makes its family its
own: sliding windows of 16 positions (so a 64-token prompt runs well past them), Gemma 3's
interleaved local and global layers with their own rotary bases, a head_dim apart from hidden /
heads, Phi-3's partial rotary, mixtures of experts with dense layers among them. Weights are
redrawn at unit scale (`peaky_random_weights`), so that logits spread widely: a wrong use of any
weight shows, and greedy choices are rarely near a tie.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
import transformers

import specjax
from specjax.models import init_params

WINDOW = 16
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)


def hf_config(family: str) -> transformers.PretrainedConfig:
    if family == "llama3":
        rope = dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        )
        return transformers.LlamaConfig(**COMMON, rope_parameters=rope)
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON)
    if family == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=WINDOW)
    if family == "qwen3":
        return transformers.Qwen3Config(**{**COMMON, "tie_word_embeddings": True}, head_dim=32)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True},
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
        )
    if family == "phi3":
        return transformers.Phi3Config(
            **COMMON,
            sliding_window=WINDOW,
            rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    if family == "mixtral":
        return transformers.MixtralConfig(
            **COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW
        )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **COMMON,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if family == "glm4_moe":
        # 8 experts in 4 groups of 2, the best 2 groups kept, 3 experts chosen among their 4; a
        # dense first layer; partial rotary over half of each 32-wide head.
        return transformers.Glm4MoeConfig(
            **COMMON,
            head_dim=32,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            use_qk_norm=True,
            attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    if family == "deepseek_v3":
        # Latent attention: queries through a rank-48 latent, keys and values from a rank-32 one,
        # 16 nope + 8 rotary query dims, values 24 wide; yarn over an original context of 32
        # (the prompts run past it), mscale apart from mscale_all_dim so that both show. The
        # mixture as GLM-4.5's.
        return transformers.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4},  # (transformers expands the latent to every head)
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=32,
                mscale=1.0,
                mscale_all_dim=0.5,
            ),
        )
    if family == "gpt_oss":
        return transformers.GptOssConfig(
            **COMMON,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,  # layer_types: sliding, full, sliding (its default alternation)
            swiglu_limit=2.0,  # low enough that unit-scale activations are clamped often
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,  # times factor: max_position_embeddings
            },
        )
    raise ValueError(family)


FAMILIES = (
    "llama3",
    "qwen2",
    "mistral",
    "qwen3",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
    "gpt_oss",
)


def peaky_random_weights(model: torch.nn.Module, seed: int, gain: float = 1.5) -> None:
    """Redraw every weight: unit-variance activations, norms (and Gemma's 1 + w norms) and biases
    away from trivial values, embeddings and the LM head at unit scale (widely spread logits);
    a tied head's embedding smaller and its final norm larger, for the same spread."""
    gemma = model.config.model_type.startswith("gemma")
    tied = model.config.tie_word_embeddings
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name == "model.norm.weight" and tied:  # the tied head's logits spread by its scale
                param.copy_((2.0 if gemma else 3.0) + 0.2 * noise)
            elif gemma and ("post_attention" in name or "post_feedforward" in name):
                param.copy_(3.0 + 0.2 * noise)  # outputs that outweigh the embedding (times sqrt(D))
            elif "norm" in name:
                param.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            elif name.endswith("sinks"):  # gpt-oss: large enough to take a real share of each softmax
                param.copy_(1.0 + noise)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # gpt-oss: [X, in, out]
                param.copy_(gain * noise / math.sqrt(param.shape[-2]))
            elif "embed" in name and tied:
                # Small, so that the layers' outputs outweigh the token's own embedding in the
                # residual stream: a tied head then predicts something other than the fed token.
                param.copy_(0.25 * noise)
            elif "embed" in name or "lm_head" in name:
                param.copy_(noise)
            else:  # [out, in]
                param.copy_(gain * noise / math.sqrt(param.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # sigmoid routers: moves which experts win
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))


def torch_model(family: str, seed: int = 0, dtype=torch.float32, gain: float = 1.5) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager")
    peaky_random_weights(model.float(), seed, gain)
    return model.to(dtype).eval()


def save_folder(family: str, folder: Path, seed: int = 0, gain: float = 1.5) -> torch.nn.Module:
    """The family's random float32 model, saved to `folder`; returns the torch model."""
    model = torch_model(family, seed, gain=gain)
    model.save_pretrained(folder)
    return model


def prompts(vocab_size: int = 256, lengths=(64, 41), seed: int = 0) -> list[list[int]]:
    """Random prompts with a repeated stretch, so prompt lookup has something to find."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        row = rng.integers(0, vocab_size, n).tolist()
        row[n // 2 : n // 2 + 8] = row[4:12]
        rows.append(row)
    return rows


def smaller_draft(target: specjax.Model, seed: int = 1) -> specjax.Model:
    """A random one-layer model of the target's family and vocabulary: a DraftModel."""
    c = target.config
    types = None if c.layer_types is None else c.layer_types[:1]
    dense = tuple(i for i in c.dense_layers if i < 1)
    config = dataclasses.replace(c, num_layers=1, layer_types=types, dense_layers=dense)
    import jax

    return specjax.Model(config, init_params(config, jax.random.key(seed), target.params.dtype), name="draft")


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation of one prompt, and its logits at each chosen token [N, V]."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # else generate takes token pad_token_id for padding
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.stack(out.logits)[:, 0].float().numpy()
