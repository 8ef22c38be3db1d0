"""Tiny model directories for the worker configuration tests: a `config.json`, nothing else.

Building a vLLM config reads `config.json` but loads no weights, so these directories let
the tests check what vLLM makes of a resolved configuration without the embedded model
(nothing here downloads or prepares anything).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 8,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

TINY_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def speculators_config(verifier: str, *, kind: str = "eagle3", tokens: int = 4) -> dict[str, Any]:
    """A speculators-format Eagle3 checkpoint config, as the `speculators` library writes it."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": kind,
        "speculators_version": "0.1.0",
        "draft_vocab_size": 500,
        "norm_before_residual": True,
        "target_hidden_size": 64,
        "transformer_layer_config": {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
            "vocab_size": 1000,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "head_dim": 16,
        },
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1}
            ],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
    }
