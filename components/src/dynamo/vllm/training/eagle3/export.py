"""Write a trained head as a speculators Eagle3 checkpoint that vLLM 0.32 loads.

The directory holds `config.json` (an `Eagle3Speculator` config whose verifier is the
target, so `--model <dir>` alone serves target + draft; built and validated by the
`speculators` library's own `Eagle3SpeculatorConfig`, so the format is theirs, not a copy) and `model.safetensors` with the
head in bf16 under the names vLLM's `Eagle3LlamaForCausalLM.load_weights` reads, plus
`d2t` (int64 offsets, draft id -> target id) and `t2d` (bool mask). The token embedding is
the target's: vLLM shares it when the checkpoint has none, which keeps the file small.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dynamo.vllm.training.eagle3.head import Eagle3Head
from dynamo.vllm.training.eagle3.ttt import DraftVocab

WEIGHTS_FILE = "model.safetensors"


def speculators_config(
    head: Eagle3Head, verifier: str, target_config: dict[str, Any], speculative_tokens: int
) -> dict[str, Any]:
    shape = head.shape
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "draft_vocab_size": shape.draft_vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": shape.hidden_size,
        "torch_dtype": "bfloat16",
        "transformer_layer_config": {
            "model_type": "llama",
            "vocab_size": target_config["vocab_size"],
            "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": shape.num_heads,
            "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "max_position_embeddings": target_config.get("max_position_embeddings", 8192),
            "rms_norm_eps": shape.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
            "tie_word_embeddings": False,
        },
        "speculators_config": speculators_section(
            verifier,
            target_config.get("architectures", ["LlamaForCausalLM"]),
            speculative_tokens,
        ),
    }


def speculators_section(
    verifier: str, architectures: list[str], speculative_tokens: int
) -> dict[str, Any]:
    """An Eagle3 checkpoint's `speculators_config`: greedy proposals of K tokens, and the
    verifier (the target) by name or path."""
    return {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": speculative_tokens,
                "verifier_accept_k": 1,
            }
        ],
        "verifier": {"name_or_path": verifier, "architectures": architectures},
    }


def head_tensors(head: Eagle3Head, vocab: DraftVocab) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: the head in bf16 (no embedding), `d2t` and `t2d`."""
    tensors = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in head.state_dict().items()
    }
    tensors["d2t"] = vocab.d2t_offsets.contiguous()
    tensors["t2d"] = vocab.t2d_mask.contiguous()
    return tensors


def validated_config_json(config: dict[str, Any]) -> str:
    """`config` through speculators' `Eagle3SpeculatorConfig`: rejects what speculators
    would, and fills its defaults the way speculators writes them."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    return Eagle3SpeculatorConfig.from_dict(config).to_json_string()


def save_checkpoint(
    out: Path,
    head: Eagle3Head,
    vocab: DraftVocab,
    target: Path,
    speculative_tokens: int,
    extra_files: dict[str, str] | None = None,
    *,
    verifier: str | None = None,
) -> Path:
    """Write the checkpoint to `out` (created); `extra_files` (name -> text) go beside it.
    `verifier` is how the config names the target (default: `target`'s path; an embedded
    model's name keeps a shipped head independent of where the cache is)."""
    out.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((target / "config.json").read_text())
    save_file(head_tensors(head, vocab), str(out / WEIGHTS_FILE))
    config = speculators_config(head, verifier or str(target), target_config, speculative_tokens)
    (out / "config.json").write_text(validated_config_json(config))
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    return out
