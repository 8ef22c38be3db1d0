"""A tiny Hugging Face tokenizer, trained in-process, for tests that need a real one.

Tests of tokenization, chat templating and incremental detokenization need a real
tokenizer (a `tokenizer.json`, special tokens, a chat template, the Rust fast path), but
not a real model: preparing the embedded model downloads and converts hundreds of
megabytes. `build_tiny_tokenizer` trains a small byte-level BPE on `TRAINING_TEXT` in well
under a second and saves it as a Hugging Face tokenizer directory, which the code under
test then loads the way it loads any model's tokenizer.

It is shaped like SmolLM2's so that the same code paths run:

* byte-level BPE: GPT-2's byte alphabet, a `ByteLevel` pre-tokenizer and decoder;
* special tokens `<|endoftext|>` (unknown), `<|im_start|>` (BOS) and `<|im_end|>` (EOS and
  padding), the first ids of the vocabulary; encoding adds none of them;
* a ChatML chat template that adds a default system turn when the conversation has none.

What tests may rely on (and should check where their claim depends on it):

* training merges until no pair is left, so every word of `TRAINING_TEXT`, as the
  pre-tokenizer cuts it (with its leading space), is one token;
* `TRAINING_TEXT` is ASCII, so every multi-byte UTF-8 character (accented letters, CJK,
  emoji) is split into one token per byte, and decoding one of those tokens alone gives
  U+FFFD;
* ids beyond the vocabulary (`len(tokenizer)`) are invalid; the vocabulary is a few
  hundred tokens.

Import `tokenizers` and `transformers` lazily: both are slow to import and only the tests
that build a tokenizer need them.
"""

from __future__ import annotations

from pathlib import Path

UNKNOWN_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (UNKNOWN_TOKEN, BOS_TOKEN, EOS_TOKEN)
"""In vocabulary order: the trainer gives them the first ids, 0, 1 and 2."""
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)
"""For test doubles that must know the EOS id before a tokenizer is loaded."""

DEFAULT_SYSTEM_PROMPT = "You are a tiny test model."

TRAINING_TEXT = """\
Hello there, friend. Say hello to the world. Hi there, how are you?
Once upon a time there was a small model that could only say a few words.
The answer is forty-two. Be brief. See you soon, ok?
One two three four five. one two three four five six seven eight nine ten.
hello world, hello again. Good morning and good night.
system user assistant
You are a tiny test model.
"""
"""ASCII only (see the module docstring). Every word here is a single token."""

CHAT_TEMPLATE = (
    "{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML, with a default system turn as SmolLM2's template has."""

MODEL_MAX_LENGTH = 2048


def build_tiny_tokenizer(directory: str | Path) -> Path:
    """Train the tiny tokenizer and save it (`save_pretrained`) into `directory`.

    Returns the directory, ready for `AutoTokenizer.from_pretrained`. Deterministic: the
    same text and settings give the same vocabulary and merges every time.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=4096,  # more than the text can fill: merging stops when no pair is left
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TRAINING_TEXT.splitlines(), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNKNOWN_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(path))
    return path
