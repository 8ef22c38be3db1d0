"""The training-time-test loss and the draft vocabulary.

Labels are the target's own greedy choices (`argmax` of its logits at each position), the
tokens a greedy verifier accepts. Step j's logits at position t draft the token after
position t + j + 1, so their label is the target's choice there, and they count only where
that position is in an answer (`loss_mask`): the head drafts answers, not prompts.
Later steps weigh less (`decay` ** j), as in the Eagle3 recipe: a draft token is only
worth anything when the ones before it were accepted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from dynamo.vllm.training.eagle3.head import Eagle3Head

IGNORE = -100


@dataclass
class Batch:
    aux: torch.Tensor  # [B, T, 3H] target hidden states at the Eagle3 layers
    tokens: torch.Tensor  # [B, T] token ids (padding: 0)
    labels: torch.Tensor  # [B, T] the target's greedy next token at each position
    loss_mask: torch.Tensor  # [B, T] bool: position's next token belongs to an answer


@dataclass(frozen=True)
class DraftVocab:
    """The most frequent target tokens; `d2t` as vLLM reads it (target = draft + d2t)."""

    draft_to_target: torch.Tensor  # [N] target id of each draft id
    target_to_draft: torch.Tensor  # [V] draft id of each target id, -1 when absent

    @classmethod
    def most_frequent(cls, counts: Counter[int], size: int, vocab_size: int) -> DraftVocab:
        ids = sorted(token for token, _ in counts.most_common(size))
        # Fill up with the lowest unused ids so the head always has `size` outputs.
        missing = size - len(ids)
        if missing > 0:
            taken = set(ids)
            ids = sorted(ids + [t for t in range(vocab_size) if t not in taken][:missing])
        d2t = torch.tensor(ids, dtype=torch.long)
        t2d = torch.full((vocab_size,), -1, dtype=torch.long)
        t2d[d2t] = torch.arange(size)
        return cls(d2t, t2d)

    @property
    def d2t_offsets(self) -> torch.Tensor:
        """The checkpoint's `d2t`: offset from each draft id to its target id."""
        return self.draft_to_target - torch.arange(len(self.draft_to_target))

    @property
    def t2d_mask(self) -> torch.Tensor:
        """The checkpoint's `t2d`: which target ids the draft vocabulary holds."""
        return self.target_to_draft >= 0


@dataclass
class StepMetrics:
    loss: float
    accuracy: list[float]  # per step: draft == target's choice, where labelled
    coverage: float  # share of labelled positions whose label is in the draft vocabulary


def ttt_loss(
    head: Eagle3Head, batch: Batch, vocab: DraftVocab, steps: int, decay: float = 0.8
) -> tuple[torch.Tensor, StepMetrics]:
    outputs = head.unrolled_logits(batch.aux, batch.tokens, steps)
    total = torch.zeros((), dtype=outputs[0].dtype)
    accuracy = []
    labelled = covered = 0
    for j, logits in enumerate(outputs):
        shift = j + 1
        labels = F.pad(batch.labels[:, shift:], (0, shift), value=0)
        mask = F.pad(batch.loss_mask[:, shift:], (0, shift), value=False)
        draft = vocab.target_to_draft[labels]
        valid = mask & (draft >= 0)
        if j == 0:
            labelled, covered = int(mask.sum()), int(valid.sum())
        if not valid.any():
            accuracy.append(0.0)
            continue
        target = torch.where(valid, draft, torch.full_like(draft, IGNORE))
        ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE)
        total = total + decay**j * ce
        hits = (logits.argmax(-1) == draft) & valid
        accuracy.append(float(hits.sum()) / float(valid.sum()))
    coverage = covered / labelled if labelled else 0.0
    return total, StepMetrics(float(total.detach()), accuracy, coverage)
