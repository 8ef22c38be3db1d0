"""A tiny multi-token-prediction (MTP) target built in the test, for vLLM's `mimo_mtp`.

Nothing can be downloaded, so the MTP path is exercised on a MiMo-shaped checkpoint made
here: a Qwen2-style decoder (`architectures: ["MiMoForCausalLM"]`, `model_type: qwen2`, so
transformers needs no remote code) with `num_nextn_predict_layers: 1` and its MTP layer
stored as `model.mtp_layers.0.*` (token/hidden layernorms, `input_proj` over
[previous hidden, next-token embedding], one transformer block, final layernorm), the
layout vLLM 0.32's `MiMoMTP.load_weights` reads. vLLM switches to `mimo_mtp` on the
architecture name.

The weights are chosen so the MTP layer agrees with the target exactly: every attention
output projection and MLP down projection is zero, so both the target and the MTP layer
reduce to "normalised embedding of one token, through the LM head". The target's next
token after t is then a fixed function of t, and the MTP layer, whose `input_proj` passes
only the next token's embedding through, predicts that function of the token it is
given: every draft is accepted under greedy decoding, while output stays a deterministic
walk through the vocabulary (the LM head is a permutation of the embeddings).

Attention head size must be one vLLM's CPU attention supports (64 here; 16 is refused).
Measured with vLLM 0.32 on CPU, float32, greedy, 24 tokens: K=1 12/12 drafts accepted,
K=2 16/16 (per position [8, 8]); output identical to the target without speculation.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_tiny_mtp(
    out: Path,
    tokenizer_dir: Path,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate: int = 256,
    seed: int = 0,
) -> Path:
    """Write the checkpoint to `out` with `tokenizer_dir`'s tokenizer and vocabulary size."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "num_nextn_predict_layers": 1,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "use_sliding_window": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab, hidden, generator=gen)
    perm = torch.randperm(vocab, generator=gen)
    weights = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed[perm.argsort()] * 4,
        "model.norm.weight": torch.ones(hidden),
    }
    head_dim = hidden // heads

    def block(prefix: str) -> None:
        """One decoder block whose attention and MLP add nothing to the residual."""
        weights[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        weights[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
        for proj, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            weights[f"{prefix}self_attn.{proj}_proj.weight"] = (
                torch.randn(rows * head_dim, hidden, generator=gen) * 0.02
            )
            weights[f"{prefix}self_attn.{proj}_proj.bias"] = torch.zeros(rows * head_dim)
        weights[prefix + "self_attn.o_proj.weight"] = torch.zeros(hidden, heads * head_dim)
        weights[prefix + "mlp.gate_proj.weight"] = torch.randn(intermediate, hidden, generator=gen)
        weights[prefix + "mlp.up_proj.weight"] = torch.randn(intermediate, hidden, generator=gen)
        weights[prefix + "mlp.down_proj.weight"] = torch.zeros(hidden, intermediate)

    for index in range(layers):
        block(f"model.layers.{index}.")
    mtp = "model.mtp_layers.0."
    block(mtp)
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[f"{mtp}{norm}.weight"] = torch.ones(hidden)
    # input_proj([previous hidden, next-token embedding]) keeps only the embedding.
    weights[mtp + "input_proj.weight"] = torch.cat(
        [torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1
    )
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


if __name__ == "__main__":
    build_tiny_mtp(Path(sys.argv[1]), Path(sys.argv[2]))
