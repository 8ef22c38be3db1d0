"""Resolved configurations handed to vLLM 0.32's own `create_engine_config`.

That builds the full VllmConfig (target and draft model configs, speculative config,
scheduler and cache config) from each directory's `config.json`, without loading weights or
starting an engine, so it shows what vLLM really makes of the translation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.vllm.config.args import parse_worker_args

CONFIG_DIR = Path(__file__).resolve().parents[3] / "engine_configs"
SMALL = ["--block-size", "32", "--max-model-len", "1024", "--enforce-eager", "--dry-run"]


def vllm_config(argv: list[str]):
    cfg = parse_worker_args([*argv, *SMALL])
    return cfg, cfg.engine_args.create_engine_config()


@pytest.mark.parametrize("name", ["ngram.yaml", "native/ngram.yaml", "native/ngram_dynamic.yaml"])
def test_ngram_examples(tiny_model: Path, name: str) -> None:
    _, config = vllm_config(
        ["--model", str(tiny_model), "--extra-engine-args", str(CONFIG_DIR / name)]
    )
    spec = config.speculative_config
    assert spec.method == "ngram"
    assert spec.num_speculative_tokens == 3
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, 3)
    assert config.scheduler_config.max_num_seqs == 16
    assert config.model_config.max_model_len == 1024  # the CLI beat the file's 2048
    assert config.cache_config.block_size == 32
    if name.endswith("dynamic.yaml"):
        assert spec.num_speculative_tokens_per_batch_size == [(1, 4, 3), (5, 8, 2), (9, 16, 1)]


def test_trtllm_eagle_with_eagle3_draft(tiny_model: Path, eagle3_draft: Path, write_yaml) -> None:
    path = write_yaml(
        "max_batch_size: 4\n"
        "speculative_config:\n"
        "  decoding_type: Eagle\n"
        "  max_draft_len: 3\n"
        f"  speculative_model_dir: {eagle3_draft}\n"
        "  eagle3_one_model: true\n"
    )
    _, config = vllm_config(["--model", str(tiny_model), "--extra-engine-args", str(path)])
    spec = config.speculative_config
    assert spec.method == "eagle3"
    assert spec.num_speculative_tokens == 3
    assert spec.draft_model_config.architectures == ["LlamaForCausalLMEagle3"]
    # The engine-level max_model_len applies to the draft as well.
    assert spec.draft_model_config.max_model_len == 1024


def test_trtllm_eagle_with_eagle1_draft(tiny_model: Path, eagle1_draft: Path, write_yaml) -> None:
    path = write_yaml(
        "speculative_config:\n"
        "  decoding_type: Eagle\n"
        "  max_draft_len: 2\n"
        f"  pytorch_weights_path: {eagle1_draft}\n"
    )
    _, config = vllm_config(["--model", str(tiny_model), "--extra-engine-args", str(path)])
    assert config.speculative_config.method == "eagle"
    assert config.speculative_config.draft_model_config.architectures == ["EagleLlamaForCausalLM"]


def test_trtllm_mtp_on_a_target_with_mtp_layers(tiny_mtp_model: Path) -> None:
    path = CONFIG_DIR / "mtp_decode.yaml"
    cfg, config = vllm_config(
        ["--model", str(tiny_mtp_model), "--extra-engine-args", str(path), "--is-decode-worker"]
    )
    assert config.speculative_config.method == "mtp"
    assert config.speculative_config.num_speculative_tokens == 1
    assert config.speculative_config.draft_model_config.architectures == ["DeepSeekMTPModel"]
    assert config.kv_transfer_config.kv_connector == "DiskKvConnector"
    assert config.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert cfg.engine_args.enable_prefix_caching is False and config.kv_events_config is None


def test_speculators_checkpoint(speculators_checkpoint: Path, tiny_model: Path) -> None:
    _, config = vllm_config(["--model", str(speculators_checkpoint), "--seed", "5"])
    assert config.model_config.model == str(tiny_model.resolve())
    spec = config.speculative_config
    assert spec.method == "eagle3"
    assert spec.num_speculative_tokens == 4
    assert spec.draft_model_config.model == str(speculators_checkpoint)
    assert spec.draft_model_config.seed == 5
    assert spec.draft_model_config.max_model_len == 1024


def test_kv_layout_counts_draft_layers_only_for_drafters_that_keep_kv(
    tiny_model: Path, tiny_mtp_model: Path, eagle3_draft: Path, write_yaml
) -> None:
    """What a prefill/decode pair must share (`dynamo.vllm.kv_transfer.layout`): n-gram keeps no KV,
    so a plain prefill worker may feed an n-gram decode worker; MTP and Eagle3 do."""
    from dynamo.vllm.kv_transfer.layout import describe_kv_layout

    def layout(model: Path, *extra: str) -> str:
        return describe_kv_layout(vllm_config(["--model", str(model), *extra])[1])

    plain = layout(tiny_model)
    assert plain == layout(tiny_model, "--extra-engine-args", str(CONFIG_DIR / "ngram.yaml"))
    assert "no draft layers" in plain and "block 32" in plain
    eagle3 = write_yaml(
        f"speculative_config:\n  method: eagle3\n  model: {eagle3_draft}\n  num_speculative_tokens: 3\n"
    )
    with_eagle3 = layout(tiny_model, "--extra-engine-args", str(eagle3))
    assert with_eagle3 != plain and "(eagle3)" in with_eagle3
    mtp = layout(tiny_mtp_model, "--extra-engine-args", str(CONFIG_DIR / "mtp_decode.yaml"))
    assert "draft layers (mtp)" in mtp
    assert mtp != layout(tiny_mtp_model)
