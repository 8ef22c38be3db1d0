"""`python -m dynamo.planner.fit_mocker PROFILE`: the mocker timing flags that make simulated
workers step as the profiled engine does (`perf_model.fit_mocker_timing`), printed on one
line for a launch script, with the fit's worst error on stderr.

So that a mocker fleet needs as many replicas as real workers would, and the planner's
model (read from the same profile) agrees with what the mocker does."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from dynamo.llm.speculation_profile import ProfileError, load_profile
from dynamo.planner.args import DEFAULT_PREFILL_MS_PER_TOKEN
from dynamo.planner.perf_model import fit_mocker_timing
from dynamo.runtime.cli import positive_float


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.planner.fit_mocker",
        description="Print the dynamo.mocker timing flags fitted to a speculation profile.",
    )
    parser.add_argument("profile", type=Path, help="a profile_spec output (JSON)")
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="fit the speculating engine's step times (every K), not the plain engine's",
    )
    parser.add_argument(
        "--prefill-ms-per-token",
        type=positive_float,
        default=DEFAULT_PREFILL_MS_PER_TOKEN,
        help="prefill cost per prompt token (the profile does not measure it)",
    )
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fit = fit_mocker_timing(profile, speculative=args.speculative)
    print(" ".join(fit.flags(args.prefill_ms_per_token)))
    print(
        f"fit: worst error {fit.worst_relative_error:.1%} over the profile's points",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
