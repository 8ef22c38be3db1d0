"""The target's hidden states at its Eagle3 layers, and its greedy labels, for training.

vLLM 0.32 feeds an Eagle3 head the residual stream entering layers (2, L/2, L-3) of an
L-layer target (`SupportsEagle3.get_eagle3_default_aux_hidden_state_layers`), which is
what transformers returns as `hidden_states[i]` for those i. The target runs here with
transformers in bf16, as vLLM runs it, once per sequence; the results are stored in
shards so training epochs do not pay for the target again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dynamo.vllm.training.eagle3.distill import Conversation

log = logging.getLogger(__name__)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default Eagle3 layers for a target of `num_layers` layers."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class CapturedSequence:
    """One captured sequence (see `ttt.Batch` for the meaning of each field)."""

    tokens: torch.Tensor  # [T] int32
    aux: torch.Tensor  # [T, 3H] bf16
    labels: torch.Tensor  # [T] int32, the target's greedy next token
    loss_mask: torch.Tensor  # [T] bool


def capture(
    target: Path,
    conversations: Sequence[Conversation],
    out_dir: Path,
    *,
    shard_size: int = 256,
    batch_tokens: int = 4096,
    threads: int | None = None,
) -> list[Path]:
    """Run the target over every conversation and write shards of `CapturedSequence` records."""
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16)
    model.eval()
    layers = default_aux_layers(model.config.num_hidden_layers)
    out_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(conversations)), key=lambda i: conversations[i].length)
    shards: list[Path] = []
    pending: list[CapturedSequence] = []
    started = time.monotonic()
    done = 0
    for batch in _length_batches(order, conversations, batch_tokens):
        pending.extend(_run(model, [conversations[i] for i in batch], layers))
        done += len(batch)
        if len(pending) >= shard_size:
            shards.append(_write(out_dir, len(shards), pending))
            pending = []
        elapsed = time.monotonic() - started
        log.info(
            "captured %d/%d sequences, %.0fs elapsed, ~%.0fs left",
            done,
            len(conversations),
            elapsed,
            elapsed / done * (len(conversations) - done),
        )
    if pending:
        shards.append(_write(out_dir, len(shards), pending))
    return shards


def _length_batches(
    order: list[int], conversations: Sequence[Conversation], batch_tokens: int
) -> list[list[int]]:
    batches: list[list[int]] = [[]]
    for i in order:
        longest = max([conversations[j].length for j in batches[-1]] + [conversations[i].length])
        if batches[-1] and longest * (len(batches[-1]) + 1) > batch_tokens:
            batches.append([])
        batches[-1].append(i)
    return [b for b in batches if b]


@torch.no_grad()
def _run(model, batch: list[Conversation], layers: tuple[int, ...]) -> list[CapturedSequence]:
    longest = max(c.length for c in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    attention = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, c in enumerate(batch):
        seq = c.prompt_ids + c.answer_ids
        ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
    out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
    labels = out.logits.argmax(-1)
    records = []
    for row, c in enumerate(batch):
        n = c.length
        mask = torch.zeros(n, dtype=torch.bool)
        # Position p predicts token p + 1: answer tokens are predicted from the prompt's
        # last position on; the sequence's last position predicts nothing we hold.
        mask[len(c.prompt_ids) - 1 : n - 1] = True
        records.append(
            CapturedSequence(
                tokens=ids[row, :n].to(torch.int32),
                aux=aux[row, :n].to(torch.bfloat16).clone(),
                labels=labels[row, :n].to(torch.int32),
                loss_mask=mask,
            )
        )
    return records


def _write(out_dir: Path, index: int, records: list[CapturedSequence]) -> Path:
    path = out_dir / f"shard-{index:05d}.pt"
    torch.save([vars(r) for r in records], path)
    return path


def load_shard(path: Path) -> list[CapturedSequence]:
    return [CapturedSequence(**record) for record in torch.load(path, weights_only=True)]
