"""The four stages of `python -m dynamo.vllm.train_eagle3`, each cached in the work dir."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch

from dynamo.vllm.training.eagle3 import distill
from dynamo.vllm.training.eagle3.capture import CapturedSequence, capture, load_shard
from dynamo.vllm.training.eagle3.export import save_checkpoint
from dynamo.vllm.training.eagle3.head import Eagle3Head, HeadShape
from dynamo.vllm.training.eagle3.prompts import as_messages, compose, held_out, read_jsonl
from dynamo.vllm.training.eagle3.train import TrainConfig, train
from dynamo.vllm.training.eagle3.ttt import DraftVocab

log = logging.getLogger(__name__)
DONE = "DONE"
T = TypeVar("T")


def run(args: argparse.Namespace) -> dict[str, Any]:
    work: Path = args.work_dir or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    stages = StageClock(work / "stage-seconds.json")
    train_set, held_set = stages.timed("generation", lambda: _answers(args, work))
    train_records, held_records = stages.timed(
        "capture",
        lambda: (
            _captured(args.target, train_set, work / "train-shards"),
            _captured(args.target, held_set, work / "held-out-shards"),
        ),
    )
    vocab = DraftVocab.most_frequent(
        _answer_label_counts(train_records), args.draft_vocab, _vocab_size(args.target)
    )
    head = initial_head(args.target, args.draft_vocab, vocab)
    cfg = TrainConfig(
        steps=args.steps,
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        epochs=args.epochs,
        time_budget_s=args.time_budget * 60,
        seed=args.seed,
    )
    result = train(head, vocab, train_records, held_records, cfg, work)
    evaluation = result.evaluations[-1] if result.evaluations else None
    summary = {
        "target": args.verifier,
        "prompts": str(args.prompts) if args.prompts else f"bundled ({args.num_prompts})",
        "train_sequences": len(train_records),
        "train_answer_tokens": sum(int(r.loss_mask.sum()) for r in train_records),
        "held_out_sequences": len(held_records),
        "draft_vocab": args.draft_vocab,
        "training": asdict(cfg),
        "batches": result.steps_done,
        "seconds": stages.record("training", result.seconds),
        "loss": _loss_ends(result.losses),
        "held_out": asdict(evaluation) if evaluation else None,
    }
    save_checkpoint(
        args.out,
        head,
        vocab,
        args.target,
        args.speculative_tokens,
        {"recipe.json": json.dumps(summary, indent=2) + "\n"},
        verifier=args.verifier,
    )
    return summary


class StageClock:
    """How long each stage took when it really ran, kept in the work dir: a rerun that
    finds a stage's output cached reports the first run's time, not its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    def timed(self, stage: str, work: Callable[[], T]) -> T:
        started = time.monotonic()
        value = work()
        if stage not in self.seconds:
            self.record(stage, time.monotonic() - started)
        return value

    def record(self, stage: str, seconds: float) -> dict[str, float]:
        """Set a stage's time; returns every stage's so far and their total."""
        self.seconds[stage] = round(seconds, 1)
        self.path.write_text(json.dumps(self.seconds, indent=2) + "\n")
        return {**self.seconds, "total": round(sum(self.seconds.values()), 1)}


def _loss_ends(losses: list[float]) -> dict[str, float] | None:
    """Mean loss over the first and the last tenth of this run's batches (at least one,
    at most ten each): whether training went anywhere, without the noise of one batch."""
    if not losses:
        return None
    window = max(1, min(10, len(losses) // 10))
    return {
        "first": sum(losses[:window]) / window,
        "last": sum(losses[-window:]) / window,
        "batches_averaged": window,
    }


def _answers(
    args: argparse.Namespace, work: Path
) -> tuple[list[distill.Conversation], list[distill.Conversation]]:
    train_path, held_path = work / "answers.jsonl", work / "held-out-answers.jsonl"
    if train_path.exists() and held_path.exists():
        return distill.load(train_path), distill.load(held_path)
    prompts = (
        list(read_jsonl(args.prompts))
        if args.prompts
        else [as_messages(p) for p in compose(args.num_prompts, seed=args.seed)]
    )
    held = [as_messages(p) for p in held_out(args.held_out)]
    answers = distill.generate_answers(
        args.target,
        prompts + held,
        work / "answers.journal.jsonl",
        max_answer_tokens=args.max_answer_tokens,
        sampled_fraction=args.sampled_fraction,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    gc.collect()
    train_set = [a for a in answers[: len(prompts)] if a is not None]
    held_set = [a for a in answers[len(prompts) :] if a is not None]
    distill.save(train_set, train_path)
    distill.save(held_set, held_path)
    return train_set, held_set


def _captured(
    target: Path, conversations: list[distill.Conversation], directory: Path
) -> list[CapturedSequence]:
    if not (directory / DONE).exists():
        for stale in directory.glob("shard-*.pt"):
            stale.unlink()
        capture(target, conversations, directory)
        (directory / DONE).write_text("")
    return [r for shard in sorted(directory.glob("shard-*.pt")) for r in load_shard(shard)]


def _answer_label_counts(records: list[CapturedSequence]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for r in records:
        counts.update(r.labels[r.loss_mask].tolist())
    return counts


def _vocab_size(target: Path) -> int:
    return int(json.loads((target / "config.json").read_text())["vocab_size"])


def initial_head(target: Path, draft_vocab: int, vocab: DraftVocab) -> Eagle3Head:
    """A head shaped like one target layer. Its LM head starts as the target's rows for the
    draft vocabulary and its final norm as the target's: training then starts from "read
    the target's own output space" instead of from noise."""
    from safetensors.torch import load_file

    config = json.loads((target / "config.json").read_text())
    heads = config["num_attention_heads"]
    shape = HeadShape(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim", config["hidden_size"] // heads),
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=_rope_theta(config),
        draft_vocab_size=draft_vocab,
    )
    weights = {}
    for file in sorted(target.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    embed = weights["model.embed_tokens.weight"].float()
    lm_head = weights.get("lm_head.weight", embed).float()
    torch.manual_seed(0)
    head = Eagle3Head(shape, embed)
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() == 2:
                torch.nn.init.normal_(param, std=0.02)
        head.lm_head.weight.copy_(lm_head[vocab.draft_to_target])
        head.norm.weight.copy_(weights["model.norm.weight"].float())
    return head


def _rope_theta(config: dict[str, Any]) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
