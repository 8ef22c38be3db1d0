"""`tune_for_serving`: start-up objects frozen, young collections rarer (run in a child
interpreter, so the test process keeps CPython's defaults)."""

from __future__ import annotations

import json
import subprocess
import sys

from dynamo.runtime.gc_tuning import MIDDLE_THRESHOLD, OLD_THRESHOLD, YOUNG_THRESHOLD

PROBE = """
import gc, json
from dynamo.runtime.gc_tuning import tune_for_serving
before = gc.get_threshold()
tune_for_serving()
cycle = []
cycle.append(cycle)  # garbage made after tuning is still collected
del cycle
print(json.dumps({"before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count(), "collected": gc.collect()}))
"""


def test_tune_for_serving_freezes_start_up_and_raises_the_young_threshold() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    report = json.loads(result.stdout)
    assert report["before"][0] < YOUNG_THRESHOLD
    assert report["after"] == [YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD]
    assert report["frozen"] > 1000  # the interpreter's and the imports' objects
    assert report["collected"] >= 1  # cycles are still found
