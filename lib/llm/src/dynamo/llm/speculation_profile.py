"""A measured speculation profile and the batch-size -> K schedule chosen from it.

`dynamo.vllm.profile_spec` measures, on the user's engine and prompts, the decode step time
for each (batch size, K) and the acceptance per draft position; this module turns those
numbers into vLLM's `num_speculative_tokens_per_batch_size` schedule. It is pure
arithmetic (no vLLM import), so the worker can load a profile cheaply and the unit tests
can check the choice on synthetic numbers. It lives in `dynamo.llm`, not with the vLLM
worker, because the planner (`dynamo.planner.perf_model`) sizes decode pools from the
same numbers, and components do not import each other.

The model behind the choice, for a batch of `b` running sequences and K drafts each:

* tokens per sequence per step: `1 + drafted * sum(acceptance[:K])`. `acceptance[i]` is
  vLLM's per-position rate, the fraction of drafts whose token `i` was accepted; a token
  counts only if every earlier one was, so the rates already are the probabilities of
  reaching each position, and the bonus token is always produced. `drafted` is the
  fraction of sequence-steps that carried a draft at all: 1 for model drafters, less for
  n-gram, which proposes nothing where the context has no match.
* goodput: `b * tokens_per_step(K) / step_time(K, b)` tokens per second.

For each batch size the K with the highest goodput wins (ties go to the smaller K: fewer
drafts for the same speed waste less compute), and runs of equal K become the schedule's
inclusive ranges. Step times between measured batch sizes are interpolated linearly; below
the smallest they are taken as flat, beyond the largest the last segment's slope is
extended.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

import msgspec

from dynamo.llm.kv_router.active_sequences import scheduled_k

PROFILE_VERSION = 1

Schedule = list[list[int]]
"""vLLM's `num_speculative_tokens_per_batch_size`: `[[first_batch, last_batch, K], ...]`."""


class ProfileError(ValueError):
    """A profile that cannot be read, or does not fit the engine it is given to."""


class StepTimes(msgspec.Struct, frozen=True):
    """Measured decode step time for one K at the profiled batch sizes."""

    k: int
    step_ms: list[float]  # one per `SpeculationProfile.batch_sizes`


class SpeculationProfile(msgspec.Struct, frozen=True, kw_only=True):
    """Everything `profile_spec` measured, and the schedule chosen from it."""

    model: str
    method: str
    speculative_config: dict[str, object]  # as profiled, without K
    batch_sizes: list[int]
    acceptance_per_position: list[float]  # per draft (vLLM's rates), at the largest K
    step_times: list[StepTimes]  # K = 0 .. max K, all on the speculating engine
    # A plain engine (no speculation) at the same batch sizes. K = 0 above is the
    # speculating engine told to draft nothing, which still pays for a drafter that keeps
    # its own KV; this is what the worker would do without speculation configured.
    no_speculation_step_ms: list[float] = []
    schedule: Schedule
    max_batch_size: int  # the schedule's last range ends here
    drafted_fraction: float = 1.0  # sequence-steps that carried a draft
    prompts: str = ""  # where the prompts came from
    output_tokens: int = 0
    num_prompts: int = 0
    vllm_version: str = ""
    measured_at: str = ""
    version: int = PROFILE_VERSION

    @property
    def max_k(self) -> int:
        return max(times.k for times in self.step_times)

    def times_for(self, k: int) -> StepTimes:
        for times in self.step_times:
            if times.k == k:
                return times
        raise ProfileError(f"the profile has no step times for K={k}")


def tokens_per_step(acceptance: Sequence[float], k: int, drafted: float = 1.0) -> float:
    """Expected tokens one sequence gains per step with K drafts, where a fraction
    `drafted` of the steps carries a draft (1: per verification step, vLLM's mean
    acceptance length)."""
    if k > len(acceptance):
        raise ProfileError(f"K={k} but acceptance was measured for {len(acceptance)} positions")
    return 1.0 + drafted * sum(acceptance[:k])


def step_time(batch_sizes: Sequence[int], step_ms: Sequence[float], batch: float) -> float:
    """Step time (ms) at `batch`, interpolated from the measured points."""
    if len(batch_sizes) != len(step_ms) or not batch_sizes:
        raise ProfileError("step times need one value per measured batch size")
    if len(batch_sizes) == 1 or batch <= batch_sizes[0]:
        return float(step_ms[0])
    i = bisect.bisect_left(batch_sizes, batch)
    if i < len(batch_sizes) and batch_sizes[i] == batch:
        return float(step_ms[i])
    lo = min(i, len(batch_sizes) - 1) - 1  # beyond the last point: extend the last segment
    x0, x1 = batch_sizes[lo], batch_sizes[lo + 1]
    y0, y1 = step_ms[lo], step_ms[lo + 1]
    return float(y0 + (y1 - y0) * (batch - x0) / (x1 - x0))


def goodput(profile: SpeculationProfile, k: int, batch: int) -> float:
    """Expected generated tokens per second for the whole batch at this K."""
    times = profile.times_for(k)
    ms = step_time(profile.batch_sizes, times.step_ms, batch)
    gained = tokens_per_step(profile.acceptance_per_position, k, profile.drafted_fraction)
    return batch * gained * 1000.0 / ms


def goodput_without_speculation(profile: SpeculationProfile, batch: int) -> float:
    """Tokens per second of a plain engine (no drafter at all) at `batch`."""
    plain = profile.no_speculation_step_ms or profile.times_for(0).step_ms
    return batch * 1000.0 / step_time(profile.batch_sizes, plain, batch)


def best_k(profile: SpeculationProfile, batch: int) -> int:
    """The K with the highest goodput at `batch` (the smaller K on a tie)."""
    ks = sorted(times.k for times in profile.step_times)
    return max(ks, key=lambda k: (round(goodput(profile, k, batch), 9), -k))


def choose_schedule(profile: SpeculationProfile, max_batch_size: int | None = None) -> Schedule:
    """The schedule that maximises goodput for every batch size from 1 to `max_batch_size`
    (default: the profile's), as vLLM's inclusive ranges."""
    last = max_batch_size or profile.max_batch_size
    if last < 1:
        raise ProfileError(f"max batch size must be at least 1, got {last}")
    schedule: Schedule = []
    for batch in range(1, last + 1):
        k = best_k(profile, batch)
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = batch
        else:
            schedule.append([batch, batch, k])
    return schedule


def never_speculates(schedule: Schedule) -> bool:
    """A schedule of K=0 at every batch size: speculation never paid where it was
    measured (a worker refuses such a profile; the profiler says so)."""
    return all(k == 0 for _, _, k in schedule)


def k_for_batch(schedule: Schedule, batch: int) -> int:
    """The K vLLM runs for `batch` scheduled sequences (the last range carries on); the
    same lookup the KV router books speculative slots with."""
    return scheduled_k(schedule, batch)


def validate(profile: SpeculationProfile) -> None:
    """Refuse a profile whose numbers cannot describe an engine."""
    sizes = profile.batch_sizes
    if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
        raise ProfileError(f"batch_sizes must be increasing positive integers, got {sizes}")
    ks = sorted(times.k for times in profile.step_times)
    if not ks or ks[0] != 0 or ks != list(range(len(ks))):
        raise ProfileError(f"step_times must cover K = 0, 1, ..., max K; got K = {ks}")
    for times in profile.step_times:
        if len(times.step_ms) != len(sizes) or min(times.step_ms) <= 0:
            raise ProfileError(
                f"K={times.k}: need one positive step time per batch size, got {times.step_ms}"
            )
    if not 0.0 < profile.drafted_fraction <= 1.0:
        raise ProfileError(f"drafted_fraction must be in (0, 1], got {profile.drafted_fraction}")
    plain = profile.no_speculation_step_ms
    if plain and (len(plain) != len(sizes) or min(plain) <= 0):
        raise ProfileError(
            f"no_speculation_step_ms: need one positive time per batch size, got {plain}"
        )
    if len(profile.acceptance_per_position) < profile.max_k:
        raise ProfileError(
            f"acceptance has {len(profile.acceptance_per_position)} positions, "
            f"the profile goes to K={profile.max_k}"
        )
    if not profile.schedule:
        raise ProfileError("the profile has no schedule")
    if any(k > profile.max_k or k < 0 for _, _, k in profile.schedule):
        raise ProfileError(f"schedule {profile.schedule} uses K outside 0..{profile.max_k}")


def check_schedule_fits(schedule: Schedule, k_cap: int | None, where: str) -> None:
    """vLLM silently caps every scheduled K at `num_speculative_tokens`; a profile whose
    schedule asks for more would run something other than what was measured best."""
    largest = max(k for _, _, k in schedule)
    if k_cap is not None and largest > k_cap:
        raise ProfileError(
            f"{where}: the profile's schedule uses K={largest} but num_speculative_tokens="
            f"{k_cap} caps it; raise num_speculative_tokens to {largest} or re-profile "
            f"with --max-k {k_cap}"
        )


def save_profile(profile: SpeculationProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n")


def load_profile(path: Path) -> SpeculationProfile:
    """Read and validate a profile written by `profile_spec`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ProfileError(f"cannot read speculation profile {path}: {exc.strerror}") from exc
    try:
        profile = msgspec.json.decode(data, type=SpeculationProfile)
    except msgspec.DecodeError as exc:
        raise ProfileError(f"{path} is not a speculation profile: {exc}") from exc
    if profile.version != PROFILE_VERSION:
        raise ProfileError(
            f"{path}: profile version {profile.version}, this worker reads {PROFILE_VERSION}"
        )
    try:
        validate(profile)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    return profile
