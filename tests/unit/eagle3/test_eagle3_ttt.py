"""The training-time-test loss trains: on sequences that follow a fixed successor rule the
loss falls and every unrolled step learns to draft the target's choice."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from dynamo.vllm.training.eagle3.head import Eagle3Head, HeadShape
from dynamo.vllm.training.eagle3.ttt import Batch, DraftVocab, ttt_loss

VOCAB = 40
SHAPE = HeadShape(
    hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
    rms_norm_eps=1e-6, rope_theta=10000.0, draft_vocab_size=24,
)  # fmt: skip


def successor_batch(embed: torch.Tensor, batch: int, length: int) -> Batch:
    """Sequences where the target always continues t with (3t + 1) mod 24 (draft ids only)."""
    start = torch.randint(0, 24, (batch, 1))
    tokens = [start]
    for _ in range(length - 1):
        tokens.append((3 * tokens[-1] + 1) % 24)
    ids = torch.cat(tokens, 1)
    labels = (3 * ids + 1) % 24
    aux = embed[ids].repeat(1, 1, 3)  # the target's "hidden states": its embedding of t
    mask = torch.ones_like(ids, dtype=torch.bool)
    return Batch(aux, ids, labels, mask)


def test_draft_vocab_keeps_the_most_frequent_and_maps_both_ways() -> None:
    vocab = DraftVocab.most_frequent(Counter({7: 5, 3: 9, 30: 1, 12: 4}), 3, VOCAB)
    assert vocab.draft_to_target.tolist() == [3, 7, 12]
    assert vocab.target_to_draft[12] == 2 and vocab.target_to_draft[30] == -1
    assert (vocab.draft_to_target == torch.arange(3) + vocab.d2t_offsets).all()
    assert vocab.t2d_mask.sum() == 3
    padded = DraftVocab.most_frequent(Counter({5: 1}), 3, VOCAB)
    assert padded.draft_to_target.tolist() == [0, 1, 5]


def test_the_loss_falls_and_every_step_learns() -> None:
    torch.manual_seed(0)
    embed = torch.randn(VOCAB, SHAPE.hidden_size)
    head = Eagle3Head(SHAPE, embed)
    vocab = DraftVocab.most_frequent(Counter(range(24)), 24, VOCAB)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        loss, metrics = ttt_loss(head, successor_batch(embed, 8, 16), vocab, steps=3)
        first = first if first is not None else metrics
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert metrics.loss < 0.2 * first.loss
    assert min(metrics.accuracy) > 0.9, metrics
    assert metrics.coverage == 1.0


def test_the_walk_drafts_where_vllm_drafts_not_at_every_position() -> None:
    from dynamo.vllm.training.eagle3.train import walk_rounds

    # Prompt positions 0..1, answer positions 2..9. Leading correct drafts per position:
    leading = torch.tensor([0, 0, 3, 0, 0, 0, 1, 2, 0, 0])
    answer = torch.tensor([False, False, True, True, True, True, True, True, True, True])
    # t=2 accepts 3 -> t=6 accepts 1 -> t=8 accepts 0 -> t=9 is the last: done.
    assert walk_rounds(leading, answer) == [3, 1, 0]
    # The plain mean over answer positions (6/8) is not what vLLM counts (4/3 per round).
    assert walk_rounds(leading, torch.zeros(10, dtype=torch.bool)) == []


def test_a_rerun_goes_on_and_reports_the_whole_run(tmp_path: Path) -> None:
    from dynamo.vllm.training.eagle3.capture import CapturedSequence
    from dynamo.vllm.training.eagle3.train import TrainConfig, TrainResult, train

    torch.manual_seed(0)
    embed = torch.randn(VOCAB, SHAPE.hidden_size)
    vocab = DraftVocab.most_frequent(Counter(range(24)), 24, VOCAB)
    batch = successor_batch(embed, 8, 16)
    records = [
        CapturedSequence(batch.tokens[i], batch.aux[i], batch.labels[i], batch.loss_mask[i])
        for i in range(8)
    ]
    cfg = TrainConfig(steps=2, batch_tokens=32, warmup=1)  # 4 batches an epoch

    def run(epochs: float, held_out: list[CapturedSequence]) -> TrainResult:
        config = replace(cfg, epochs=epochs)
        return train(Eagle3Head(SHAPE, embed), vocab, records, held_out, config, tmp_path)

    first = run(1.0, [])
    second = run(2.0, records)  # resumes from the first run's state
    assert (first.steps_done, second.steps_done) == (4, 8)
    assert second.losses[:4] == first.losses and len(second.losses) == 8
    assert second.seconds >= first.seconds
    assert second.evaluations and second.evaluations[0].rounds > 0
