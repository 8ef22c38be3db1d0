"""Writes the two prompt sets `spec_decode_bench.py --adaptive --workload` serves besides
the chat prompts the speculation profiles are measured on:

* `repeat_edit.jsonl`: prompts that ask to repeat, copy or lightly edit a passage given in
  the prompt. Most of each answer is in the prompt, so n-gram drafts and Eagle3 drafts
  are accepted far more often than on chat.
* `hard.jsonl`: prompts whose answers nothing predicts: random-looking numbers, codes and
  invented words. Drafts are rarely accepted.

Deterministic (no randomness, no downloads): `python benchmarks/prompts/make_workloads.py`
rewrites both files byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent

PASSAGES = [
    "The old lighthouse stood at the end of the harbour wall. Every evening the keeper "
    "climbed its ninety steps, cleaned the great lens and lit the lamp, and every morning "
    "he wrote in a thick book how many ships had passed in the night.",
    "To make bread, mix flour, water, salt and yeast, and knead the dough for ten minutes "
    "until it is smooth. Let it rise for an hour, shape it into a loaf, let it rise again, "
    "and bake it in a hot oven until the crust is brown.",
    "The meeting is moved from Tuesday to Thursday at three o'clock in the small room on "
    "the second floor. Please bring the budget figures for the last quarter and the list "
    "of open questions from the customer visit.",
    "Rivers carry water from the hills to the sea. On the way they cut valleys, carry sand "
    "and stones, and leave rich soil on their banks when they flood, which is why so many "
    "towns and farms grew up beside them.",
    "Our library opens at nine in the morning and closes at six in the evening. Books can "
    "be borrowed for three weeks and renewed twice, online or at the desk, unless another "
    "reader has reserved them.",
    "The train to the coast leaves from platform four every half hour. It stops at the "
    "airport, the university and the old town, and the whole journey takes a little under "
    "an hour if it runs on time.",
    "A good email says what it wants in the first sentence, gives the reader everything "
    "needed to act, and ends with a clear next step. Long background belongs in an "
    "attachment, not in the message itself.",
    "The garden has three beds of vegetables, a row of apple trees and a small pond. In "
    "spring we plant beans and lettuce, in summer we water every evening, and in autumn we "
    "pick the apples and store them in the cellar.",
]

INSTRUCTIONS = [
    "Repeat the following passage exactly, word for word:\n\n{p}",
    "Copy this text twice, each copy on its own line:\n\n{p}",
    "Rewrite the passage below, changing only 'the' to 'this' wherever it appears:\n\n{p}",
    "Here is a passage. Repeat it, then repeat its first sentence once more.\n\n{p}",
    "Fix any spelling mistakes in this text and return the whole text:\n\n{p}",
    "Put the following text in quotation marks and repeat it exactly:\n\n{p}",
    "Return this paragraph unchanged, then again with each sentence on a new line:\n\n{p}",
    "Echo back the passage below exactly as written, with nothing added:\n\n{p}",
]

HARD = [
    "List {n} random four-digit numbers, separated by commas.",
    "Write {n} made-up words that sound like names of distant planets, one per line.",
    "Give {n} random strings of eight letters and digits, like a password generator.",
    "Invent {n} unusual names for colours that do not exist, with a one-word description each.",
    "Write {n} random dates between the years 1000 and 3000, in the format YYYY-MM-DD.",
    "Generate {n} fictional product codes made of three letters, a dash and five digits.",
    "Name {n} imaginary animals, each a blend of two real ones, with a made-up Latin name.",
    "Write a sequence of {n} random hexadecimal numbers of six digits each.",
]


def repeat_edit() -> list[str]:
    return [i.format(p=p) for p in PASSAGES for i in INSTRUCTIONS]


def hard() -> list[str]:
    return [h.format(n=n) for n in (12, 15, 18, 20, 24, 25, 30, 40) for h in HARD]


def write(name: str, prompts: list[str]) -> Path:
    path = HERE / name
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def main() -> None:
    for name, prompts in (("repeat_edit.jsonl", repeat_edit()), ("hard.jsonl", hard())):
        print(f"{write(name, prompts)}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
