"""The chaos soak, short: half a minute of faults (a whole round, so every kind at least
once) over mocker workers (the full soak, with a real vLLM worker, is
`benchmarks/chaos_soak.py`; its figures are in docs/reliability.md).

Claims: under every fault kind (worker SIGKILL and SIGSTOP, a NATS node restart, a
frontend child SIGKILL), each injected at least once, no request hangs, no checked
completion loses or repeats a token (migrations included), requests keep completing, and
the KV routers' bookings fall back to 0."""

from __future__ import annotations

from pathlib import Path

from dynamo.testing.chaos import run_soak
from dynamo.testing.chaos_records import FAULT_KINDS, SoakConfig


def test_a_round_of_faults_hangs_nothing_and_loses_no_token(
    embedded_model: Path, tmp_path: Path
) -> None:
    config = SoakConfig(
        model_dir=embedded_model,
        log_dir=tmp_path,
        duration_s=30,
        clients=6,
        fault_every_s=4,
        seed=1,
        vllm=False,
        request_deadline_s=120,
    )
    report = run_soak(config)
    print(report.render())
    assert {f.kind for f in report.faults} == set(FAULT_KINDS), report.faults
    assert report.totals.get("hung", 0) == 0, report.problems
    assert report.totals.get("wrong", 0) == 0, report.problems
    assert report.totals.get("completed", 0) > 50, report.render()
    for kind in FAULT_KINDS:
        assert report.table[kind].get("completed", 0) > 0, f"nothing completed under {kind}"
    assert not any(report.bookings_after.values()), report.bookings_after
    before, after = report.frontend_rss_mib
    assert after - before < 300, f"frontend RSS grew from {before:.0f} to {after:.0f} MiB"
