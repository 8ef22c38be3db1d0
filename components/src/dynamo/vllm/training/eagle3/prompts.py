"""The bundled prompt set for self-distillation, and reading a user's JSONL.

Nothing may be downloaded, so the prompts are composed here from task templates and
topics (explanations, lists, how-tos, comparisons, stories, letters, summaries, small
arithmetic word problems, code requests), shuffled with a fixed seed. The held-out set
uses topics the training set never sees, so a test on it measures generalisation rather
than memory.

A user's file is JSON Lines: `{"prompt": "..."}` or `{"messages": [{"role": ..., "content":
...}, ...]}` per line.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

Messages = list[dict[str, str]]

TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "earthquakes", "the moon's phases",
    "black holes", "the solar system", "gravity", "magnetism", "electricity at home",
    "the human heart", "sleep", "vitamins", "the immune system", "exercise", "memory",
    "bees", "whales", "forests", "deserts", "coral reefs", "rain", "snow", "clouds",
    "the Roman Empire", "ancient Egypt", "the printing press", "the Silk Road", "castles",
    "the Industrial Revolution", "the first airplanes", "trains", "bridges", "lighthouses",
    "money", "saving for a goal", "budgeting", "interest rates", "small businesses",
    "cooking rice", "baking bread", "making tea", "healthy breakfasts", "soup",
    "gardening", "composting", "houseplants", "recycling", "saving energy at home",
    "learning a language", "reading more books", "taking notes", "studying for exams",
    "public speaking", "writing an email", "job interviews", "teamwork", "time management",
    "friendship", "kindness", "patience", "curiosity", "courage", "honesty",
    "the internet", "passwords", "computers", "programming", "databases", "robots",
    "smartphones", "batteries", "solar panels", "wind turbines", "electric cars",
    "chess", "football", "swimming", "running", "cycling", "music", "painting",
    "photography", "museums", "maps", "oceans", "rivers", "mountains", "islands",
    "cats", "dogs", "horses", "owls", "ants", "butterflies", "dinosaurs", "penguins",
    "the seasons", "calendars", "clocks", "numbers", "fractions", "triangles",
    "the alphabet", "poetry", "fairy tales", "libraries", "newspapers", "post offices",
    "airports", "hospitals", "schools", "markets", "city parks", "camping", "picnics",
]  # fmt: skip

HELD_OUT_TOPICS = [
    "glaciers", "octopuses", "windmills", "pottery", "submarines", "origami", "tides",
    "hot air balloons", "fireflies", "canals", "telescopes", "knitting", "bamboo",
    "lightning", "kangaroos", "sundials",
]  # fmt: skip

TASKS = [
    "Explain {topic} to a ten-year-old.",
    "What is {topic}? Answer in two or three sentences.",
    "Give me three interesting facts about {topic}.",
    "List five things everyone should know about {topic}.",
    "Write a short story about {topic}.",
    "Write a four-line poem about {topic}.",
    "Describe {topic} in one paragraph.",
    "Why does {topic} matter? Give two reasons.",
    "What are common mistakes people make about {topic}?",
    "Summarize the main ideas of {topic} in a few bullet points.",
    "Write a short letter to a friend about {topic}.",
    "Give a beginner three tips about {topic}.",
    "Compare {topic} and {other}. How are they alike and how are they different?",
    "What questions might a student ask about {topic}? Answer one of them.",
    "Tell me something surprising about {topic}.",
    "Write a product description for a book about {topic}.",
    "Explain {topic} using a simple analogy.",
    "What would the world be like without {topic}?",
    "Write a short dialogue between two people talking about {topic}.",
    "Plan a one-hour lesson about {topic}.",
    "What is the history of {topic}, in brief?",
    "Write a haiku about {topic}.",
    "Give me a fun quiz question about {topic} and its answer.",
    "How would you teach {topic} to someone new to it?",
]

CODE_TASKS = [
    "Write a Python function that returns the sum of a list of numbers.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that returns the largest number in a list.",
    "Write a Python function that reverses the words in a sentence.",
    "Write a Python function that computes the factorial of n.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that removes duplicates from a list, keeping the order.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Write a Python function that checks whether a number is prime.",
    "Explain what a for loop does in Python, with an example.",
    "Explain the difference between a list and a dictionary in Python.",
    "Write a SQL query that selects all users older than 30 from a table named users.",
    "Write a JavaScript function that capitalizes the first letter of a string.",
    "Explain what a variable is in programming.",
]

NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jon"]
ITEMS = ["apples", "books", "pencils", "stickers", "marbles", "cookies", "stamps", "shells"]


def _word_problem(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 20)
    return rng.choice(
        [
            f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
            f"{name} has {a + b} {item} and gives away {b}. How many are left?",
            f"{name} puts {a} {item} into each of {b} boxes. How many {item} is that in total?",
            f"What is {a} times {b}? Show your working.",
            f"What is {a * b} divided by {b}? Explain the steps.",
        ]
    )


def compose(count: int, *, seed: int = 0, topics: list[str] | None = None) -> list[str]:
    """`count` distinct prompts from the templates (fewer if the templates run out)."""
    rng = random.Random(seed)
    pool = topics or TOPICS
    prompts: dict[str, None] = {}
    attempts = 0
    while len(prompts) < count and attempts < count * 20:
        attempts += 1
        kind = rng.random()
        if kind < 0.08:
            prompt = rng.choice(CODE_TASKS)
        elif kind < 0.16:
            prompt = _word_problem(rng)
        else:
            topic, other = rng.sample(pool, 2)
            prompt = rng.choice(TASKS).format(topic=topic, other=other)
            prompt = prompt[0].upper() + prompt[1:]
        prompts[prompt] = None
    return list(prompts)


def held_out(count: int, *, seed: int = 1) -> list[str]:
    """Prompts about topics the bundled training set never uses (no code or arithmetic)."""
    rng = random.Random(seed)
    prompts: dict[str, None] = {}
    while len(prompts) < count:
        topic, other = rng.sample(HELD_OUT_TOPICS, 2)
        prompt = rng.choice(TASKS).format(topic=topic, other=other)
        prompts[prompt[0].upper() + prompt[1:]] = None
    return list(prompts)


def as_messages(prompt: str) -> Messages:
    return [{"role": "user", "content": prompt}]


def read_jsonl(path: Path) -> Iterator[Messages]:
    """Conversations from a user's JSONL; a clear error names the first bad line."""
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                yield as_messages(record["prompt"])
            elif isinstance(record, dict) and _is_messages(record.get("messages")):
                yield record["messages"]
            else:
                raise ValueError(
                    f'{path}:{number}: expected {{"prompt": "..."}} or '
                    '{"messages": [{"role": "...", "content": "..."}, ...]}'
                )


def _is_messages(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )
