"""Prompts as the e2e tests send them straight to a worker: chat-templated token ids."""

from __future__ import annotations


def chat_ids(tokenizer, text: str) -> list[int]:
    """`text` as one user turn through the model's chat template, ready for generation."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
