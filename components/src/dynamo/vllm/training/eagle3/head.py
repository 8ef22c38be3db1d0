"""The Eagle3 draft head as vLLM 0.32 runs it, in plain PyTorch, for training on CPU.

The computation mirrors `vllm/model_executor/models/llama_eagle3.py` (one layer, norm after
residual), so weights trained here behave the same once vLLM loads them:

    g      = fc(concat(aux hidden states of the target at its Eagle3 layers))   # 3H -> H
    x      = concat(input_layernorm(embed(next token)), hidden_norm(g))         # 2H
    h      = g + o_proj(attention(x))                                           # residual: g
    out    = h + mlp(post_attention_layernorm(h))                               # "prenorm"
    logits = lm_head(norm(out))                                                 # draft vocab

Each further draft step feeds `out` back in place of `g`, with the drafted token's
embedding, one position later. Parameter names are the speculators checkpoint's
(`fc`, `midlayer.*`, `norm`, `lm_head`); the token embedding is the target's, frozen and
not saved (vLLM shares the target's when the checkpoint has none).

Training-time test (`unrolled_logits`): the head is unrolled K steps over a whole
sequence at once. At step j, position t stands for the draft of position t + j at run
time: it reads token x[t+j+1], its own output from step j-1, RoPE position t + j, and
attends to the step-0 keys of positions <= t (what the KV cache holds at run time) plus
its own chain's keys from steps 1..j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class HeadShape:
    """The target's dimensions the head must match, and the head's own vocabulary."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    draft_vocab_size: int
    num_aux_hidden_states: int = 3


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        self.q_proj = nn.Linear(2 * h, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Neox-style rotary embedding (Llama's) at `positions` [B, T]; x is [B, heads, T, d]."""
        angles = positions.float()[..., None] * self.inv_freq  # [B, T, d/2]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [B, heads, T, d], keys and values repeated to the query
        heads (grouped-query attention)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        groups = self.num_heads // self.num_kv_heads
        k = self.rope(k, positions).repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        return self.rope(q, positions), k, v

    def output(self, mixed: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = mixed.shape
        return self.o_proj(mixed.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)


@dataclass
class StepState:
    """One unrolled step's keys and values, kept for the later steps to attend to."""

    keys: torch.Tensor  # [B, heads, T, d]
    values: torch.Tensor


class Eagle3Head(nn.Module):
    def __init__(self, shape: HeadShape, embed_tokens: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        h = shape.hidden_size
        self.fc = nn.Linear(h * shape.num_aux_hidden_states, h, bias=False)
        self.midlayer = MidLayer(shape)
        self.norm = RMSNorm(h, shape.rms_norm_eps)
        self.lm_head = nn.Linear(h, shape.draft_vocab_size, bias=False)
        self.register_buffer("embed_tokens", embed_tokens.detach().clone(), persistent=False)

    def _step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        first: StepState | None,
        chain: list[StepState],
    ) -> tuple[torch.Tensor, torch.Tensor, StepState]:
        """One draft step over every position: (logits, prenorm output, this step's K/V)."""
        layer = self.midlayer
        embeds = layer.input_layernorm(F.embedding(tokens, self.embed_tokens))
        residual = hidden
        x = torch.cat([embeds, layer.hidden_norm(hidden)], dim=-1)
        q, k, v = layer.self_attn.project(x, positions)
        state = StepState(k, v)
        scale = layer.self_attn.head_dim**-0.5
        if first is None:  # step 0: plain causal attention over the sequence
            mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            mixed = self._tree_attention(q, first, [*chain, state], scale)
        h = residual + layer.self_attn.output(mixed)
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(out)), out, state

    @staticmethod
    def _tree_attention(
        q: torch.Tensor, first: StepState, chain: list[StepState], scale: float
    ) -> torch.Tensor:
        """Position t attends to step-0 keys at positions <= t and to its own keys from
        each later step (the diagonal): what the KV cache holds when drafting at run time."""
        t = q.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = (q @ first.keys.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        diagonal = torch.stack([(q * s.keys).sum(-1) * scale for s in chain], dim=-1)
        weights = torch.softmax(torch.cat([scores, diagonal], dim=-1), dim=-1)
        mixed = weights[..., :t] @ first.values
        for i, s in enumerate(chain):
            mixed = mixed + weights[..., t + i, None] * s.values
        return mixed

    def unrolled_logits(
        self, aux: torch.Tensor, tokens: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Draft logits of each of `steps` unrolled steps, [B, T, draft vocab] each.

        `aux` [B, T, 3H] are the target's hidden states at its Eagle3 layers, `tokens`
        [B, T] the sequence. Step j's logits at position t draft token x[t+j+2]; inputs
        past the end of the sequence are padded with token 0 and must be masked out of
        the loss by the caller."""
        b, t = tokens.shape
        base = torch.arange(t, device=tokens.device).expand(b, t)
        hidden = self.fc(aux)
        first: StepState | None = None
        chain: list[StepState] = []
        outputs = []
        for j in range(steps):
            shifted = F.pad(tokens[:, j + 1 :], (0, j + 1))
            logits, hidden, state = self._step(shifted, hidden, base + j, first, chain)
            if first is None:
                first = state
            else:
                chain.append(state)
            outputs.append(logits)
        return outputs
