"""What the mocker needs to know about the model it pretends to serve, read from the model
directory's JSON files (no weights, no `transformers`): the vocabulary size (valid token
ids), the end-of-sequence ids, the special tokens it must never "generate" (so the
output detokenizes to plain text) and the context length."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]
    max_position_embeddings: int | None

    @classmethod
    def load(cls, path: Path) -> ModelInfo:
        """Read `config.json`, `generation_config.json` and `tokenizer.json` (each optional
        except that some vocabulary size must be found)."""
        path = Path(path)
        config = _read_json(path / "config.json")
        generation = _read_json(path / "generation_config.json")
        tokenizer = _read_json(path / "tokenizer.json")
        added = tokenizer.get("added_tokens") or []
        special = frozenset(int(t["id"]) for t in added if t.get("special"))
        tokenizer_size = _tokenizer_vocab_size(tokenizer)
        vocab_size = max(int(config.get("vocab_size") or 0), tokenizer_size)
        if vocab_size <= 0:
            raise ValueError(
                f"{path}: no vocab_size in config.json and no tokenizer.json vocabulary"
            )
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
        max_pos = config.get("max_position_embeddings")
        return cls(
            path=path,
            vocab_size=vocab_size,
            eos_token_ids=eos_ids,
            special_token_ids=special,
            max_position_embeddings=int(max_pos) if max_pos else None,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _tokenizer_vocab_size(tokenizer: dict[str, Any]) -> int:
    """One past the largest token id `tokenizer.json` defines (0 when it defines none)."""
    vocab = (tokenizer.get("model") or {}).get("vocab")
    ids: list[int] = []
    if isinstance(vocab, dict):
        ids.extend(int(i) for i in vocab.values())
    elif isinstance(vocab, list):  # unigram models: [[piece, score], ...]
        ids.append(len(vocab) - 1)
    ids.extend(int(t["id"]) for t in tokenizer.get("added_tokens") or [])
    return max(ids) + 1 if ids else 0
