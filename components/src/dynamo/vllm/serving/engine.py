"""The worker's vLLM engine: an `AsyncLLM` plus the facts the model card advertises.

Kept free of NATS: the handlers and `main` combine this with the runtime.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from vllm import envs as vllm_envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM

from dynamo.llm.protocols import SpeculativeInfo
from dynamo.vllm.kv_transfer.layout import describe_kv_layout
from dynamo.vllm.serving.conversion import UNAPPLIED_WHILE_SPECULATING
from dynamo.vllm.serving.engine_stats import EngineStats, make_stat_logger_factory
from dynamo.vllm.speculative.adaptive_k import adaptive_entry
from dynamo.vllm.speculative.config_sources import ConfigError

log = logging.getLogger(__name__)


def one_line(exc: BaseException) -> str:
    """An exception from vLLM's configuration as one line. Pydantic validation errors
    (vLLM's config classes are pydantic dataclasses) become `Class: field: message; ...`;
    anything else keeps its first line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            parts = []
            for error in errors():
                field = ".".join(str(part) for part in error.get("loc", ()))
                message = str(error.get("msg", "")).strip().splitlines()[0]
                parts.append(f"{field}: {message}" if field else message)
            return f"{getattr(exc, 'title', type(exc).__name__)}: {'; '.join(parts)}"
        except Exception:
            pass
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


@dataclass(frozen=True)
class EngineFacts:
    """What a started engine can tell the router and frontend about itself."""

    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    speculative: SpeculativeInfo | None
    sampling_defaults: dict[str, Any]
    kv_connector: str | None = None  # vLLM KV connector for disaggregation (None: aggregated)
    # What a prefill/decode pair must share (`kv_transfer.layout.describe_kv_layout`).
    kv_layout: str = ""


def applied_defaults(defaults: dict[str, Any], spec_config: Any) -> dict[str, Any]:
    """The model's sampling defaults this engine applies: while it speculates, vLLM
    applies no `UNAPPLIED_WHILE_SPECULATING` field and refuses a request that sets one,
    so a default for one is dropped (and said) rather than advertised on the card and
    sent back with every request, each of which would then be refused."""
    if spec_config is None:
        return defaults
    kept = dict(defaults)
    for name in UNAPPLIED_WHILE_SPECULATING:
        if kept.get(name):
            log.warning(
                "the model's default %s=%r is not applied: vLLM applies no %s while it "
                "speculates",
                name, kept.pop(name), name,
            )  # fmt: skip
    return kept


def speculative_info(spec_config: Any, *, adaptive: bool = False) -> SpeculativeInfo | None:
    """Summarise vLLM's resolved `SpeculativeConfig` for the model card; `adaptive`: K is
    chosen each step (`--speculation-adapt`), so the router takes it from load reports."""
    if spec_config is None:
        return None
    method = str(getattr(spec_config, "method", None) or "unknown")
    k = int(getattr(spec_config, "num_speculative_tokens", 0) or 0)
    draft = getattr(spec_config, "model", None)
    schedule = getattr(spec_config, "num_speculative_tokens_per_batch_size", None)
    return SpeculativeInfo(
        method=method,
        num_speculative_tokens=k,
        draft_model=str(draft) if draft else None,
        schedule=[list(map(int, row)) for row in schedule] if schedule else None,
        adaptive=adaptive,
        # vLLM recomputes each prefix hit's last block for a drafter that reads the
        # target's hidden states (Eagle, Eagle3, MTP): the router counts one block less.
        drops_last_prefix_block=bool(spec_config.use_eagle_block_drop()),
    )


class VllmEngine:
    """Owns one `AsyncLLM`. `start()` blocks while vLLM loads weights and profiles memory
    (tens of seconds on CPU); nothing is registered anywhere until it returns."""

    def __init__(self, engine_args: AsyncEngineArgs) -> None:
        self.engine_args = engine_args
        self.stats = EngineStats()
        self.llm: AsyncLLM | None = None
        self.facts: EngineFacts | None = None

    def start(self) -> EngineFacts:
        args = self.engine_args
        if (
            args.speculative_config
            and getattr(args, "per_request_spec_decode_metrics", "none") == "none"
        ):
            # Per-request acceptance statistics travel back in the final output.
            args.per_request_spec_decode_metrics = "summary"
        args.disable_log_stats = False  # the Prometheus and load metrics depend on stats
        t0 = time.monotonic()
        try:
            vllm_config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise ConfigError(f"vLLM rejected the configuration: {one_line(exc)}") from exc
        self.llm = AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[make_stat_logger_factory(self.stats)],
            enable_log_requests=args.enable_log_requests,
            disable_log_stats=args.disable_log_stats,
        )
        # vLLM reads its settings from the environment lazily, at every use: its output
        # processor looks one up per request per step (3% of this process at c=16). Its
        # engine core caches them once started; the same holds here, where nothing changes
        # the environment after the engine started (`main.build_process` sets it before).
        vllm_envs.enable_envs_cache()
        cfg = self.llm.vllm_config
        self.facts = EngineFacts(
            max_model_len=int(cfg.model_config.max_model_len),
            block_size=int(cfg.cache_config.block_size),
            num_gpu_blocks=int(cfg.cache_config.num_gpu_blocks or 0),
            max_num_seqs=int(cfg.scheduler_config.max_num_seqs),
            speculative=speculative_info(
                cfg.speculative_config,
                adaptive=adaptive_entry(cfg.additional_config) is not None,
            ),
            sampling_defaults=applied_defaults(
                dict(cfg.model_config.get_diff_sampling_param()), cfg.speculative_config
            ),
            kv_connector=getattr(cfg.kv_transfer_config, "kv_connector", None),
            kv_layout=describe_kv_layout(cfg),
        )
        log.info(
            "engine ready in %.1fs: max_model_len=%d block_size=%d kv_blocks=%d speculative=%s kv=[%s]",
            time.monotonic() - t0,
            self.facts.max_model_len,
            self.facts.block_size,
            self.facts.num_gpu_blocks,
            self.facts.speculative,
            self.facts.kv_layout,
        )
        return self.facts

    @property
    def engine(self) -> AsyncLLM:
        if self.llm is None:
            raise RuntimeError("engine not started")
        return self.llm

    def attach_to_running_loop(self) -> None:
        """Start vLLM's output handler on the running event loop. `AsyncLLM` does this
        itself when it is built inside the loop; built in a thread (see `Worker`), it would
        wait for the first request, and an engine-core failure before then would go unseen
        by anything but vLLM's process monitor."""
        start = getattr(self.engine, "_run_output_handler", None)
        if start is not None:
            start()

    @property
    def is_ready(self) -> bool:
        return self.llm is not None and not self.llm.errored

    @property
    def is_dead(self) -> bool:
        """Started once and errored since (vLLM's monitor thread marks the engine dead as
        soon as its engine-core process exits)."""
        return self.llm is not None and self.llm.errored

    async def clear_kv_blocks(self) -> bool:
        """Drop every cached prefix block (running requests keep theirs)."""
        return bool(await self.engine.reset_prefix_cache())

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
