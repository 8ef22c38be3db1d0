"""The pure translation rules of `dynamo.vllm.speculative.config_sources` (no vLLM involved).

Claims: every TensorRT-LLM form docs/speculative_decoding.md lists translates to the
stated vLLM keys; Eagle becomes eagle or eagle3 by the draft checkpoint; keys without vLLM
meaning are collected, contradictions and unknown decoding types are errors; speculators
checkpoints yield verifier + proposal; speculative layers merge with the documented precedence.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_config_support import TINY_LLAMA, speculators_config, write_config

from dynamo.vllm.speculative import config_sources as sc
from dynamo.vllm.speculative.config_sources import ConfigError
from dynamo.vllm.speculative.speculators_checkpoint import (
    detect_eagle_method,
    read_speculators_checkpoint,
)
from dynamo.vllm.speculative.trtllm_translation import schedule_from_thresholds

# A stand-in for AsyncEngineArgs' field names: the translation only needs membership.
ENGINE_FIELDS = {
    "model",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "gpu_memory_utilization",
    "enable_prefix_caching",
    "kv_cache_dtype",
    "trust_remote_code",
    "enable_chunked_prefill",
    "block_size",
}
SPEC_FIELDS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "num_speculative_tokens_per_batch_size",
    "draft_tensor_parallel_size",
    "max_model_len",
}


def translate(raw: dict) -> sc.EngineFileConfig:
    return sc.translate_engine_config(raw, ENGINE_FIELDS, speculative_fields=SPEC_FIELDS)


def translate_spec(speculative_config: dict) -> sc.EngineFileConfig:
    """`translate` of an engine config with only a `speculative_config`."""
    return translate({"speculative_config": speculative_config})


# --------------------------------------------------------------------------- top level


def test_trtllm_top_level_keys_are_renamed() -> None:
    out = translate(
        {
            "max_batch_size": 8,
            "max_num_tokens": 4096,
            "max_seq_len": 2048,
            "tensor_parallel_size": 2,
            "kv_cache_config": {
                "free_gpu_memory_fraction": 0.6,
                "enable_block_reuse": False,
                "dtype": "fp8",
            },
        }
    )
    assert out.form == "tensorrt-llm"
    assert out.engine == {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 4096,
        "max_model_len": 2048,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.6,
        "enable_prefix_caching": False,
        "kv_cache_dtype": "fp8",
    }
    assert out.origin["max_num_seqs"] == "max_batch_size"
    assert out.origin["gpu_memory_utilization"] == "kv_cache_config.free_gpu_memory_fraction"
    assert out.speculative is None
    assert out.ignored == []


def test_native_file_keeps_vllm_keys_and_speculative_mapping() -> None:
    out = translate(
        {
            "max_model_len": 1024,
            "enable-prefix-caching": True,
            "speculative_config": {"method": "ngram", "num-speculative-tokens": 3},
        }
    )
    assert out.form == "native"
    assert out.engine == {"max_model_len": 1024, "enable_prefix_caching": True}
    assert out.speculative == {"method": "ngram", "num_speculative_tokens": 3}


def test_keys_without_vllm_meaning_are_collected_in_one_list() -> None:
    out = translate(
        {
            "backend": "pytorch",
            "max_batch_size": 4,
            "cuda_graph_config": {"max_batch_size": 4},
            "kv_cache_config": {"host_cache_size": 10, "enable_block_reuse": True},
            "speculative_config": {
                "decoding_type": "NGram",
                "max_draft_len": 2,
                "is_keep_all": True,
                "is_public_pool": False,
            },
        }
    )
    assert out.ignored == [
        "backend",
        "cuda_graph_config",
        "kv_cache_config.host_cache_size",
        "speculative_config.is_keep_all",
        "speculative_config.is_public_pool",
    ]
    assert out.engine == {"max_num_seqs": 4, "enable_prefix_caching": True}


def test_contradicting_spellings_in_one_file_are_an_error() -> None:
    with pytest.raises(ConfigError, match=r"max_seq_len=4096 contradicts max_model_len=2048"):
        translate({"max_seq_len": 4096, "max_model_len": 2048})
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        translate({"enable_prefix_caching": True, "kv_cache_config": {"enable_block_reuse": False}})


def test_agreeing_spellings_in_one_file_are_fine() -> None:
    out = translate({"max_seq_len": 2048, "max_model_len": 2048, "max_batch_size": 4})
    assert out.engine == {"max_model_len": 2048, "max_num_seqs": 4}


def test_engine_file_must_be_a_mapping(write_yaml) -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        sc.load_engine_file(write_yaml("- a\n- b\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        sc.load_engine_file(write_yaml("a: [1, 2\n"))
    with pytest.raises(ConfigError, match="No such file"):
        sc.load_engine_file("/nonexistent/engine.yaml")
    assert sc.load_engine_file(write_yaml("# only a comment\n")) == {}


# --------------------------------------------------------------------------- decoding types


@pytest.mark.parametrize(
    ("draft", "weights_key", "k", "one_model", "method"),
    [
        ("eagle3_draft", "speculative_model_dir", 3, True, "eagle3"),
        ("eagle1_draft", "pytorch_weights_path", 2, False, "eagle"),
    ],
)
def test_eagle_becomes_the_generation_of_its_draft(
    request: pytest.FixtureRequest,
    draft: str,
    weights_key: str,
    k: int,
    one_model: bool,
    method: str,
) -> None:
    """TensorRT-LLM's one "Eagle" decoding type becomes vLLM's eagle or eagle3 by the draft
    checkpoint's config, wherever the file names the draft (`eagle3_one_model` is
    informational, not warned about)."""
    path = str(request.getfixturevalue(draft))
    out = translate_spec(
        {
            "decoding_type": "Eagle",
            "max_draft_len": k,
            weights_key: path,
            "eagle3_one_model": one_model,
        }
    )
    assert out.speculative == {"model": path, "num_speculative_tokens": k, "method": method}
    assert out.ignored == []
    if method == "eagle3":
        assert any("eagle3" in note and "LlamaForCausalLMEagle3" in note for note in out.notes)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"speculators_model_type": "eagle3"}, "eagle3"),
        ({"architectures": ["Eagle3LlamaForCausalLM"]}, "eagle3"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}}, "eagle3"),
        ({"draft_vocab_size": 32000}, "eagle3"),
        ({"architectures": ["EagleLlamaForCausalLM"]}, "eagle"),
        ({"architectures": ["LlamaForCausalLM"]}, "eagle"),
    ],
)
def test_eagle_generation_comes_from_the_checkpoint_config(
    tmp_path: Path, config: dict, expected: str
) -> None:
    draft = write_config(tmp_path / "some-draft", {**TINY_LLAMA, **config})
    assert detect_eagle_method(draft)[0] == expected


def test_eagle_generation_falls_back_to_the_name_without_a_local_config() -> None:
    assert detect_eagle_method("/models/EAGLE3-LLaMA3.1-Instruct-8B")[0] == "eagle3"
    method, reason = detect_eagle_method("yuhuili/EAGLE-LLaMA3-Instruct-8B")
    assert method == "eagle"
    assert "no local config.json" in reason


def test_eagle_without_a_draft_is_an_error() -> None:
    with pytest.raises(ConfigError, match="Eagle needs the draft checkpoint"):
        translate_spec({"decoding_type": "Eagle", "max_draft_len": 3})


@pytest.mark.parametrize(
    ("speculative_config", "speculative", "ignored"),
    [
        pytest.param(
            {"decoding_type": "Eagle3", "max_draft_len": 4, "speculative_model": "/models/any-draft",
             "eagle3_layers_to_capture": [1, 2, 3]},
            {"model": "/models/any-draft", "num_speculative_tokens": 4, "method": "eagle3"},
            ["speculative_config.eagle3_layers_to_capture"],
            id="eagle3-with-the-newer-model-key",
        ),
        pytest.param(
            {"decoding_type": "MTP", "num_nextn_predict_layers": 2,
             "use_relaxed_acceptance_for_thinking": True},
            {"method": "mtp", "num_speculative_tokens": 2},  # native MTP, never n-gram
            ["speculative_config.use_relaxed_acceptance_for_thinking"],
            id="mtp",
        ),
        pytest.param(
            {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 3},
            {"num_speculative_tokens": 4, "method": "ngram", "prompt_lookup_max": 3,
             "prompt_lookup_min": 1},
            [],
            id="ngram",
        ),
        pytest.param(
            {"decoding_type": "ngram", "prompt_lookup_num_tokens": 2},
            {"method": "ngram", "num_speculative_tokens": 2},
            [],
            id="ngram-older-spelling",
        ),
        pytest.param(
            {"decoding_type": "NGram", "max_draft_len": 2, "speculative_model_dir": "/x"},
            {"num_speculative_tokens": 2, "method": "ngram"},  # the draft path is not used
            ["speculative_config.speculative_model_dir"],
            id="ngram-draft-path-reported",
        ),
        pytest.param(
            {"decoding_type": "DraftTarget", "max_draft_len": 2,
             "speculative_model_dir": "/models/small"},
            {"model": "/models/small", "num_speculative_tokens": 2, "method": "draft_model"},
            [],
            id="draft-target-becomes-draft-model",
        ),
    ],
)  # fmt: skip
def test_decoding_types_translate_to_vllm_keys(
    speculative_config: dict, speculative: dict, ignored: list[str]
) -> None:
    """Each decoding type's keys become vLLM's; keys without vLLM meaning are reported."""
    out = translate_spec(speculative_config)
    assert out.speculative == speculative
    assert out.ignored == ignored


@pytest.mark.parametrize(
    ("speculative_config", "message"),
    [
        pytest.param(
            {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model_dir": "/a",
             "pytorch_weights_path": "/b"},
            "speculative_model_dir='/a' contradicts",
            id="two-different-draft-paths",
        ),
        pytest.param(
            {"decoding_type": "MTP", "max_draft_len": 3, "num_nextn_predict_layers": 1},
            "max_draft_len=3 contradicts num_nextn_predict_layers=1",
            id="mtp-layer-count-contradicting-max-draft-len",
        ),
        pytest.param(
            {"decoding_type": "NGram", "max_matching_ngram_size": 2},
            "NGram needs max_draft_len",
            id="ngram-without-length",
        ),
        pytest.param(
            {"decoding_type": "DraftTarget", "max_draft_len": 2},
            "DraftTarget needs speculative_model_dir",
            id="draft-target-without-draft",
        ),
    ],
)  # fmt: skip
def test_incomplete_or_contradicting_speculative_configs_are_errors(
    speculative_config: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        translate_spec(speculative_config)


def test_mtp_without_layer_count_uses_trtllm_default_of_one() -> None:
    out = translate_spec({"decoding_type": "MTP"})
    assert out.speculative == {"method": "mtp", "num_speculative_tokens": 1}
    assert any("num_nextn_predict_layers" in note for note in out.notes)


@pytest.mark.parametrize("decoding_type", ["Medusa", "Lookahead", "UserProvided", "nonsense"])
def test_unknown_decoding_type_is_an_error(decoding_type: str) -> None:
    with pytest.raises(ConfigError) as info:
        translate_spec({"decoding_type": decoding_type, "max_draft_len": 2})
    message = str(info.value)
    assert repr(decoding_type) in message
    assert "Eagle, Eagle3, MTP, NGram, DraftTarget" in message


def test_native_keys_inside_a_trtllm_mapping_must_agree() -> None:
    spec = {"decoding_type": "NGram", "max_draft_len": 3, "num_speculative_tokens": 3}
    assert translate_spec(spec).speculative["num_speculative_tokens"] == 3
    with pytest.raises(ConfigError, match="contradicts num_speculative_tokens=5"):
        translate_spec({**spec, "num_speculative_tokens": 5})


# --------------------------------------------------------------------------- dynamic K


def test_draft_len_schedule_becomes_inclusive_ranges() -> None:
    out = translate_spec(
        {
            "decoding_type": "NGram",
            "max_draft_len": 4,
            "draft_len_schedule": {1: 4, 4: 2, 8: 0},
        }
    )
    assert out.speculative["num_speculative_tokens_per_batch_size"] == [
        [1, 3, 4],
        [4, 7, 2],
        [8, 8, 0],
    ]


def test_max_concurrency_turns_speculation_off_above_it() -> None:
    out = translate_spec({"decoding_type": "NGram", "max_draft_len": 3, "max_concurrency": 8})
    assert out.speculative["num_speculative_tokens_per_batch_size"] == [[1, 8, 3], [9, 9, 0]]


def test_schedule_must_start_at_batch_size_one() -> None:
    with pytest.raises(ConfigError, match="start at batch size 1"):
        schedule_from_thresholds({2: 3})


def test_k_is_filled_from_the_schedule() -> None:
    spec = {"method": "ngram", "num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 8, 2]]}
    assert "largest K" in sc.fill_k_from_schedule(spec)
    assert spec["num_speculative_tokens"] == 5
    capped = {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 5]]}
    assert "caps it" in sc.fill_k_from_schedule(capped)
    assert capped["num_speculative_tokens"] == 2


# --------------------------------------------------------------------------- speculators


def test_plain_model_is_not_a_speculators_checkpoint(tiny_model: Path) -> None:
    assert read_speculators_checkpoint(tiny_model) is None
    assert read_speculators_checkpoint("/nonexistent") is None


def test_speculators_checkpoint_yields_verifier_and_proposal(speculators_checkpoint: Path) -> None:
    ckpt = read_speculators_checkpoint(speculators_checkpoint)
    assert ckpt is not None
    assert ckpt.verifier == "../tiny-llama"
    assert ckpt.speculative == {
        "method": "eagle3",
        "model": str(speculators_checkpoint),
        "num_speculative_tokens": 4,
    }


def test_speculators_default_proposal_method_is_honoured(tmp_path: Path) -> None:
    config = speculators_config("/v")
    config["speculators_config"]["proposal_methods"] = [
        {"proposal_type": "tree", "speculative_tokens": 7},
        {"proposal_type": "greedy", "speculative_tokens": 3},
    ]
    ckpt = read_speculators_checkpoint(write_config(tmp_path / "c", config))
    assert ckpt.speculative["num_speculative_tokens"] == 3


def test_speculators_peagle_means_parallel_eagle3(tmp_path: Path) -> None:
    ckpt = read_speculators_checkpoint(
        write_config(tmp_path / "p", speculators_config("/v", kind="peagle"))
    )
    assert ckpt.speculative["method"] == "eagle3"
    assert ckpt.speculative["parallel_drafting"] is True


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            # Eagle-1 speculators checkpoints exist, but vLLM 0.32 cannot load them as a draft.
            lambda c: c.update(speculators_model_type="eagle"),
            "speculators_model_type 'eagle' is not supported",
        ),
        (lambda c: c["speculators_config"].pop("verifier"), "verifier.name_or_path is missing"),
        (lambda c: c["speculators_config"].update(proposal_methods=[]), "proposal_methods"),
        (
            lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"),
            "no speculative_tokens",
        ),
    ],
)
def test_broken_speculators_checkpoints_are_errors(tmp_path: Path, mutate, message: str) -> None:
    config = speculators_config("/v")
    mutate(config)
    path = tmp_path / "broken"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        read_speculators_checkpoint(path)


# --------------------------------------------------------------------------- merging / checks


def test_layers_merge_key_by_key_with_sources() -> None:
    merged = sc.merge_speculative_layers(
        [
            ("ckpt", {"method": "eagle3", "model": "/d", "num_speculative_tokens": 4}),
            ("file", {"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}),
            ("json", {"num-speculative-tokens": 3}),
            ("flags", None),
        ]
    )
    assert merged.values == {
        "method": "eagle3",
        "model": "/d",
        "num_speculative_tokens": 3,
        "draft_tensor_parallel_size": 1,
    }
    assert merged.sources == {
        "method": "ckpt",
        "model": "ckpt",
        "num_speculative_tokens": "json",
        "draft_tensor_parallel_size": "file",
    }


def test_a_different_method_replaces_the_lower_layers() -> None:
    merged = sc.merge_speculative_layers(
        [
            ("file", {"method": "eagle3", "model": "/d", "num_speculative_tokens": 4}),
            ("json", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}),
        ]
    )
    assert merged.values == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    assert merged.notes and "dropped" in merged.notes[0]


def test_no_layers_means_no_speculation() -> None:
    assert sc.merge_speculative_layers([("file", None), ("json", {})]).values is None


def test_check_speculative_rejects_what_vllm_would_reject_late() -> None:
    allowed = {"ngram", "eagle3", "mtp"}
    with pytest.raises(ConfigError, match="unknown keys max_draft_len"):
        sc.check_speculative(
            {"method": "ngram", "max_draft_len": 3},
            allowed_keys=SPEC_FIELDS,
            allowed_methods=allowed,
        )
    with pytest.raises(ConfigError, match=r"'eagle4' is not a vLLM 0\.32 method"):
        sc.check_speculative(
            {"method": "eagle4"}, allowed_keys=SPEC_FIELDS, allowed_methods=allowed
        )
    with pytest.raises(ConfigError, match="eagle3 needs a draft checkpoint"):
        sc.check_speculative(
            {"method": "eagle3", "num_speculative_tokens": 3},
            allowed_keys=SPEC_FIELDS,
            allowed_methods=allowed,
        )
    sc.check_speculative(
        {"method": "mtp", "num_speculative_tokens": 1},
        allowed_keys=SPEC_FIELDS,
        allowed_methods=allowed,
    )
