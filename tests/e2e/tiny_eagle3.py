"""A tiny Llama target and an Eagle3 draft for it, in speculators format, built in a test.

Nothing can be downloaded on these machines, so the e2e tests make their own pair. The
weights are random but chosen so that the draft agrees with the target, which lets a test
see accepted draft tokens rather than only proposed ones:

* target: attention and MLP output projections are zero, so every layer passes the token
  embedding through unchanged; embedding rows are unit vectors and the LM head is tied to
  them, so greedy decoding repeats the last prompt token (a unit vector's dot product with
  itself beats its dot product with any other random row);
* draft: `fc` keeps the first auxiliary hidden state (the target's embedding of the
  current token) and drops the other two, its layer adds nothing (zero output projections)
  and its LM head is the target's embedding, so it proposes the same repeated token.

The draft is a speculators checkpoint (`config.json` with `speculators_config`, weights
named as vLLM 0.32's `Eagle3LlamaForCausalLM.load_weights` expects: `midlayer.*`, `fc`,
`norm`, `embed_tokens`, `lm_head`; no `d2t` because the draft keeps the full vocabulary).
Eagle3 reads auxiliary hidden states from layers (2, L/2, L-3) of the target by default,
so the target needs at least 8 layers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dynamo.vllm.training.eagle3.export import speculators_section

HIDDEN = 64
INTERMEDIATE = 128
HEADS = 2
KV_HEADS = 1
HEAD_DIM = HIDDEN // HEADS  # CPU attention supports head sizes 32, 64, 80, ... (not 16)
TARGET_LAYERS = 8
NUM_AUX_HIDDEN_STATES = 3
SPECULATIVE_TOKENS = 3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _llama_shape(vocab_size: int, layers: int) -> dict:
    return {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
    }


def build_target(directory: Path, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """Save the repeat-the-last-token Llama target (bf16 safetensors) with the tokenizer
    files of `tokenizer_dir` (the embedded model's, so prompts tokenize as usual)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vocab_size = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    torch.manual_seed(seed)
    config = LlamaConfig(
        **_llama_shape(vocab_size, TARGET_LAYERS),
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        embed = torch.nn.functional.normalize(torch.randn(vocab_size, HIDDEN), dim=-1)
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.to(torch.bfloat16).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def speculators_config(verifier: Path, vocab_size: int) -> dict:
    """`config.json` of an Eagle3 speculators checkpoint drafting for `verifier`."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "draft_vocab_size": vocab_size,
        "norm_before_residual": True,
        "target_hidden_size": HIDDEN,
        "torch_dtype": "bfloat16",
        "transformer_layer_config": {
            # SpeculatorsConfig fills in no Llama defaults: every field the layer reads.
            "model_type": "llama",
            **_llama_shape(vocab_size, 1),
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
        },
        "speculators_config": speculators_section(
            str(verifier), ["LlamaForCausalLM"], SPECULATIVE_TOKENS
        ),
    }


def build_eagle3_draft(directory: Path, target: Path, *, seed: int = 1) -> Path:
    """Save an Eagle3 speculators checkpoint for `target` (built by `build_target`)."""
    import torch
    from safetensors.torch import load_file, save_file

    target_weights = load_file(str(target / "model.safetensors"))
    embed = target_weights["model.embed_tokens.weight"]
    vocab_size = embed.shape[0]
    generator = torch.Generator().manual_seed(seed)

    def small(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    fc = torch.zeros(HIDDEN, HIDDEN * NUM_AUX_HIDDEN_STATES)
    fc[:, :HIDDEN] = torch.eye(HIDDEN)
    weights = {
        "embed_tokens.weight": embed.clone(),
        "lm_head.weight": embed.clone(),
        "fc.weight": fc,
        "norm.weight": torch.ones(HIDDEN),
        "midlayer.input_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.hidden_norm.weight": torch.ones(HIDDEN),
        "midlayer.post_attention_layernorm.weight": torch.ones(HIDDEN),
        # The first draft layer attends over [embedding, hidden state]: twice the width.
        "midlayer.self_attn.q_proj.weight": small(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": small(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": small(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": torch.zeros(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": small(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": small(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": torch.zeros(HIDDEN, INTERMEDIATE),
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: t.to(torch.bfloat16).contiguous() for name, t in weights.items()},
        str(directory / "model.safetensors"),
    )
    config = speculators_config(target, vocab_size)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def build_pair(root: Path, tokenizer_dir: Path) -> tuple[Path, Path]:
    """`root/target` and `root/eagle3-draft` (the speculators checkpoint to pass as --model)."""
    target = build_target(root / "target", tokenizer_dir)
    return target, build_eagle3_draft(root / "eagle3-draft", target)
