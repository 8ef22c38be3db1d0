"""The training loop: batches by length, AdamW with warm-up and cosine decay, a time
budget, a progress bar, checkpoints to resume from, and the acceptance a greedy verifier
would give on held-out sequences.

The acceptance estimate replays greedy verification: a draft chain is accepted up to its
first wrong token, and until then the drafted tokens are the true ones, which is what the
teacher-forced unroll feeds the head, so the leading correct steps at each position are
what vLLM would accept there. vLLM does not draft at every position, though: a round at
position t that accepts a drafts is followed by a round at t + a + 1, so easy stretches
are crossed in few rounds and hard ones in many. The estimate walks each answer that way
(from the last prompt position, where vLLM's first round starts) and divides the tokens
by the rounds, which is the mean acceptance length vLLM reports; the plain mean over all
positions overstates it (1.90 against 1.81 walked for the shipped head).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F

from dynamo.vllm.training.eagle3.capture import CapturedSequence
from dynamo.vllm.training.eagle3.head import Eagle3Head
from dynamo.vllm.training.eagle3.ttt import Batch, DraftVocab, ttt_loss

CHECKPOINT = "training-state.pt"


@dataclass
class TrainConfig:
    steps: int = 3  # unrolled draft steps (K)
    lr: float = 1e-3
    warmup: int = 50
    batch_tokens: int = 4096
    epochs: float = 4.0
    time_budget_s: float = 3600.0
    decay: float = 0.8
    checkpoint_every_s: float = 300.0
    seed: int = 0


@dataclass
class Evaluation:
    accuracy: list[float]  # per step, teacher forced, over all answer positions
    acceptance_length: float  # tokens per verification round, walked as vLLM drafts
    per_position: list[float]  # share of rounds accepting draft position 1, 2, ... (vLLM's)
    rounds: int
    positions: int


@dataclass
class TrainResult:
    steps_done: int
    seconds: float
    losses: list[float] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)


def collate(records: Sequence[CapturedSequence]) -> Batch:
    longest = max(len(r.tokens) for r in records)
    width = records[0].aux.shape[-1]
    tokens = torch.zeros(len(records), longest, dtype=torch.long)
    labels = torch.zeros(len(records), longest, dtype=torch.long)
    mask = torch.zeros(len(records), longest, dtype=torch.bool)
    aux = torch.zeros(len(records), longest, width)
    for row, r in enumerate(records):
        n = len(r.tokens)
        tokens[row, :n] = r.tokens.long()
        labels[row, :n] = r.labels.long()
        mask[row, :n] = r.loss_mask
        aux[row, :n] = r.aux.float()
    return Batch(aux, tokens, labels, mask)


def length_batches(
    records: Sequence[CapturedSequence], batch_tokens: int, rng: random.Random
) -> list[list[int]]:
    """Indices grouped by similar length (little padding), batches in random order."""
    order = sorted(range(len(records)), key=lambda i: (len(records[i].tokens), rng.random()))
    batches: list[list[int]] = [[]]
    for i in order:
        if batches[-1] and len(records[i].tokens) * (len(batches[-1]) + 1) > batch_tokens:
            batches.append([])
        batches[-1].append(i)
    rng.shuffle(batches)
    return [b for b in batches if b]


@torch.no_grad()
def evaluate(
    head: Eagle3Head, records: Sequence[CapturedSequence], vocab: DraftVocab, cfg: TrainConfig
) -> Evaluation:
    head.eval()
    hits = [0] * cfg.steps
    labelled = [0] * cfg.steps
    accepted_at = [0] * cfg.steps
    rounds = positions = 0
    for batch_ids in length_batches(records, cfg.batch_tokens, random.Random(0)):
        batch = collate([records[i] for i in batch_ids])
        outputs = head.unrolled_logits(batch.aux, batch.tokens, cfg.steps)
        alive = None
        chain_ok = torch.ones_like(batch.loss_mask)
        leading = torch.zeros(batch.tokens.shape, dtype=torch.long)
        for j, logits in enumerate(outputs):
            shift = j + 1
            labels = F.pad(batch.labels[:, shift:], (0, shift))
            mask = F.pad(batch.loss_mask[:, shift:], (0, shift), value=False)
            drafted = vocab.draft_to_target[logits.argmax(-1)]
            correct = (drafted == labels) & mask
            hits[j] += int(correct.sum())
            labelled[j] += int(mask.sum())
            if alive is None:
                alive = mask.clone()  # chains starting at answer positions
            chain_ok &= correct | ~mask
            leading += (chain_ok & mask & alive).long()
        assert alive is not None
        positions += int(alive.sum())
        for row in range(len(batch_ids)):
            walked = walk_rounds(leading[row], alive[row])
            rounds += len(walked)
            for accepted in walked:
                for j in range(accepted):
                    accepted_at[j] += 1
    head.train()
    accuracy = [h / n if n else 0.0 for h, n in zip(hits, labelled, strict=True)]
    per_position = [a / rounds if rounds else 0.0 for a in accepted_at]
    return Evaluation(accuracy, 1.0 + sum(per_position), per_position, rounds, positions)


def walk_rounds(leading: torch.Tensor, answer: torch.Tensor) -> list[int]:
    """Accepted drafts of each verification round along one sequence, as vLLM drafts it:
    the first round at the last prompt position (the first answer position of `answer`),
    the next one after the accepted drafts and the bonus token, until the answer's last
    token is generated."""
    where = answer.nonzero().flatten().tolist()
    if not where:
        return []
    t, last = where[0], where[-1]
    accepted: list[int] = []
    while t < last:
        a = int(leading[t])
        accepted.append(a)
        t += a + 1
    return accepted


def train(
    head: Eagle3Head,
    vocab: DraftVocab,
    records: Sequence[CapturedSequence],
    held_out: Sequence[CapturedSequence],
    cfg: TrainConfig,
    out_dir: Path,
    *,
    report: Callable[[str], None] = print,
) -> TrainResult:
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    per_epoch = len(length_batches(records, cfg.batch_tokens, random.Random(cfg.seed)))
    planned = max(1, int(per_epoch * cfg.epochs))
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(cfg.warmup, planned))
    state_path = out_dir / CHECKPOINT
    result = _resume(state_path, head, optimizer, schedule)
    step, earlier_s = result.steps_done, result.seconds
    started = last_save = time.monotonic()
    bar = tqdm(total=planned, initial=step, desc="eagle3", unit="batch", dynamic_ncols=True)
    stop = False
    while step < planned and not stop:
        for batch_ids in length_batches(records, cfg.batch_tokens, rng):
            loss, metrics = ttt_loss(
                head, collate([records[i] for i in batch_ids]), vocab, cfg.steps, cfg.decay
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            result.losses.append(metrics.loss)
            bar.update(1)
            bar.set_postfix(
                loss=f"{metrics.loss:.3f}", acc="/".join(f"{a:.2f}" for a in metrics.accuracy)
            )
            now = time.monotonic()
            if now - last_save > cfg.checkpoint_every_s:
                result.steps_done, result.seconds = step, earlier_s + now - started
                _save_state(state_path, head, optimizer, schedule, result)
                last_save = now
            spent = earlier_s + now - started  # the budget counts earlier runs too
            if step >= planned or spent > cfg.time_budget_s:
                stop = spent > cfg.time_budget_s
                break
    bar.close()
    result.steps_done, result.seconds = step, earlier_s + time.monotonic() - started
    _save_state(state_path, head, optimizer, schedule, result)
    if stop:
        report(f"time budget of {cfg.time_budget_s:.0f}s reached after {step}/{planned} batches")
    if held_out:
        result.evaluations.append(evaluate(head, held_out, vocab, cfg))
    return result


def _warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _save_state(path: Path, head, optimizer, schedule, progress: TrainResult) -> None:
    """Everything a rerun needs to go on, and to report the whole run: its batches, its
    training time and every batch's loss so far."""
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(),
            "step": progress.steps_done,
            "seconds": progress.seconds,
            "losses": progress.losses,
        },
        tmp,
    )
    tmp.replace(path)


def _resume(path: Path, head, optimizer, schedule) -> TrainResult:
    if not path.exists():
        return TrainResult(steps_done=0, seconds=0.0)
    state = torch.load(path, weights_only=True)
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return TrainResult(
        steps_done=int(state["step"]),
        seconds=float(state.get("seconds", 0.0)),
        losses=list(state.get("losses", [])),
    )
