"""`dynamo.vllm.config.args.parse_worker_args`: vLLM's parser plus the worker's layering.

Claims: runtime defaults and environment fallbacks; disaggregation aliases and their
conflicts; precedence YAML < --speculative-config JSON < explicit CLI flags for both engine
and speculative keys; speculators checkpoints become verifier target + draft; engine flags
apply to the draft; one warning for ignored keys; CPU block-size rule; KV events and KV
transfer defaults; the resolved-config report; --speculation-profile sets only the
schedule, on top, and refuses to meet no speculation, another method, another schedule or
a K cap below its largest K.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.platforms import current_platform
from vllm_config_support import speculators_config, write_config

from dynamo.llm.speculation_profile import SpeculationProfile, StepTimes, save_profile
from dynamo.testing.environment import unset_variables_fixture
from dynamo.vllm.config.args import ConfigError, parse_worker_args
from dynamo.vllm.config.report import resolved_config_lines, resolved_config_yaml
from dynamo.vllm.config.speculative_resolution import SRC_PREFIX_DEFAULT
from dynamo.vllm.speculative.adaptive_k import SCHEDULER_CLS, adaptive_entry

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


_clean_env = unset_variables_fixture("NATS_SERVER", "DYN_SYSTEM_PORT", "DYN_KV_SHARED_STORAGE_PATH")


# --------------------------------------------------------------------------- runtime flags


def test_runtime_defaults(parse, tiny_model: Path) -> None:
    cfg = parse()
    assert isinstance(cfg.engine_args, AsyncEngineArgs)
    assert cfg.disaggregation_mode == "agg"
    assert (cfg.namespace, cfg.component, cfg.endpoint) == ("dynamo", "backend", "generate")
    assert cfg.served_model_name == "tiny-llama"
    assert cfg.model_path == tiny_model
    assert cfg.engine_args.model == str(tiny_model)
    assert cfg.engine_args.served_model_name == ["tiny-llama"]
    assert cfg.nats_server == "nats://127.0.0.1:4222"
    assert cfg.lease_ttl == 5.0
    assert cfg.system_port is None
    assert cfg.migration_limit == 3  # migration on by default (aggregated)
    assert cfg.drain_timeout_s == 30.0
    assert cfg.dry_run is True
    assert cfg.engine_args.speculative_config is None
    assert cfg.engine_args.kv_transfer_config is None


def test_explicit_served_model_name_wins(parse) -> None:
    cfg = parse("--served-model-name", "my-model", "alias")
    assert cfg.served_model_name == "my-model"
    assert cfg.engine_args.served_model_name == ["my-model", "alias"]
    assert cfg.sources["served_model_name"] == "cli"


def test_environment_fallbacks(parse, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_SERVER", "nats://nats.example:4333")
    monkeypatch.setenv("DYN_SYSTEM_PORT", "0")
    cfg = parse()
    assert cfg.nats_server == "nats://nats.example:4333"
    assert cfg.system_port == 0
    cfg = parse("--nats-server", "nats://other:1", "--system-port", "9345")
    assert (cfg.nats_server, cfg.system_port) == ("nats://other:1", 9345)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ((), 3),
        (("--is-decode-worker",), 3),
        (("--is-prefill-worker",), 0),  # a prefill leg is never migrated
        (("--migration-limit", "0"), 0),
        (("--is-prefill-worker", "--migration-limit", "2"), 2),
    ],
)
def test_migration_limit_defaults_by_role(parse, argv: tuple[str, ...], expected: int) -> None:
    assert parse(*argv).migration_limit == expected


def test_runtime_flags_are_validated(parse, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="--lease-ttl: must be > 0"):
        parse("--lease-ttl", "0")
    with pytest.raises(ConfigError, match="--migration-limit: must be >= 0"):
        parse("--migration-limit", "-1")
    with pytest.raises(ConfigError, match="--migration-limit: not an integer"):
        parse("--migration-limit", "1.5")
    with pytest.raises(ConfigError, match="--drain-timeout: must be >= 0"):
        parse("--drain-timeout", "-5")
    assert parse("--drain-timeout", "2.5").drain_timeout_s == 2.5
    with pytest.raises(ConfigError, match="--system-port: must be a port between 0 and 65535"):
        parse("--system-port", "70000")
    with pytest.raises(ConfigError, match="--kv-events-port: must be a port between"):
        parse("--kv-events-port", "-1")
    monkeypatch.setenv("DYN_SYSTEM_PORT", "70000")
    with pytest.raises(ConfigError, match=r"^\$DYN_SYSTEM_PORT .*must be a port between"):
        parse()
    with pytest.raises(ConfigError, match="invalid choice"):
        parse("--disaggregation-mode", "both")


def test_default_model_is_the_embedded_one() -> None:
    from dynamo.vllm.config.args import build_parser

    assert build_parser().parse_args([]).model == "smollm2-135m-instruct"


def test_unknown_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown model"):
        parse_worker_args(["--model", "./no/such/model", "--dry-run"])


# --------------------------------------------------------------------------- disaggregation


@pytest.mark.parametrize(
    ("argv", "mode", "component"),
    [
        (["--is-prefill-worker"], "prefill", "prefill"),
        (["--disaggregation-mode", "prefill"], "prefill", "prefill"),
        (["--is-decode-worker"], "decode", "backend"),
        (["--is-decode-worker", "--disaggregation-mode", "decode"], "decode", "backend"),
        (["--is-prefill-worker", "--component", "pf"], "prefill", "pf"),
    ],
)
def test_disaggregation_aliases(parse, argv: list[str], mode: str, component: str) -> None:
    cfg = parse(*argv)
    assert cfg.disaggregation_mode == mode
    assert cfg.component == component


def test_prefill_and_decode_at_once_is_an_error(parse) -> None:
    with pytest.raises(ConfigError, match="mutually exclusive"):
        parse("--is-prefill-worker", "--is-decode-worker")
    with pytest.raises(
        ConfigError, match="--is-prefill-worker contradicts --disaggregation-mode decode"
    ):
        parse("--is-prefill-worker", "--disaggregation-mode", "decode")


def test_disaggregated_workers_get_a_kv_connector(parse, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse("--is-decode-worker", "--namespace", "ns1")
    transfer = cfg.engine_args.kv_transfer_config
    assert isinstance(transfer, KVTransferConfig)
    assert transfer.kv_connector == "DiskKvConnector"
    assert transfer.kv_connector_module_path == "dynamo.vllm.kv_transfer.disk_connector"
    assert transfer.kv_role == "kv_consumer"
    assert transfer.kv_load_failure_policy == "recompute"
    assert transfer.kv_connector_extra_config == {"shared_storage_path": "/tmp/dynamo-kv-ns1"}
    monkeypatch.setenv("DYN_KV_SHARED_STORAGE_PATH", "/shared/kv")
    cfg = parse("--is-prefill-worker")
    assert cfg.engine_args.kv_transfer_config.kv_role == "kv_both"
    assert cfg.engine_args.kv_transfer_config.kv_connector_extra_config == {
        "shared_storage_path": "/shared/kv"
    }
    given = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    cfg = parse("--is-prefill-worker", "--kv-transfer-config", given)
    assert cfg.engine_args.kv_transfer_config.kv_connector == "NixlConnector"


# --------------------------------------------------------------------------- precedence


def test_cli_overrides_file_engine_keys_and_sources_say_so(parse, write_yaml) -> None:
    path = write_yaml("max_seq_len: 2048\nmax_batch_size: 8\n")
    cfg = parse("--extra-engine-args", str(path), "--max-model-len", "1024")
    assert cfg.engine_args.max_model_len == 1024
    assert cfg.engine_args.max_num_seqs == 8
    assert cfg.sources["max_model_len"] == "cli"
    assert cfg.sources["max_num_seqs"] == "extra-engine-args (max_batch_size)"


def test_explicit_cli_value_equal_to_the_default_still_wins(parse, write_yaml) -> None:
    # --seed 0 is vLLM's default; given explicitly it must still beat the file's seed.
    path = write_yaml("seed: 7\n")
    assert parse("--extra-engine-args", str(path)).engine_args.seed == 7
    assert parse("--extra-engine-args", str(path), "--seed", "0").engine_args.seed == 0


def test_speculative_precedence_yaml_json_cli(parse, write_yaml) -> None:
    path = write_yaml(
        "speculative_config:\n"
        "  decoding_type: NGram\n"
        "  max_draft_len: 2\n"
        "  max_matching_ngram_size: 4\n"
    )
    cfg = parse("--extra-engine-args", str(path))
    assert cfg.speculative_config == {
        "num_speculative_tokens": 2,
        "method": "ngram",
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    cfg = parse(
        "--extra-engine-args",
        str(path),
        "--speculative-config",
        '{"num_speculative_tokens": 3, "prompt_lookup_max": 5}',
    )
    assert cfg.speculative_config["num_speculative_tokens"] == 3
    assert cfg.speculative_config["prompt_lookup_max"] == 5
    assert cfg.speculative_config["prompt_lookup_min"] == 1  # from the file, untouched
    assert cfg.sources["speculative_config.num_speculative_tokens"] == "--speculative-config"
    assert cfg.sources["speculative_config.prompt_lookup_min"] == "extra-engine-args"
    cfg = parse(
        "--extra-engine-args",
        str(path),
        "--speculative-config",
        '{"num_speculative_tokens": 3}',
        "--spec-tokens",
        "4",
    )
    assert cfg.speculative_config["num_speculative_tokens"] == 4
    assert cfg.sources["speculative_config.num_speculative_tokens"].startswith("--spec-method")
    # vLLM itself refuses --spec-tokens next to --speculative-config; folded, it never sees both.
    assert cfg.engine_args.spec_tokens is None


def test_dotted_speculative_config_flags_work(parse) -> None:
    cfg = parse(
        "--speculative-config.method",
        "ngram",
        "--speculative-config.num_speculative_tokens",
        "2",
        "--speculative-config.prompt_lookup_max",
        "2",
    )
    assert cfg.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 2,
    }


def test_json_naming_another_method_replaces_the_file(
    parse, write_yaml, eagle3_draft: Path
) -> None:
    path = write_yaml(
        "speculative_config:\n"
        "  decoding_type: Eagle\n"
        "  max_draft_len: 3\n"
        f"  speculative_model_dir: {eagle3_draft}\n"
    )
    assert parse("--extra-engine-args", str(path)).speculative_config["method"] == "eagle3"
    cfg = parse("--extra-engine-args", str(path), "--speculative-config", json.dumps(NGRAM))
    assert cfg.speculative_config == NGRAM


def test_explicit_engine_flags_apply_to_the_draft(parse) -> None:
    spec = {**NGRAM, "max_model_len": 4096, "enforce_eager": False, "draft_tensor_parallel_size": 1}
    cfg = parse("--speculative-config", json.dumps(spec))
    assert cfg.speculative_config["max_model_len"] == 4096  # no engine flag: draft keeps its own
    cfg = parse(
        "--speculative-config",
        json.dumps(spec),
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--tensor-parallel-size",
        "1",
    )
    assert cfg.speculative_config == NGRAM
    assert cfg.engine_args.max_model_len == 1024


def test_file_values_are_typed_by_vllms_parser(parse, write_yaml) -> None:
    path = write_yaml(
        "enforce_eager: true\n"
        "enable_prefix_caching: false\n"
        "max_num_batched_tokens: 2k\n"
        "kv_transfer_config: {kv_connector: ExampleConnector, kv_role: kv_both}\n"
    )
    args = parse("--extra-engine-args", str(path)).engine_args
    assert args.enforce_eager is True
    assert args.enable_prefix_caching is False
    assert args.max_num_batched_tokens == 2000
    assert isinstance(args.kv_transfer_config, KVTransferConfig)
    bad = write_yaml("max_model_len: lots\n", name="bad.yaml")
    with pytest.raises(ConfigError, match=r"bad.yaml: argument --max-model-len"):
        parse("--extra-engine-args", str(bad))


def test_file_contradictions_and_unknown_decoding_type_are_errors(parse, write_yaml) -> None:
    path = write_yaml("max_seq_len: 4096\nmax_model_len: 2048\n")
    with pytest.raises(ConfigError, match="contradicts"):
        parse("--extra-engine-args", str(path))
    path = write_yaml("speculative_config:\n  decoding_type: Lookahead\n  max_draft_len: 2\n")
    with pytest.raises(ConfigError, match="decoding_type 'Lookahead' is not supported"):
        parse("--extra-engine-args", str(path))


def test_one_warning_names_every_ignored_key(
    parse, write_yaml, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_yaml(
        "backend: pytorch\n"
        "max_batch_size: 4\n"
        "cuda_graph_config: {max_batch_size: 4}\n"
        "kv_cache_config: {host_cache_size: 1, enable_block_reuse: true}\n"
        "speculative_config: {decoding_type: NGram, max_draft_len: 2, is_keep_all: true}\n"
    )
    with caplog.at_level(logging.WARNING, logger="dynamo.vllm"):
        cfg = parse("--extra-engine-args", str(path))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    for key in (
        "backend",
        "cuda_graph_config",
        "kv_cache_config.host_cache_size",
        "speculative_config.is_keep_all",
    ):
        assert key in warnings[0]
    assert cfg.ignored_keys == [
        "backend",
        "cuda_graph_config",
        "kv_cache_config.host_cache_size",
        "speculative_config.is_keep_all",
    ]


# --------------------------------------------------------------------------- speculative checks


def test_bad_speculative_configs_fail_before_any_engine(parse) -> None:
    with pytest.raises(ConfigError, match="unknown keys max_draft_len"):
        parse("--speculative-config", '{"method": "ngram", "max_draft_len": 3}')
    with pytest.raises(ConfigError, match=r"not a vLLM 0\.32 method"):
        parse("--speculative-config", '{"method": "lookahead", "num_speculative_tokens": 3}')
    with pytest.raises(ConfigError, match="needs num_speculative_tokens"):
        parse("--speculative-config", '{"method": "ngram"}')
    with pytest.raises(ConfigError, match="must be a JSON object"):
        parse("--speculative-config", "[1, 2]")


def test_dynamic_schedule_passes_through_and_is_validated(parse) -> None:
    schedule = [[1, 4, 3], [5, 8, 1]]
    cfg = parse(
        "--speculative-config",
        json.dumps(
            {
                "method": "ngram",
                "prompt_lookup_max": 3,
                "num_speculative_tokens_per_batch_size": schedule,
            }
        ),
    )
    assert cfg.speculative_config["num_speculative_tokens_per_batch_size"] == schedule
    assert cfg.speculative_config["num_speculative_tokens"] == 3  # the schedule's largest K
    bad = {**NGRAM, "num_speculative_tokens_per_batch_size": [[2, 4, 3]]}
    with pytest.raises(ConfigError, match="must start at 1"):
        parse("--speculative-config", json.dumps(bad))


def test_embedded_model_name_as_draft_is_resolved(parse) -> None:
    from dynamo.llm.models import model_dir

    spec = {"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 2}
    cfg = parse("--speculative-config", json.dumps(spec))
    assert cfg.speculative_config["model"] == str(model_dir("smollm2-135m-instruct"))


# --------------------------------------------------------------------------- --speculation-profile

PROFILE_SCHEDULE = [[1, 2, 3], [3, 6, 2], [7, 8, 0]]


@pytest.fixture
def profile_file(tmp_path: Path):
    """Write a profile with synthetic numbers (n-gram unless told) and return its path."""

    def write(method: str = "ngram", schedule: list[list[int]] | None = None) -> Path:
        profile = SpeculationProfile(
            model="tiny-llama",
            method=method,
            speculative_config={"method": method},
            batch_sizes=[1, 4, 8],
            acceptance_per_position=[0.6, 0.4, 0.2],
            step_times=[
                StepTimes(k=k, step_ms=[10.0 + k, 12.0 + 2 * k, 15.0 + 4 * k]) for k in range(4)
            ],
            schedule=schedule or PROFILE_SCHEDULE,
            max_batch_size=8,
        )
        path = tmp_path / f"{method}-profile.json"
        save_profile(profile, path)
        return path

    return write


def test_profile_sets_the_schedule_on_top(parse, profile_file) -> None:
    path = profile_file()
    cfg = parse(
        "--spec-method",
        "ngram",
        "--speculative-config",
        '{"prompt_lookup_max": 3}',
        "--speculation-profile",
        str(path),
    )
    spec = cfg.speculative_config
    assert spec["num_speculative_tokens_per_batch_size"] == PROFILE_SCHEDULE
    assert spec["num_speculative_tokens"] == 3  # unset: filled with the schedule's largest K
    assert spec["prompt_lookup_max"] == 3
    assert cfg.speculation_profile is not None
    assert cfg.speculation_profile.schedule == PROFILE_SCHEDULE
    src = cfg.sources
    assert (
        src["speculative_config.num_speculative_tokens_per_batch_size"] == "--speculation-profile"
    )
    assert src["speculative_config.method"].startswith("--spec-method")
    assert src["speculative_config.num_speculative_tokens"].endswith("(--speculation-profile)")
    # An explicit K at least the schedule's largest stays; --dry-run shows the profile as source.
    cfg = parse(
        "--speculative-config",
        json.dumps({**NGRAM, "num_speculative_tokens": 4}),
        "--speculation-profile",
        str(path),
    )
    assert cfg.speculative_config["num_speculative_tokens"] == 4
    import yaml

    document = yaml.safe_load(resolved_config_yaml(cfg))
    assert document["engine"]["speculative_config"]["num_speculative_tokens_per_batch_size"] == (
        PROFILE_SCHEDULE
    )
    assert document["sources"]["speculative_config.num_speculative_tokens_per_batch_size"] == (
        "--speculation-profile"
    )
    assert parse().speculation_profile is None


def test_profile_without_speculation_is_refused(parse, profile_file, eagle3_draft: Path) -> None:
    path = profile_file()
    with pytest.raises(
        ConfigError,
        match=r"--speculation-profile needs a speculative method: no speculation is "
        r"configured, .*--spec-method ngram",
    ):
        parse("--speculation-profile", str(path))
    # A draft model alone leaves the method to vLLM's detection: nothing to check it against.
    spec = {"model": str(eagle3_draft), "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match=r"needs a speculative method: no method is named"):
        parse("--speculative-config", json.dumps(spec), "--speculation-profile", str(path))


def test_profile_of_another_method_is_refused(parse, profile_file, eagle3_draft: Path) -> None:
    spec = {"method": "eagle3", "model": str(eagle3_draft), "num_speculative_tokens": 3}
    with pytest.raises(
        ConfigError,
        match=r"measured with method ngram, but the worker runs eagle3 \(from --speculative-config\)",
    ):
        parse(
            "--speculative-config", json.dumps(spec), "--speculation-profile", str(profile_file())
        )


def test_profile_meeting_another_schedule_is_refused(parse, profile_file, write_yaml) -> None:
    path = profile_file()
    own = {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 8, 1]]}
    with pytest.raises(ConfigError, match=r"already has a schedule from --speculative-config"):
        parse("--speculative-config", json.dumps(own), "--speculation-profile", str(path))
    trtllm = write_yaml(
        "speculative_config:\n"
        "  decoding_type: NGram\n"
        "  max_draft_len: 3\n"
        "  draft_len_schedule: {1: 3, 4: 1}\n"
    )
    with pytest.raises(
        ConfigError, match=r"from extra-engine-args \(TensorRT-LLM draft_len_schedule"
    ):
        parse("--extra-engine-args", str(trtllm), "--speculation-profile", str(path))


def test_profile_schedule_above_the_k_cap_is_refused(parse, profile_file) -> None:
    with pytest.raises(
        ConfigError,
        match=r"schedule uses K=3 but num_speculative_tokens=2 caps it; raise num_speculative_tokens to 3",
    ) as err:
        parse(
            "--spec-method",
            "ngram",
            "--spec-tokens",
            "2",
            "--speculative-config",
            '{"prompt_lookup_max": 3}',
            "--speculation-profile",
            str(profile_file()),
        )
    assert "num_speculative_tokens from --spec-method" in str(err.value)


def test_missing_or_garbled_profile_is_a_clear_error(parse, tmp_path: Path, profile_file) -> None:
    missing = tmp_path / "nowhere.json"
    with pytest.raises(
        ConfigError, match=rf"--speculation-profile: cannot read speculation profile {missing}"
    ):
        parse("--spec-method", "ngram", "--spec-tokens", "3", "--speculation-profile", str(missing))
    garbled = tmp_path / "garbled.json"
    garbled.write_text('{"method": "ngram", ')
    with pytest.raises(ConfigError, match=rf"{garbled} is not a speculation profile"):
        parse("--spec-method", "ngram", "--spec-tokens", "3", "--speculation-profile", str(garbled))
    inconsistent = profile_file(schedule=[[1, 8, 7]])  # K=7, but measured up to K=3
    with pytest.raises(ConfigError, match=r"uses K outside 0\.\.3"):
        parse(
            "--spec-method",
            "ngram",
            "--spec-tokens",
            "3",
            "--speculation-profile",
            str(inconsistent),
        )


# --------------------------------------------------------------------------- speculators checkpoints


def test_speculators_checkpoint_as_model(speculators_checkpoint: Path, tiny_model: Path) -> None:
    cfg = parse_worker_args(
        [
            "--model",
            str(speculators_checkpoint),
            "--max-model-len",
            "1024",
            "--seed",
            "3",
            "--dry-run",
        ]
    )
    assert cfg.model_path == tiny_model.resolve()
    assert cfg.engine_args.model == str(tiny_model.resolve())
    assert cfg.speculators_checkpoint == speculators_checkpoint
    assert cfg.speculative_config == {
        "method": "eagle3",
        "model": str(speculators_checkpoint),
        "num_speculative_tokens": 4,
        "disable_eagle_block_drop": True,  # keep_whole_prefix_hit
    }
    assert cfg.served_model_name == "tiny-llama"
    assert (cfg.engine_args.max_model_len, cfg.engine_args.seed) == (1024, 3)
    assert cfg.sources["model"] == "speculators checkpoint verifier"
    assert cfg.sources["speculative_config.method"] == "speculators checkpoint"


def test_eagle_workers_reuse_the_whole_prefix_hit_unless_told(
    speculators_checkpoint: Path,
) -> None:
    argv = ["--model", str(speculators_checkpoint), "--dry-run"]
    cfg = parse_worker_args(argv)
    assert cfg.speculative_config["disable_eagle_block_drop"] is True
    assert cfg.sources["speculative_config.disable_eagle_block_drop"] == SRC_PREFIX_DEFAULT
    # An explicit value from any source wins, and is reported as that source's.
    told = json.dumps({"disable_eagle_block_drop": False})
    cfg = parse_worker_args([*argv, "--speculative-config", told])
    assert cfg.speculative_config["disable_eagle_block_drop"] is False
    assert cfg.sources["speculative_config.disable_eagle_block_drop"] == "--speculative-config"


def test_methods_without_an_eagle_drafter_keep_vllms_prefix_handling(parse) -> None:
    cfg = parse("--speculative-config", json.dumps(NGRAM))
    assert "disable_eagle_block_drop" not in cfg.speculative_config
    assert not any("disable_eagle_block_drop" in key for key in cfg.sources)


def test_speculators_proposal_yields_to_higher_sources(speculators_checkpoint: Path) -> None:
    cfg = parse_worker_args(
        [
            "--model",
            str(speculators_checkpoint),
            "--speculative-config",
            '{"num_speculative_tokens": 2}',
            "--dry-run",
        ]
    )
    assert cfg.speculative_config["num_speculative_tokens"] == 2
    assert cfg.speculative_config["method"] == "eagle3"


def test_speculators_verifier_must_be_local(tmp_path: Path) -> None:
    ckpt = write_config(
        tmp_path / "hub-ckpt", speculators_config("meta-llama/Llama-3.1-8B-Instruct")
    )
    with pytest.raises(ConfigError, match="neither an embedded model nor a local directory"):
        parse_worker_args(["--model", str(ckpt), "--dry-run"])


# --------------------------------------------------------------------------- platform / KV


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the block-size rule is for CPU")
def test_cpu_block_size_must_be_a_multiple_of_32(parse, write_yaml) -> None:
    with pytest.raises(ConfigError, match="multiple of 32"):
        parse("--block-size", "16")
    with pytest.raises(ConfigError, match=r"--block-size 48 \(extra-engine-args\)"):
        parse("--extra-engine-args", str(write_yaml("block_size: 48\n")))
    assert parse("--block-size", "64").engine_args.block_size == 64
    assert parse().engine_args.block_size is None  # silent: vLLM's CPU default (128)


def test_kv_events_default_to_private_unix_sockets(parse) -> None:
    cfg = parse()
    events = cfg.engine_args.kv_events_config
    assert isinstance(events, KVEventsConfig)
    assert events.enable_kv_cache_events and events.publisher == "zmq"
    assert cfg.kv_events_port is None
    assert events.endpoint.startswith("ipc://") and events.endpoint.endswith("-events.sock")
    assert events.replay_endpoint.startswith("ipc://") and events.replay_endpoint != events.endpoint
    assert cfg.kv_events_endpoint == events.endpoint
    assert parse().engine_args.kv_events_config.endpoint != events.endpoint  # unique per worker


def test_kv_events_port_publishes_on_tcp(parse) -> None:
    cfg = parse("--kv-events-port", "25557")
    assert cfg.kv_events_port == 25557
    assert cfg.engine_args.kv_events_config.endpoint == "tcp://*:25557"
    # Bound on every interface like the events: a consumer on another host may replay.
    assert cfg.engine_args.kv_events_config.replay_endpoint.startswith("tcp://*:")


def test_kv_events_follow_the_users_choices(parse) -> None:
    cfg = parse("--no-enable-prefix-caching")
    assert cfg.kv_events_port is None and cfg.engine_args.kv_events_config is None
    own = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5599"}'
    cfg = parse("--kv-events-config", own)
    assert cfg.kv_events_port == 5599
    with pytest.raises(ConfigError, match="either --kv-events-port or --kv-events-config"):
        parse("--kv-events-config", own, "--kv-events-port", "5600")


# --------------------------------------------------------------------------- reporting


def test_resolved_config_lines_show_non_defaults_with_sources(parse, write_yaml) -> None:
    path = write_yaml(
        "max_batch_size: 8\nspeculative_config: {decoding_type: NGram, max_draft_len: 2}\n"
    )
    cfg = parse("--extra-engine-args", str(path), "--max-model-len", "1024")
    lines = resolved_config_lines(cfg)
    assert "engine.max_model_len = 1024  [cli]" in lines
    assert "engine.max_num_seqs = 8  [extra-engine-args (max_batch_size)]" in lines
    assert 'engine.speculative_config.method = "ngram"  [extra-engine-args]' in lines
    assert "worker.namespace = dynamo" in lines
    # Keys left at vLLM's default are not reported.
    assert not any(line.startswith(("engine.seed", "engine.dtype")) for line in lines)
    assert len(lines) == len(set(lines))


def test_resolved_config_yaml_round_trips(parse) -> None:
    import yaml

    cfg = parse("--speculative-config", json.dumps(NGRAM), "--max-num-seqs", "4")
    document = yaml.safe_load(resolved_config_yaml(cfg))
    assert document["worker"]["served_model_name"] == "tiny-llama"
    assert document["engine"]["speculative_config"] == NGRAM
    assert document["engine"]["max_num_seqs"] == 4
    assert document["engine"]["kv_events_config"]["publisher"] == "zmq"
    assert document["sources"]["speculative_config.method"] == "--speculative-config"
    assert "seed" not in document["engine"]


def test_profile_where_speculation_never_pays_says_to_serve_without_it(parse, profile_file) -> None:
    path = profile_file(schedule=[[1, 8, 0]])
    with pytest.raises(ConfigError, match=r"speculation never paid.*without speculation"):
        parse("--spec-method", "ngram", "--speculation-profile", str(path))


# --------------------------------------------------------------------------- --speculation-adapt


def test_adaptation_runs_the_adaptive_scheduler_from_the_profile(parse, profile_file) -> None:
    path = profile_file()
    cfg = parse(
        "--speculative-config", json.dumps(NGRAM), "--speculation-profile", str(path),
        "--speculation-adapt", "acceptance", "--speculation-window", "50",
        "--speculation-warmup", "0",
    )  # fmt: skip
    assert cfg.engine_args.scheduler_cls == SCHEDULER_CLS
    entry = adaptive_entry(cfg.engine_args.additional_config)
    assert entry is not None
    assert entry["profile"] == str(path)
    assert (entry["window_steps"], entry["warmup_drafts"]) == (50, 0)
    assert entry["adapt_step_times"] is False  # `acceptance`: the profile's step times stay
    assert entry["free_k0"] is True  # n-gram: no search at K = 0 (the dynamo_free_k0 plugin)
    assert cfg.speculative_config["num_speculative_tokens_per_batch_size"] == PROFILE_SCHEDULE
    full = parse(
        "--speculative-config", json.dumps(NGRAM), "--speculation-profile", str(path),
        "--speculation-adapt", "full",
    )  # fmt: skip
    assert adaptive_entry(full.engine_args.additional_config)["adapt_step_times"] is True
    assert adaptive_entry(parse().engine_args.additional_config) is None  # off by default


def test_adaptation_without_a_profile_or_beside_another_scheduler_is_refused(
    parse, profile_file
) -> None:
    with pytest.raises(ConfigError, match="--speculation-adapt needs --speculation-profile"):
        parse("--speculative-config", json.dumps(NGRAM), "--speculation-adapt", "full")
    with pytest.raises(ConfigError, match="replaces vLLM's scheduler"):
        parse(
            "--speculative-config", json.dumps(NGRAM), "--speculation-profile",
            str(profile_file()), "--speculation-adapt", "full",
            "--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler",
        )  # fmt: skip
