"""`tune_for_serving`: start-up objects frozen, young collections rarer (run in a child
interpreter, so the test process keeps CPython's defaults)."""

from __future__ import annotations

import json
import subprocess
import sys

from dynamo.runtime.gc_tuning import MIDDLE_THRESHOLD, OLD_THRESHOLD, YOUNG_THRESHOLD

PROBE = """
import atexit, gc, json
from dynamo.runtime.gc_tuning import tune_for_serving
# Runs after the handlers registered later (atexit is last in, first out).
atexit.register(lambda: print(json.dumps({"frozen_at_exit": gc.get_freeze_count()})))
before = gc.get_threshold()
tune_for_serving()
cycle = []
cycle.append(cycle)  # garbage made after tuning is still collected
del cycle
print(json.dumps({"before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count(), "collected": gc.collect()}))
"""


def test_tune_for_serving_freezes_start_up_raises_the_threshold_and_unfreezes_at_exit() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    first, last = result.stdout.splitlines()
    report = json.loads(first)
    assert report["before"][0] < YOUNG_THRESHOLD
    assert report["after"] == [YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD]
    assert report["frozen"] > 1000  # the interpreter's and the imports' objects
    assert report["collected"] >= 1  # cycles are still found
    # Unfrozen at exit, so shutdown finalizes start-up objects (extension types included).
    assert json.loads(last) == {"frozen_at_exit": 0}
