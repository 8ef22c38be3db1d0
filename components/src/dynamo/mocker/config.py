"""Settings of one simulated engine (what the CLI's engine flags turn into)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamo.llm.kv_router.hashing import num_blocks_spanned
from dynamo.mocker.acceptance import AcceptanceChange, AcceptanceModel
from dynamo.mocker.timing import TimingModel


@dataclass(frozen=True)
class MockEngineConfig:
    """Capacity, scheduling, timing and speculation of a `MockEngine`.

    Defaults describe a mid-sized GPU deployment (16 Ki blocks of 16 tokens, 256 running
    sequences); the names follow vLLM's engine arguments where one exists.
    """

    block_size: int = 16
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    # Blocks of the second tier (host memory) that keeps what the device evicts; 0: none.
    kv_host_blocks: int = 0
    # Most log probabilities per token a request may ask for (vLLM's --max-logprobs).
    max_logprobs: int = 20
    num_speculative_tokens: int = 0
    # Recompute the last block of every prefix cache hit, as vLLM does for a drafter that
    # reads the target's hidden states (`--speculative-method eagle3`, ...).
    drops_last_prefix_block: bool = False
    # None: 0.7 per position (a typical Eagle-style draft) for the configured K.
    acceptance: AcceptanceModel | None = None
    # Later acceptance models, each from its time after the start, in time order.
    acceptance_changes: tuple[AcceptanceChange, ...] = ()
    # UNIX time the changes count from (several workers changing together); None: the
    # engine's start.
    acceptance_epoch: float | None = None
    timing: TimingModel = field(default_factory=TimingModel)
    # Probability that a generated token is the end-of-sequence token (0: never, so
    # requests run to max_tokens, the usual benchmark setting).
    eos_probability: float = 0.0
    seed: int = 0
    vocab_size: int = 49152
    eos_token_ids: tuple[int, ...] = ()
    # Never generated (chat-template markers and the like), so the output is plain text.
    special_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        positive = ("block_size", "num_gpu_blocks", "max_num_seqs", "max_model_len", "vocab_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_host_blocks < 0:
            raise ValueError(f"kv_host_blocks must be >= 0, got {self.kv_host_blocks}")
        k = self.num_speculative_tokens
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        if self.max_num_batched_tokens < 1 + k:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must hold one decode "
                f"step of a request (1 + K = {1 + k} tokens)"
            )
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError(f"eos_probability must be in [0, 1], got {self.eos_probability}")
        # Like vLLM at start-up: a request of the full context length must fit the cache
        # on its own, so preemption can always make room for the oldest request.
        needed = num_blocks_spanned(self.max_model_len + k, self.block_size)
        if needed > self.num_gpu_blocks:
            raise ValueError(
                f"max_model_len {self.max_model_len} (+{k} speculative slots) needs {needed} "
                f"blocks of {self.block_size} tokens, more than num_gpu_blocks "
                f"({self.num_gpu_blocks}); lower --max-model-len or raise --num-gpu-blocks"
            )
        if self.acceptance is None:
            object.__setattr__(self, "acceptance", AcceptanceModel.from_rates([0.7], k))
        elif self.acceptance.num_speculative_tokens != k:
            raise ValueError(
                f"the acceptance model is for K={self.acceptance.num_speculative_tokens}, "
                f"the engine speculates K={k}"
            )
        times = [change.after_s for change in self.acceptance_changes]
        if times != sorted(times) or any(t < 0 for t in times):
            raise ValueError(f"acceptance changes must come in time order from 0 s, got {times}")
        if any(c.model.num_speculative_tokens != k for c in self.acceptance_changes):
            raise ValueError(f"every acceptance change must be for the engine's K={k}")

    @property
    def acceptance_model(self) -> AcceptanceModel:
        """The acceptance model, never None after construction."""
        assert self.acceptance is not None
        return self.acceptance
