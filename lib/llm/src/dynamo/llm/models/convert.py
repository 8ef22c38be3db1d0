"""GGUF → Hugging Face safetensors directory (the one step that needs torch and transformers).

Facts this relies on (transformers 5.x with `gguf` installed):

* `from_pretrained(dir, gguf_file=...)` reads the GGUF. Asked explicitly with
  `GgufConfig(dequantize=True)`, every block is unpacked into a dense float32 tensor, whatever
  kernels happen to be installed (without it, transformers may keep the weights packed when a
  GGUF matmul kernel is available, and the state dict would hold raw blocks).
* A model loaded from GGUF can still be marked quantized (`config.quantization_config`,
  `hf_quantizer`), and such a model refuses `save_pretrained`. So the weights are copied into
  a plain `AutoModelForCausalLM.from_config(config)` built from a config without
  `quantization_config`, and that model is saved. The copy also casts to the recipe dtype.
* The GGUF tokenizer converts to a fast tokenizer with the chat template embedded in the
  GGUF metadata; `save_pretrained` writes `tokenizer.json`, `tokenizer_config.json` and
  `chat_template.jinja`.

Everything heavy is imported inside functions so that importing this module is free.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynamo.llm.models.recipes import ModelRecipe

Log = Callable[[str], None]

# Keys transformers 5 writes into tokenizer_config.json that describe how *this* process
# loaded the tokenizer, not the tokenizer; they would leak into every later load.
_LOAD_TIME_KEYS = ("is_local", "local_files_only", "gguf_file", "name_or_path")
# Understood by transformers 4.x and 5.x alike (in 5.x it names the tokenizers backend).
_PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


class ConversionError(RuntimeError):
    """The GGUF could not be turned into a consistent Hugging Face directory."""


def convert_gguf(recipe: ModelRecipe, gguf: Path, out_dir: Path, *, log: Log = print) -> None:
    """Write the Hugging Face directory for `recipe` from `gguf` into the empty `out_dir`."""
    tokenizer = _load_tokenizer(gguf)
    model = _load_dense(recipe, gguf)
    _set_special_token_ids(model, tokenizer)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _normalise_tokenizer_config(out_dir / "tokenizer_config.json", recipe, tokenizer)


def tool_versions() -> dict[str, str]:
    """Versions of the libraries the conversion ran with (recorded in the manifest)."""
    import gguf as gguf_lib
    import safetensors
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "gguf": getattr(gguf_lib, "__version__", "unknown"),
    }


def _quiet_transformers() -> None:
    """Progress bars and load-report chatter would drown the step log."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _load_tokenizer(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    _quiet_transformers()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _load_dense(recipe: ModelRecipe, gguf: Path) -> Any:
    """The GGUF weights in a plain (never-quantized) model of the recipe dtype."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    _quiet_transformers()
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype = getattr(torch, recipe.dtype)
    config.dtype = dtype
    dense = AutoModelForCausalLM.from_config(config, dtype=dtype)
    result = dense.load_state_dict(loaded.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConversionError(
            f"state dict mismatch: missing={result.missing_keys[:5]} "
            f"unexpected={result.unexpected_keys[:5]}"
        )
    _check_dense(dense, dtype)
    return dense


def _check_dense(model: Any, dtype: Any) -> None:
    import torch

    for name, tensor in model.state_dict().items():
        if tensor.dtype != dtype:
            raise ConversionError(f"{name} has dtype {tensor.dtype}, expected {dtype}")
        if not torch.isfinite(tensor).all():
            raise ConversionError(f"{name} holds non-finite values after dequantization")


def _set_special_token_ids(model: Any, tokenizer: Any) -> None:
    """Make config.json and generation_config.json agree with the tokenizer's special tokens.

    Serving stops on `generation_config.eos_token_id`; for a chat model that must be the
    end-of-turn token the chat template emits (`<|im_end|>` for SmolLM2), or generation runs
    on into invented turns.
    """
    from transformers import GenerationConfig

    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if eos is None:
        raise ConversionError("the GGUF tokenizer defines no eos token")
    model.config.eos_token_id, model.config.bos_token_id, model.config.pad_token_id = eos, bos, pad
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def _normalise_tokenizer_config(path: Path, recipe: ModelRecipe, tokenizer: Any) -> None:
    """Portable tokenizer_config.json: class name old and new transformers know, a real
    `model_max_length`, and the chat template inline too (transformers < 4.43 reads it only
    from here; newer ones prefer chat_template.jinja, which holds the same text)."""
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in _LOAD_TIME_KEYS:
        config.pop(key, None)
    config["tokenizer_class"] = _PORTABLE_TOKENIZER_CLASS
    config["model_max_length"] = recipe.model_max_length
    if not tokenizer.chat_template:
        raise ConversionError("the GGUF carries no chat template")
    config["chat_template"] = tokenizer.chat_template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
