"""The mocker's role flags in disaggregated serving: `--disaggregation-mode
agg|prefill|decode`, with `--is-prefill-worker` / `--is-decode-worker` as aliases, named and
read as `python -m dynamo.vllm` names and reads them (`dynamo.llm.worker.roles`), with help
texts that say what each role simulates.
"""

from __future__ import annotations

from dynamo.llm.worker.roles import PREFILL_COMPONENT, WORKER_TYPES
from dynamo.runtime.cli import TakesArguments


def add_disaggregation_arguments(group: TakesArguments) -> None:
    """The role flags, with vLLM's worker's names and meaning."""
    group.add_argument(
        "--disaggregation-mode",
        choices=tuple(WORKER_TYPES),
        default=None,
        help="Aggregated worker (agg, the default), or one half of disaggregated serving: "
        "prefill (computes prompts, answers with disaggregated_params, registers under "
        f"component {PREFILL_COMPONENT!r}) or decode (loads a prefill worker's KV instead "
        "of computing the prompt, after a simulated transfer; prefills itself when a "
        "request comes without one). The frontend pairs them by worker type.",
    )
    group.add_argument(
        "--is-prefill-worker",
        action="store_true",
        help="Same as --disaggregation-mode prefill.",
    )
    group.add_argument(
        "--is-decode-worker",
        action="store_true",
        help="Same as --disaggregation-mode decode.",
    )
