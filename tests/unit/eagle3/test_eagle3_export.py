"""The exported checkpoint has the names vLLM 0.32's Eagle3 loader reads, the draft-vocab
mapping in vLLM's convention, no embedding, and a speculators config naming the target."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

from dynamo.vllm.training.eagle3.export import save_checkpoint
from dynamo.vllm.training.eagle3.head import Eagle3Head, HeadShape
from dynamo.vllm.training.eagle3.ttt import DraftVocab

VOCAB = 40
SHAPE = HeadShape(
    hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
    rms_norm_eps=1e-6, rope_theta=10000.0, draft_vocab_size=8,
)  # fmt: skip


def test_checkpoint_names_mapping_and_config(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps({"vocab_size": VOCAB, "architectures": ["LlamaForCausalLM"]})
    )
    head = Eagle3Head(SHAPE, torch.randn(VOCAB, SHAPE.hidden_size))
    vocab = DraftVocab.most_frequent(Counter({3: 9, 17: 5, 30: 2}), 8, VOCAB)
    out = save_checkpoint(tmp_path / "head", head, vocab, target, 3, {"recipe.json": "{}"})

    tensors = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(tensors)
    assert "midlayer.self_attn.q_proj.weight" in tensors
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # [embeds, hidden]
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    # vLLM: target id = draft id + d2t[draft id]
    targets = torch.arange(8) + tensors["d2t"]
    assert {3, 17, 30} <= set(targets.tolist())
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 8

    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == 8
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target)
    assert config["dtype"] == "bfloat16"  # speculators' own serialisation wrote it
    named = save_checkpoint(tmp_path / "named", head, vocab, target, 3, verifier="my-model")
    verifier = json.loads((named / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "my-model"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert (out / "recipe.json").read_text() == "{}"
