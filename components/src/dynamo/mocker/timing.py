"""How long one simulated engine step takes.

A continuous-batching engine runs one forward pass per step over every scheduled token:
prompt chunks of requests in prefill and, per decoding request, the last token plus its K
draft tokens (verification). The model is deliberately linear and small so its numbers
can be read off a profile of a real engine:

    step_ms = decode_ms_per_step                      fixed cost of a forward pass
            + decode_ms_per_token × decode tokens     Σ over decoding requests of (1 + K)
            + prefill_ms_per_token × prefill tokens   prompt tokens computed this step
            + draft_ms_per_token × K                  the drafter runs K positions per step
                                                      (only when some request decodes)

and the simulation sleeps ``step_ms / speed_up``. Why these terms: at small batch a decode
step is memory bound (the fixed term dominates), and the per-token term makes inter-token
latency grow with batch size and with K, which is what makes the choice of K and the
router's load balancing matter. Prefill is compute bound, so linear in tokens.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from dynamo.runtime.settings import Flag, setting

# The shortest wait the event loop times faithfully: uvloop's timers (libuv's) count whole
# milliseconds, so a sleep of microseconds is "the next loop iteration", whatever was asked.
SLEEP_QUANTUM_S = 0.001


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Parameters of the step-time model (milliseconds at ``speed_up`` 1).

    Each parameter is one `python -m dynamo.mocker` flag, declared here with the field
    (`dynamo.runtime.settings`) so that the flag, its default and the model cannot drift.
    """

    prefill_ms_per_token: float = setting(
        0.05,
        Flag(
            "--prefill-ms-per-token",
            "Step time per prompt token computed (cached tokens cost nothing).",
            type=float,
        ),
    )
    decode_ms_per_step: float = setting(
        8.0,
        Flag(
            "--decode-ms-per-step",
            "Fixed time of one forward pass: the inter-token latency at batch size 1.",
            type=float,
        ),
    )
    decode_ms_per_token: float = setting(
        0.05,
        Flag(
            "--decode-ms-per-token",
            "Extra step time per decode token in the batch (1+K per request): ITL grows with load.",
            type=float,
        ),
    )
    draft_ms_per_token: float = setting(
        0.5,
        Flag(
            "--draft-ms-per-token",
            "Step time per draft position (the drafter runs K times per step); 0 for n-gram.",
            type=float,
        ),
    )
    kv_onboard_ms_per_token: float = setting(
        0.005,
        Flag(
            "--kv-onboard-ms-per-token",
            "Step time per prompt token loaded back from the host tier (--kv-host-blocks) "
            "instead of computed. A copy of the token's KV over the host link, not a "
            "forward pass: default a tenth of --prefill-ms-per-token (a 7-8B model's "
            "~128 KiB of KV per token at ~25 GB/s is ~5 us, its prefill ~0.1 ms).",
            type=float,
        ),
    )
    # The prompt KV a decode worker receives from a prefill worker (`transfer`). The
    # defaults estimate the CPU setup's disk connector (one safetensors file per layer per
    # prompt, written by prefill, read by decode): for SmolLM2-135M, 30 layers x 2 file
    # operations (~5 ms), and 22.5 KiB of KV per token through the page cache (~0.01 ms,
    # a fifth of the prefill cost per token). Estimates, not measurements.
    kv_transfer_overhead_ms: float = setting(
        5.0,
        Flag(
            "--kv-transfer-overhead-ms",
            "Disaggregated decode: fixed time of one prompt's KV transfer from a prefill "
            "worker. The default estimates the CPU disk connector's per-layer file writes "
            "and reads (60 files for SmolLM2-135M).",
            type=float,
        ),
    )
    kv_transfer_ms_per_token: float = setting(
        0.01,
        Flag(
            "--kv-transfer-ms-per-token",
            "Disaggregated decode: transfer time per prompt token the decode worker does "
            "not cache; transfers run beside the steps. The default estimates 22.5 KiB of "
            "SmolLM2-135M KV per token through the page cache (the CPU disk connector), a "
            "fifth of --prefill-ms-per-token.",
            type=float,
        ),
    )
    speed_up: float = setting(
        1.0,
        Flag(
            "--speed-up",
            "Run the simulated clock this many times faster than the modelled engine.",
            type=float,
        ),
    )
    # Steps shorter than this (after `speed_up`) are run back to back and slept off
    # together (`StepPacer`); 0 sleeps after every step, so that whoever reads the
    # outputs sees the engine between steps (lockstep, for unit tests).
    quantum_ms: float = setting(
        SLEEP_QUANTUM_S * 1000,
        Flag(
            "--step-quantum-ms",
            "Steps shorter than this (after --speed-up) run back to back and are slept "
            "off together, so simulated time stays right on average where the event loop "
            "cannot time a microsecond sleep; their outputs then leave together. 0: sleep "
            "after every step (each step's outputs go out on their own).",
            type=float,
        ),
    )

    def __post_init__(self) -> None:
        for name in (
            "prefill_ms_per_token",
            "decode_ms_per_step",
            "decode_ms_per_token",
            "draft_ms_per_token",
            "kv_transfer_overhead_ms",
            "kv_transfer_ms_per_token",
            "kv_onboard_ms_per_token",
            "quantum_ms",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.speed_up > 0:
            raise ValueError(f"speed_up must be > 0, got {self.speed_up}")

    def step_ms(
        self, prefill_tokens: int, decode_requests: int, num_speculative_tokens: int
    ) -> float:
        """Simulated duration of one step in milliseconds, before `speed_up`."""
        k = num_speculative_tokens
        ms = self.decode_ms_per_step + self.prefill_ms_per_token * prefill_tokens
        if decode_requests:
            ms += self.decode_ms_per_token * decode_requests * (1 + k)
            ms += self.draft_ms_per_token * k
        return ms

    def step_seconds(
        self, prefill_tokens: int, decode_requests: int, num_speculative_tokens: int
    ) -> float:
        """Wall-clock seconds the simulation waits for one step (`speed_up` applied)."""
        ms = self.step_ms(prefill_tokens, decode_requests, num_speculative_tokens)
        return ms / 1000.0 / self.speed_up

    def onboard_seconds(self, tokens: int) -> float:
        """Wall-clock seconds a step spends loading `tokens` prompt tokens of KV back from
        the host tier (`speed_up` applied): added to the step that admits their request."""
        return self.kv_onboard_ms_per_token * tokens / 1000.0 / self.speed_up

    def transfer_seconds(self, tokens: int) -> float:
        """Wall-clock seconds a decode worker waits for `tokens` prompt tokens of KV from a
        prefill worker (`speed_up` applied)."""
        ms = self.kv_transfer_overhead_ms + self.kv_transfer_ms_per_token * tokens
        return ms / 1000.0 / self.speed_up

    def inter_token_ms(self, batch_size: int, mean_acceptance_length: float, k: int) -> float:
        """Expected time between tokens of one stream in steady decode (for docs and
        sizing): one step's time spread over the tokens a step produces on average."""
        return self.step_ms(0, batch_size, k) / max(mean_acceptance_length, 1.0) / self.speed_up


class StepPacer:
    """Waits out simulated step times in waits the event loop can time.

    At a large `speed_up` a step lasts microseconds (8.8 us: a decode step of 16 requests
    at 1000x), far below the loop's 1 ms timer resolution, so sleeping once per step
    would only yield for one loop iteration and make the simulation as slow as its own
    Python, with every step's outputs published on their own. The pacer instead keeps a
    debt of simulated time and runs steps back to back until it reaches `quantum`, then
    sleeps it off; the time a sleep overran is credited to the next steps (at most one
    quantum), so simulated time stays right on average. So that a burst of steps cannot
    hold the loop for long (`speed_up` 1e6 in unit tests), it also yields once per
    `quantum` of wall-clock time spent stepping. Steps of a quantum or more (every
    `speed_up` below about 8) sleep exactly as before.

    What changes is when outputs leave: the steps of one stretch produce their outputs
    one by one, and the transport carries what is ready together (one frame to the
    frontend, one SSE event to the client), as it would for a real engine that fast."""

    __slots__ = ("_debt", "_stretch_began", "quantum")

    def __init__(self, quantum: float = SLEEP_QUANTUM_S) -> None:
        self.quantum = quantum
        self._debt = 0.0
        self._stretch_began: float | None = None

    async def wait(self, seconds: float) -> None:
        """Account one step of `seconds`; sleep or yield when a quantum is due."""
        now = time.monotonic()
        if self._stretch_began is None:
            self._stretch_began = now
        self._debt += seconds
        if self._debt >= self.quantum:
            began = now
            await asyncio.sleep(self._debt)
            slept = time.monotonic() - began
            self._debt = max(self._debt - slept, -self.quantum)
            self._stretch_began = None
        elif now - self._stretch_began >= self.quantum:
            await asyncio.sleep(0)
            self._stretch_began = None

    def idle(self) -> None:
        """The engine ran out of work: the next step starts a new stretch, and no debt or
        credit carries over the idle time."""
        self._debt = 0.0
        self._stretch_began = None
