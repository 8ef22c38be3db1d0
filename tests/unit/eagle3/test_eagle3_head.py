"""The unrolled training-time-test pass computes, at every position, exactly what drafting
one token at a time against a KV cache computes at run time."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from dynamo.vllm.training.eagle3.head import Eagle3Head, HeadShape

SHAPE = HeadShape(
    hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
    rms_norm_eps=1e-6, rope_theta=10000.0, draft_vocab_size=50,
)  # fmt: skip
VOCAB = 50


def head() -> Eagle3Head:
    torch.manual_seed(0)
    return Eagle3Head(SHAPE, torch.randn(VOCAB, SHAPE.hidden_size)).double()


def drafted_at_run_time(model: Eagle3Head, aux, tokens, t: int, steps: int) -> list[torch.Tensor]:
    """Logits of each draft step for a chain starting at position t, one token at a time:
    the KV cache holds step-0 entries of positions 0..t, then each step's own entry."""
    layer = model.midlayer
    attn = layer.self_attn
    keys, values = [], []

    def one(token: int, hidden: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = layer.input_layernorm(F.embedding(torch.tensor([[token]]), model.embed_tokens))
        x = torch.cat([embeds, layer.hidden_norm(hidden)], -1)
        q, k, v = attn.project(x, torch.tensor([[position]]))
        keys.append(k)
        values.append(v)
        scores = (q @ torch.cat(keys, 2).transpose(-1, -2)) * attn.head_dim**-0.5
        mixed = torch.softmax(scores, -1) @ torch.cat(values, 2)
        h = hidden + attn.output(mixed)
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.lm_head(model.norm(out)), out

    hidden0 = model.fc(aux)
    for s in range(t + 1):  # step 0 over the prefix fills the cache; keep position t's output
        logits, out = one(int(tokens[0, s + 1]), hidden0[:, s : s + 1], s)
    result = [logits]
    for j in range(1, steps):
        logits, out = one(int(tokens[0, t + j + 1]), out, t + j)
        result.append(logits)
    return result


def test_unrolled_steps_equal_drafting_one_token_at_a_time() -> None:
    model = head()
    torch.manual_seed(1)
    length, steps = 12, 3
    aux = torch.randn(1, length, 3 * SHAPE.hidden_size, dtype=torch.double)
    tokens = torch.randint(0, VOCAB, (1, length))
    unrolled = model.unrolled_logits(aux, tokens, steps)
    for t in (0, 3, 7):
        sequential = drafted_at_run_time(model, aux, tokens, t, steps)
        for j in range(steps):
            torch.testing.assert_close(unrolled[j][0, t], sequential[j][0, 0])
