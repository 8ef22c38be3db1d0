"""Wire types of the LLM layer: the one place that defines what crosses NATS.

Every message between frontend, router and workers is one of these `msgspec.Struct`s,
encoded with msgpack (`encode` / `decode_*` below). Unknown fields are ignored on decode
(msgspec's default for structs), so old and new components can talk during a rollout.
The runtime layer (`dynamo.runtime.wire`) owns only its own framing; it never looks inside.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from dynamo.llm.acceptance import acceptance_length

T = TypeVar("T")


class FinishReason(str, enum.Enum):
    """Why a sequence ended, as carried on the wire (mapped to OpenAI's names by the frontend)."""

    EOS = "eos"  # the model produced an end-of-sequence token
    LENGTH = "length"  # max_tokens or the context length was reached
    STOP = "stop"  # a stop token id or stop string matched
    ERROR = "error"  # the engine failed this request
    CANCELLED = "cancelled"  # the client went away / the request was aborted


class WorkerType(str, enum.Enum):
    """What a worker instance does in the serving graph."""

    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"


# --------------------------------------------------------------------------- requests


class SamplingOptions(msgspec.Struct, omit_defaults=True):
    """Sampling knobs; `None` means "the engine's default"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # Parallel sampling: `n` sequences from one prompt (vLLM's `n`), sharing its KV. Each
    # output then names its sequence in `LLMEngineOutput.index`. None (or 1): one sequence.
    n: int | None = None
    # False: the worker never drafts for this request (bulk jobs that want throughput,
    # not latency); None or True: the worker's speculation applies.
    speculative_decoding: bool | None = None
    # vLLM's: a bias added to the logits of each token id (clamped to [-100, 100]);
    # only these token ids may be sampled; words (strings) the output may not contain.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: at most this many tokens of reasoning before the engine forces its end
    # (needs the worker's `--reasoning-config`; vLLM refuses it otherwise).
    thinking_token_budget: int | None = None


class StopConditions(msgspec.Struct, omit_defaults=True):
    """When the engine must stop. Stop *strings* are applied by the frontend (it detokenizes);
    they travel here only so a worker can log them."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class OutputOptions(msgspec.Struct, omit_defaults=True):
    """What extra output the client asked for."""

    logprobs: int | None = None  # number of top logprobs per generated token
    # Top logprobs per prompt token (vLLM's `prompt_logprobs`; -1: the whole vocabulary).
    prompt_logprobs: int | None = None
    # vLLM's `logprob_token_ids`: these tokens' logprobs at each generated position, in
    # place of the top `logprobs` (which is then None).
    logprob_token_ids: list[int] | None = None


class RoutingHints(msgspec.Struct, omit_defaults=True):
    """Routing decisions made by the frontend, passed along for logging and metrics."""

    backend_instance_id: int | None = None
    prefill_instance_id: int | None = None
    overlap_blocks: int | None = None


class KvStorageProbe(msgspec.Struct, omit_defaults=True):
    """Proof that a prefill worker's disk-based KV connector (vLLM's ExampleConnector)
    writes where a decode worker reads: a file named after `token` in the prefill's
    transfer directory, which a decode worker not sharing it (another host or path) cannot
    find. `path` and `host` are the prefill worker's, for the error."""

    token: str
    path: str = ""
    host: str = ""


class PrefillResult(msgspec.Struct, omit_defaults=True):
    """What a prefill worker handed back, forwarded to the decode worker."""

    disaggregated_params: dict[str, Any] = msgspec.field(default_factory=dict)
    prompt_tokens_details: dict[str, Any] | None = None
    # The prefill worker's KV-transfer directory probe (disk-based connectors only; None
    # from an older frontend or prefill worker: the decode worker then checks nothing).
    kv_storage: KvStorageProbe | None = None


class StructuredOutput(msgspec.Struct, omit_defaults=True):
    """A constraint on the output, enforced by the engine's sampler (vLLM's structured
    outputs). Exactly one of `json_schema`, `json_object`, `regex`, `choice`, `grammar`,
    `structural_tag` is set; the frontend checks that and the schema, the worker's grammar
    compiler has the last word (a refusal there is the client's error). The schema
    travels as JSON text so it reaches the engine byte for byte as sent."""

    json_schema: str | None = None  # a JSON schema, as JSON text
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / Lark grammar, as vLLM accepts it
    structural_tag: str | None = None  # vLLM's structural tag, as JSON text
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class PreprocessedRequest(msgspec.Struct, omit_defaults=True):
    """A tokenized, validated request ready for a worker's `generate` endpoint."""

    request_id: str
    model: str
    token_ids: list[int]
    sampling_options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    stop_conditions: StopConditions = msgspec.field(default_factory=StopConditions)
    output_options: OutputOptions = msgspec.field(default_factory=OutputOptions)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    routing: RoutingHints | None = None
    prefill_result: PrefillResult | None = None
    # Extra engine parameters for special legs, e.g. {"do_remote_decode": True} on a prefill.
    kv_transfer_params: dict[str, Any] | None = None
    # Constrained decoding (response_format / structured_outputs); None: unconstrained.
    structured_output: StructuredOutput | None = None
    priority: int = 0  # vLLM's: lower is served sooner (frontend queue, vLLM scheduler)


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct, omit_defaults=True):
    cached_tokens: int = 0


class CompletionUsage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class SpecDecodeStats(msgspec.Struct, omit_defaults=True):
    """Per-request speculative decoding statistics, sent in the final output."""

    num_drafts: int = 0  # verification steps that carried draft tokens
    num_draft_tokens: int = 0  # draft tokens proposed
    num_accepted_tokens: int = 0  # draft tokens accepted by the target
    # acceptance_histogram[j] = verification steps that accepted exactly j draft tokens
    acceptance_histogram: list[int] | None = None

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification step, bonus token included."""
        return acceptance_length(self.num_accepted_tokens, self.num_drafts)


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct, omit_defaults=True):
    token_id: int
    logprob: float
    top: list[TopLogprob] | None = None


class RankedLogprob(msgspec.Struct, array_like=True):
    """One entry of a prompt position's logprobs: a token, its logprob and its rank in the
    model's distribution (1: the most likely)."""

    token_id: int
    logprob: float
    rank: int


# A prompt's logprobs, one entry per prompt position: None for the first (nothing predicts
# it), else the prompt's own token followed by the top alternatives, as vLLM orders them.
PromptLogprobs = list[list[RankedLogprob] | None]


class LLMEngineOutput(msgspec.Struct, omit_defaults=True):
    """One step of a worker's response stream. `token_ids`: this step's tokens, 1..K+1
    with speculation (DELTA mode).
    The last output of a sequence carries `finish_reason` and `completion_usage` (that
    sequence's own completion tokens). With `SamplingOptions.n` > 1 the stream interleaves
    the outputs of n sequences; `index` says which (0..n-1), and the stream ends once every
    sequence has finished. An old peer leaves `index` out: 0, the only sequence.
    """

    token_ids: list[int] = msgspec.field(default_factory=list)
    index: int = 0
    log_probs: list[TokenLogprob] | None = None
    # `OutputOptions.prompt_logprobs`: the prompt's positions, on the first output(s) of
    # the stream (consecutive outputs that carry them continue the list).
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    completion_usage: CompletionUsage | None = None
    disaggregated_params: dict[str, Any] | None = None
    spec_decode_stats: SpecDecodeStats | None = None
    error: str | None = None
    # A prefill worker's last output: where its disk-based KV connector wrote (see
    # `KvStorageProbe`); the frontend forwards it in `PrefillResult.kv_storage`.
    kv_storage: KvStorageProbe | None = None


# --------------------------------------------------------------------------- model card


class SpeculativeInfo(msgspec.Struct, omit_defaults=True):
    """What speculation a worker runs, advertised so the router can count speculative slots."""

    method: str
    num_speculative_tokens: int
    draft_model: str | None = None
    # Dynamic speculation: [[batch_lo, batch_hi, K], ...]
    schedule: list[list[int]] | None = None
    # K chosen online each step (`--speculation-adapt`): the schedule is where it starts,
    # and the worker's load reports say the K in force.
    adaptive: bool = False
    # A prefix cache hit drops its last block (recomputed: see `worker_spec`).
    drops_last_prefix_block: bool = False


class SamplingDefaults(msgspec.Struct, omit_defaults=True):
    """The model's own sampling defaults (its `generation_config.json`, as vLLM reads it with
    `--generation-config`), advertised on the card. The frontend gives them to every field a
    request leaves unset, as `vllm serve` does; an explicit value (even 0) always wins.
    `None` means "no default: the engine's own"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's `max_new_tokens`


class ModelCard(msgspec.Struct, omit_defaults=True):
    """Everything a frontend needs to serve a model a worker registered."""

    name: str  # the served model name clients use
    namespace: str
    component: str
    endpoint: str
    instance_id: int
    worker_type: WorkerType = WorkerType.AGGREGATED
    source_path: str | None = None  # model path on the worker (informational)
    context_length: int = 0
    kv_block_size: int = 0
    total_kv_blocks: int = 0
    max_num_seqs: int = 0
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    # Object store bucket/prefix holding tokenizer files (tokenizer.json, config, template).
    tokenizer_bucket: str | None = None
    tokenizer_files: list[str] = msgspec.field(default_factory=list)
    tokenizer_digest: str | None = None
    speculative: SpeculativeInfo | None = None
    system_port: int | None = None
    # How often a request may move to another worker when its worker dies mid-stream.
    migration_limit: int = 0
    # Defaults for sampling fields a request leaves unset (None: the engine's own).
    sampling_defaults: SamplingDefaults | None = None
    # The address peers on other hosts reach the worker at (`--advertise-host`): with
    # `system_port`, where its /metrics and /health answer. None from older workers.
    host: str | None = None
    # A prefill worker's KV-transfer directory probe (disk-based connectors only).
    kv_storage: KvStorageProbe | None = None


# --------------------------------------------------------------------------- KV events


class KvMedium(str, enum.Enum):
    """A block event's cache tier (vLLM's `medium`): device pool, host memory or disk."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


class KvBlockStored(msgspec.Struct, tag="stored", omit_defaults=True):
    """Blocks that became immutable on a worker, in tier `medium`. Hashes are content
    hashes (`kv_router.hashing`), chained from `parent_hash` (None = first block)."""

    block_hashes: list[int]
    parent_hash: int | None = None
    medium: KvMedium = KvMedium.GPU  # omitted when GPU: older peers decode the same


class KvBlockRemoved(msgspec.Struct, tag="removed", omit_defaults=True):
    block_hashes: list[int]
    medium: KvMedium = KvMedium.GPU  # a removal from one tier leaves the others' copies


class KvAllCleared(msgspec.Struct, tag="cleared"):
    pass


KvEventData = KvBlockStored | KvBlockRemoved | KvAllCleared


class RouterEvent(msgspec.Struct):
    """A KV-cache event of one worker, as published on its JetStream subject."""

    worker_id: int
    event_id: int
    data: KvEventData


StreamedKvEvents = RouterEvent | list[RouterEvent]
"""One message of the KV-event stream: an event, or several consecutive events of one
worker published together (an engine step's events: one JetStream publish and one ack
instead of one per event). A `KvAllCleared` always travels alone, since it purges the
worker's subject first."""


def kv_events_of(data: bytes) -> list[RouterEvent]:
    """The events in one message of the KV-event stream, in order."""
    decoded = msgspec.msgpack.decode(data, type=StreamedKvEvents)
    return decoded if isinstance(decoded, list) else [decoded]


class LoadMetrics(msgspec.Struct, omit_defaults=True):
    """Load snapshot a worker publishes on its core-NATS metrics subject."""

    worker_id: int
    active_requests: int = 0
    waiting_requests: int = 0
    active_blocks: int = 0  # includes speculative slots
    total_blocks: int = 0
    kv_usage: float = 0.0
    # Draft tokens per step (K) in force on a speculating worker; None where the worker
    # does not say (the router then takes the card's schedule).
    num_speculative_tokens: int | None = None


# --------------------------------------------------------------------------- router replica sync
# Frontend replicas share the KV router's books (`kv_router.replica_sync`): one
# `ReplicaSyncMessage` per publish on the endpoint's core subject. Every field is bounded:
# a message outside the bounds fails to decode and is dropped whole (counted as malformed).

MAX_SYNC_ID_CHARS = 256
"""Longest replica or request id a sync message may carry (the frontend's are ~40)."""
MAX_SYNC_TOKENS = 2**31 - 1
"""Bound of every token count in a sync message (no context comes near it)."""
MAX_SYNC_HASHES = 40_000
"""Block hashes one sync message may carry (at most 9 bytes each in msgpack): keeps a snapshot
chunk or a burst of bookings (so one booking too) under NATS's 1 MiB payload limit."""
MAX_SYNC_SPECULATIVE_TOKENS = 64
"""Most speculative tokens a booking may reserve per step."""
MIN_HEARTBEAT_INTERVAL_S = 0.01
MAX_HEARTBEAT_INTERVAL_S = 60.0
"""Heartbeat intervals a peer may announce (a longer one keeps a dead replica's bookings)."""

SyncId = Annotated[str, Meta(min_length=1, max_length=MAX_SYNC_ID_CHARS)]
TokenCount = Annotated[int, Meta(ge=0, le=MAX_SYNC_TOKENS)]


class SequenceBooked(msgspec.Struct, tag="booked", omit_defaults=True):
    """A replica booked a request on a worker: what `KvScheduler` needs to book it too."""

    request_id: SyncId
    worker_id: Annotated[int, Meta(ge=0)]
    # of the worker's books, which the hashes were computed with
    block_size: Annotated[int, Meta(ge=1, le=65536)]
    prompt_len: TokenCount
    # the prompt's full blocks
    block_hashes: Annotated[list[int], Meta(max_length=MAX_SYNC_HASHES)] = msgspec.field(
        default_factory=list
    )
    overlap_blocks: TokenCount = 0  # prompt blocks the worker had (or was getting) on arrival
    cached_blocks: TokenCount = 0  # of those, the ones its KV events had reported
    num_speculative_tokens: Annotated[int, Meta(ge=0, le=MAX_SYNC_SPECULATIVE_TOKENS)] = 0
    # Snapshots only: the request's first output already arrived, with this many tokens.
    first_output_tokens: TokenCount | None = None


class SequencePrefilled(msgspec.Struct, tag="prefilled", omit_defaults=True):
    """A booked request's first output arrived (its prefill is done), with `new_tokens`."""

    request_id: SyncId
    new_tokens: TokenCount = 0


class SequenceFreed(msgspec.Struct, tag="freed"):
    """A booked request ended (finished, failed, cancelled, or its worker left)."""

    request_id: SyncId


BookingChange = SequenceBooked | SequencePrefilled | SequenceFreed


class BookingChanges(msgspec.Struct, tag="changes"):
    """The changes of one replica's books since its previous message, in order."""

    changes: list[BookingChange]


class BookingSnapshot(msgspec.Struct, tag="snapshot", omit_defaults=True):
    """Every request a replica has booked now (one chunk of them when `replace` is False:
    a first chunk replaces what receivers hold of the sender, later chunks add to it)."""

    bookings: list[SequenceBooked] = msgspec.field(default_factory=list)
    replace: bool = True


class SnapshotRequest(msgspec.Struct, tag="snapshot_request", omit_defaults=True):
    """Asks `replica_id` (None: every replica) to publish a `BookingSnapshot`."""

    replica_id: SyncId | None = None


class ReplicaHeartbeat(msgspec.Struct, tag="heartbeat"):
    """A replica is alive, beats every `interval_s`, and holds `bookings` requests whose
    ids' CRC-32s XOR to `fingerprint` (a receiver holding something else resyncs)."""

    interval_s: Annotated[float, Meta(ge=MIN_HEARTBEAT_INTERVAL_S, le=MAX_HEARTBEAT_INTERVAL_S)]
    bookings: Annotated[int, Meta(ge=0)]
    fingerprint: Annotated[int, Meta(ge=0, le=2**32 - 1)]


class ReplicaLeaving(msgspec.Struct, tag="leaving"):
    """A replica is shutting down: drop its bookings now, not after missed heartbeats."""


ReplicaSyncData = (
    BookingChanges | BookingSnapshot | SnapshotRequest | ReplicaHeartbeat | ReplicaLeaving
)


class ReplicaSyncMessage(msgspec.Struct):
    """One message of a router replica on its endpoint's sync subject."""

    replica_id: SyncId
    data: ReplicaSyncData


class ClearKvBlocksResult(msgspec.Struct):
    worker_id: int
    cleared: bool
    message: str = ""


# --------------------------------------------------------------------------- codec

_encoder = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    """Encode any wire struct (or plain msgpack-able value) to bytes."""
    return _encoder.encode(obj)


def decode(data: bytes, type_: type[T]) -> T:
    """Decode bytes to a wire struct; raises `msgspec.ValidationError` on a bad shape."""
    return msgspec.msgpack.decode(data, type=type_)


def convert(obj: Any, type_: type[T]) -> T:
    """Convert an already-decoded msgpack value (dicts/lists) into a wire struct."""
    return msgspec.convert(obj, type=type_)


def to_builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)
