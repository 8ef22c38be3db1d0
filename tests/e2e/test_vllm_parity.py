"""A differential test against the anchor: vLLM's own OpenAI server (`vllm serve`, started
as a module) and this stack (frontend + the session's plain worker), same model, same
engine flags (`cpu_engine_flags`), the same requests sent to both one at a time, greedy.

Claims: for each case (every vLLM extension issue 36 names, and the fields served before
it), the two answers agree on the HTTP status; for a 200, on the text (equal, or apart
only at a bf16 tie, judged with `dynamo.testing.greedy` against the anchor's own top-20
logprobs: the two engines may compute a prompt in other shapes when their prefix caches
differ), the token ids, the finish reason, the usage and the logprobs and prompt logprobs
(within `LOGPROB_TOLERANCE`); for a 400, on the parameter named. The test prints the
table (case, vLLM, this stack, verdict). Every difference that remains is in `DOCUMENTED`
with its reason, which docs/frontend.md gives too; the test fails on any other.

Ids, timestamps, `system_fingerprint`, `stop_reason` and vLLM's other extra fields are not
compared; nor are the error messages' wording and `type` (OpenAI's `invalid_request_error`
here, vLLM's `BadRequestError`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.testing.greedy import (
    mismatch,
    reference_from_chat_logprobs,
    reference_from_completion_logprobs,
)
from dynamo.testing.http import http_post_json
from dynamo.testing.processes import (
    FrontendProcess,
    VllmServerProcess,
    WorkerProcess,
    spare_core_env,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# bf16 logits of a small model come in steps of 0.125 nats; a prompt computed in another
# shape (a prefix-cache hit on one server only) may move a logprob by a step or two.
LOGPROB_TOLERANCE = 0.3
# The embedded model's end-of-turn token as the logprobs list it.
END_OF_TURN = frozenset({b"<|im_end|>"})
QUESTION = "What is the capital of Japan? Answer in one sentence."
BASE = {
    COMPLETIONS: {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0},
    CHAT: {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16, "temperature": 0},
}

# Cases whose answers differ on purpose, and why (docs/frontend.md, "Against vllm serve").
DOCUMENTED: dict[str, str] = {
    "beam search with stop": "vLLM's beam search ignores `stop` (and the other fields it does "
    "not read); here such a field is a 400 naming it",
    "top_logprobs over 20": "the 400 names `top_logprobs` (the field out of range); vLLM's "
    "names `logprobs`",
    "spaces_between_special_tokens": "`false` is refused: the detokenizer keeps the "
    "tokenizer's own spacing",
    "logits_processors": "refused: no request loads Python code here (vLLM ignores the field "
    "unless started with --logits-processor-pattern)",
    "vllm_xargs": "refused: they only reach custom logits processors, which are not loaded",
    "best_of": "refused: vLLM 0.32 ignores it (its V1 engine dropped best_of)",
}


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    fields: dict[str, Any]

    @property
    def body(self) -> dict[str, Any]:
        return {"model": DEFAULT_MODEL, **BASE[self.path], **self.fields}


def cases(token: Callable[[str], int]) -> list[Case]:
    """Every field to compare, with values that exercise it (`token`: the id of a text
    that is one token)."""
    comma, period = token(","), token(".")
    words = [token(w) for w in (" one", " two", " three", " four", " five")]
    assistant_turn = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "The capital of Japan"},
    ]
    return [
        Case("plain", COMPLETIONS, {}),
        Case("plain", CHAT, {}),
        Case("max_completion_tokens", CHAT, {"max_completion_tokens": 5}),
        Case("stop", COMPLETIONS, {"stop": [","]}),
        Case("stop", CHAT, {"stop": ["."]}),
        Case("stop_token_ids", COMPLETIONS, {"stop_token_ids": [comma, period]}),
        Case("include_stop_str_in_output", COMPLETIONS, {"stop": [","], "include_stop_str_in_output": True}),
        Case("include_stop_str_in_output", CHAT, {"stop": ["."], "include_stop_str_in_output": True}),
        Case("ignore_eos", CHAT, {"ignore_eos": True, "max_tokens": 24}),
        Case("min_tokens", CHAT, {"min_tokens": 20, "max_tokens": 24}),
        Case("skip_special_tokens", CHAT, {"skip_special_tokens": False, "ignore_eos": True, "max_tokens": 20}),
        Case("repetition_penalty", COMPLETIONS, {"repetition_penalty": 1.3}),
        Case("presence_penalty", CHAT, {"presence_penalty": 1.5}),
        Case("frequency_penalty", CHAT, {"frequency_penalty": 1.5}),
        Case("logit_bias", COMPLETIONS, {"logit_bias": {str(words[0]): 100}}),
        Case("logit_bias", CHAT, {"logit_bias": {str(words[1]): 100}, "max_tokens": 4}),
        Case("allowed_token_ids", COMPLETIONS, {"allowed_token_ids": words}),
        Case("bad_words", COMPLETIONS, {"bad_words": [" Paris"]}),
        Case("n with greedy sampling", COMPLETIONS, {"n": 2}),  # vLLM's rule: refused
        Case("logprobs", COMPLETIONS, {"logprobs": 3}),
        Case("logprobs", CHAT, {"logprobs": True, "top_logprobs": 3}),
        Case("prompt_logprobs", COMPLETIONS, {"prompt_logprobs": 2}),
        Case("prompt_logprobs", CHAT, {"prompt_logprobs": 1}),
        Case("echo", COMPLETIONS, {"echo": True}),
        Case("echo with logprobs", COMPLETIONS, {"echo": True, "logprobs": 2}),
        Case("echo", CHAT, {"echo": True, "messages": assistant_turn, "add_generation_prompt": False, "continue_final_message": True}),
        Case("return_token_ids", COMPLETIONS, {"return_token_ids": True}),
        Case("return_token_ids", CHAT, {"return_token_ids": True}),
        Case("return_tokens_as_token_ids", COMPLETIONS, {"logprobs": 2, "return_tokens_as_token_ids": True}),
        Case("return_tokens_as_token_ids", CHAT, {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}),
        Case("logprob_token_ids", COMPLETIONS, {"logprobs": 0, "logprob_token_ids": words[:3]}),
        Case("logprob_token_ids", CHAT, {"logprobs": True, "logprob_token_ids": words[:2]}),
        Case("truncate_prompt_tokens", COMPLETIONS, {"truncate_prompt_tokens": 3}),
        Case("truncate_prompt_tokens", CHAT, {"truncate_prompt_tokens": 12}),
        Case("truncation_side", COMPLETIONS, {"truncate_prompt_tokens": 3, "truncation_side": "right"}),
        Case("add_special_tokens", CHAT, {"add_special_tokens": True}),
        Case("add_special_tokens", COMPLETIONS, {"add_special_tokens": False}),
        Case("reasoning_effort", CHAT, {"reasoning_effort": "low"}),
        Case("documents", CHAT, {"documents": [{"title": "Japan", "text": "Tokyo is the capital."}]}),
        Case("chat_template_kwargs", CHAT, {"chat_template_kwargs": {"enable_thinking": False}}),
        Case("response_format", CHAT, {"response_format": {"type": "json_object"}, "max_tokens": 24}),
        Case("structured_outputs", COMPLETIONS, {"structured_outputs": {"choice": ["Paris", "Lyon"]}}),
        Case("use_beam_search", COMPLETIONS, {"use_beam_search": True, "n": 2}),
        Case("use_beam_search", CHAT, {"use_beam_search": True, "n": 3, "length_penalty": 0.5}),
        Case("beam search with stop", COMPLETIONS, {"use_beam_search": True, "n": 2, "stop": [","]}),
        Case("thinking_token_budget", CHAT, {"thinking_token_budget": 8}),
        # Fields this stack refuses (docs/frontend.md says why, row by row).
        Case("spaces_between_special_tokens", CHAT, {"spaces_between_special_tokens": False, "skip_special_tokens": False}),
        Case("chat_template", CHAT, {"chat_template": "{{ messages[0]['content'] }}"}),
        Case("logits_processors", COMPLETIONS, {"logits_processors": ["my.module:Processor"]}),
        Case("vllm_xargs", COMPLETIONS, {"vllm_xargs": {"k": 1}}),
        Case("prompt_embeds", COMPLETIONS, {"prompt_embeds": "AAAA"}),
        Case("suffix", COMPLETIONS, {"suffix": " end"}),
        Case("best_of", COMPLETIONS, {"best_of": 2, "n": 1}),
        # Bad values: both refuse, naming the same parameter.
        Case("bad truncate_prompt_tokens", COMPLETIONS, {"truncate_prompt_tokens": -2}),
        Case("bad truncation_side", COMPLETIONS, {"truncate_prompt_tokens": 3, "truncation_side": "middle"}),
        Case("bad prompt_logprobs", COMPLETIONS, {"prompt_logprobs": -2}),
        Case("streamed prompt_logprobs", COMPLETIONS, {"prompt_logprobs": 1, "stream": True}),
        Case("logprob_token_ids without logprobs", CHAT, {"logprob_token_ids": words[:2]}),
        Case("bad reasoning_effort", CHAT, {"reasoning_effort": "huge"}),
        Case("top_logprobs over 20", CHAT, {"logprobs": True, "top_logprobs": 21}),
        Case("max_tokens over the context", COMPLETIONS, {"max_tokens": 4096}),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def anchor(embedded_model: Path, e2e_log_dir: Path) -> Iterator[VllmServerProcess]:
    server = VllmServerProcess(
        "vllm-serve", embedded_model, DEFAULT_MODEL, e2e_log_dir, env=spare_core_env()
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ours(
    plain_worker: WorkerProcess, nats_url: str, e2e_log_dir: Path
) -> Iterator[FrontendProcess]:
    """A frontend over the plain worker only (the shared `frontend` serves the n-gram one)."""
    frontend = FrontendProcess(
        "parity-frontend", nats_url, e2e_log_dir, namespace=plain_worker.namespace
    )
    try:
        frontend.wait_for_model(DEFAULT_MODEL)
        yield frontend
    finally:
        frontend.stop()


def post(base_url: str, case: Case, extra: dict[str, Any] | None = None) -> tuple[int, Any]:
    body = {**case.body, **(extra or {})}
    status, text = http_post_json(f"{base_url}{case.path}", body, timeout=120)
    if body.get("stream") and status == 200:
        return status, text  # an SSE body; the cases stream only to be refused
    return status, json.loads(text)


# ----------------------------------------------------------------------------- comparing


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= LOGPROB_TOLERANCE


def near_boundary(values: dict[str, float], keys: set[str]) -> bool:
    """`keys` (listed by one side only) all sit within the tolerance of the list's last
    value: a tie for the last places, which rounding may order either way."""
    if not values:
        return False
    floor = min(values.values())
    return all(key in values and values[key] - floor <= LOGPROB_TOLERANCE for key in keys)


def diff_top(theirs: dict[str, float], ours: dict[str, float], where: str) -> list[str]:
    problems = []
    only = set(theirs) ^ set(ours)
    if only and not (
        near_boundary(theirs, only & set(theirs)) and near_boundary(ours, only & set(ours))
    ):
        problems.append(
            f"{where}: alternatives {sorted(set(theirs) - set(ours))} / {sorted(set(ours) - set(theirs))}"
        )
    for key in set(theirs) & set(ours):
        if not close(theirs[key], ours[key]):
            problems.append(f"{where}: {key!r} {theirs[key]:.3f} / {ours[key]:.3f}")
    return problems  # fmt: skip


Diff = Callable[[Any, Any], list[str]]


def present_on_both_sides(field: str) -> Callable[[Diff], Diff]:
    """Wrap a diff of `field` (anchor's value, ours) so that it runs only when both sides
    have the field: on one side only that is the one problem, on neither there is none."""

    def wrap(diff: Diff) -> Diff:
        @functools.wraps(diff)
        def diff_present(theirs: Any, ours: Any) -> list[str]:
            if (theirs is None) != (ours is None):
                return [f"{field} {'absent' if ours is None else 'extra'} here"]
            return [] if theirs is None else diff(theirs, ours)

        return diff_present

    return wrap


@present_on_both_sides("logprobs")
def diff_completion_logprobs(theirs: Any, ours: Any) -> list[str]:
    if theirs["tokens"] != ours["tokens"]:
        return [f"logprob tokens {theirs['tokens']} / {ours['tokens']}"]
    problems = [
        f"token_logprobs[{i}] {a} / {b}"
        for i, (a, b) in enumerate(
            zip(theirs["token_logprobs"], ours["token_logprobs"], strict=True)
        )
        if not close(a, b)
    ]
    for i, (a, b) in enumerate(zip(theirs["top_logprobs"], ours["top_logprobs"], strict=True)):
        if (a is None) != (b is None):
            problems.append(f"top_logprobs[{i}] {a} / {b}")
        elif a is not None:
            problems += diff_top(a, b, f"top_logprobs[{i}]")
    if theirs["text_offset"] != ours["text_offset"]:
        problems.append("text_offset")
    return problems  # fmt: skip


@present_on_both_sides("logprobs")
def diff_chat_logprobs(theirs: Any, ours: Any) -> list[str]:
    a, b = theirs["content"], ours["content"]
    if [e["token"] for e in a] != [e["token"] for e in b]:
        return [f"logprob tokens {[e['token'] for e in a]} / {[e['token'] for e in b]}"]
    problems = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not close(x["logprob"], y["logprob"]):
            problems.append(f"content[{i}].logprob {x['logprob']} / {y['logprob']}")
        tops = ({t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in (x, y))
        problems += diff_top(*tops, f"content[{i}].top_logprobs")
    return problems


@present_on_both_sides("prompt_logprobs")
def diff_prompt_logprobs(theirs: Any, ours: Any) -> list[str]:
    if len(theirs) != len(ours):
        return [f"prompt_logprobs: {len(theirs)} / {len(ours)} positions"]
    problems = []
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if (a is None) != (b is None):
            problems.append(f"prompt_logprobs[{i}] {a} / {b}")
        elif a is not None:
            values = ({k: v["logprob"] for k, v in p.items()} for p in (a, b))
            problems += diff_top(*values, f"prompt_logprobs[{i}]")
            texts = ({k: v["decoded_token"] for k, v in p.items()} for p in (a, b))
            x, y = texts
            if any(x[k] != y[k] for k in set(x) & set(y)):
                problems.append(f"prompt_logprobs[{i}] decoded tokens")
    return problems


def choice_text(path: str, choice: dict[str, Any]) -> str:
    return choice["text"] if path == COMPLETIONS else choice["message"]["content"] or ""


def is_tie(anchor: VllmServerProcess, case: Case, index: int, ours: str) -> str | None:
    """Why `ours` is not the anchor's text up to a tie (None: it is), from the anchor's
    own answer to the case with its top-20 logprobs. (Beam search has no such reference:
    its beams must be the same.)"""
    if case.body.get("use_beam_search"):
        return "beam search: another beam"
    extra = {"logprobs": 20} if case.path == COMPLETIONS else {"logprobs": True, "top_logprobs": 20}
    status, reference = post(anchor.base_url, case, extra)
    if status != 200:
        return f"no reference ({status})"
    logprobs = reference["choices"][index]["logprobs"]
    if case.path == COMPLETIONS:
        tokens = reference_from_completion_logprobs(logprobs)
    else:
        tokens = reference_from_chat_logprobs(logprobs["content"], END_OF_TURN)
    # A completion that ended at the end-of-turn token lists it last; its text is not
    # part of the answer (the chat reference already ends there, see greedy).
    return mismatch([t for t in tokens if t.data not in END_OF_TURN], ours, stops=END_OF_TURN)


def compare(
    anchor: VllmServerProcess, case: Case, theirs: Any, ours: Any
) -> tuple[list[str], bool]:
    """The differences between two 200 answers, and whether a choice parted at a tie (its
    other fields are then not compared: they follow other tokens)."""
    problems: list[str] = []
    tied = False
    if len(theirs["choices"]) != len(ours["choices"]):
        return [f"{len(theirs['choices'])} / {len(ours['choices'])} choices"], False
    for index, (a, b) in enumerate(zip(theirs["choices"], ours["choices"], strict=True)):
        text_a, text_b = choice_text(case.path, a), choice_text(case.path, b)
        if text_a != text_b:
            why = is_tie(anchor, case, index, text_b)
            if why is None:
                tied = True
                continue
            problems.append(f"text {text_a!r} / {text_b!r}: {why}")
            continue
        if a["finish_reason"] != b["finish_reason"]:
            problems.append(f"finish_reason {a['finish_reason']} / {b['finish_reason']}")
        for key in ("token_ids", "prompt_token_ids"):
            if a.get(key) != b.get(key):
                problems.append(f"choices[{index}].{key}")
        if case.path == COMPLETIONS:
            problems += diff_completion_logprobs(a.get("logprobs"), b.get("logprobs"))
            problems += diff_prompt_logprobs(a.get("prompt_logprobs"), b.get("prompt_logprobs"))
        else:
            problems += diff_chat_logprobs(a.get("logprobs"), b.get("logprobs"))
    if case.path == CHAT:
        if theirs.get("prompt_token_ids") != ours.get("prompt_token_ids"):
            problems.append("prompt_token_ids")
        problems += diff_prompt_logprobs(theirs.get("prompt_logprobs"), ours.get("prompt_logprobs"))
    usage = ("prompt_tokens", "completion_tokens")
    if not tied and any(theirs["usage"][k] != ours["usage"][k] for k in usage):
        problems.append(
            f"usage {[theirs['usage'][k] for k in usage]} / {[ours['usage'][k] for k in usage]}"
        )
    return problems, tied  # fmt: skip


def param_of(body: Any) -> str | None:
    """The parameter a 400 names; vLLM's schema errors say `body.<field>` (pydantic's
    location), which is the same field."""
    error = body.get("error") if isinstance(body, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    return param.removeprefix("body.") if isinstance(param, str) else param


def verdict(
    anchor: VllmServerProcess, case: Case, theirs: tuple[int, Any], ours: tuple[int, Any]
) -> str:
    """'same', 'same up to a tie', or what differs."""
    (status_a, body_a), (status_b, body_b) = theirs, ours
    if status_a != status_b:
        return f"status {status_a} / {status_b}"
    if status_a != 200:
        param_a, param_b = param_of(body_a), param_of(body_b)
        if param_a is not None and param_a != param_b:
            return f"param {param_a} / {param_b}"
        return "same"
    problems, tied = compare(anchor, case, body_a, body_b)
    if problems:
        return "; ".join(problems)
    return "same up to a tie" if tied else "same"


def summary(status: int, body: Any, path: str) -> str:
    if status != 200:
        return f"{status} {param_of(body) or ''}".strip()
    texts = [choice_text(path, choice) for choice in body["choices"]]
    return f"200 {' | '.join(texts)[:40]!r}"


def test_every_field_answers_as_vllm_serve_does(
    anchor: VllmServerProcess, ours: FrontendProcess, tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    def token(text: str) -> int:
        (only,) = tokenizer.encode(text, add_special_tokens=False)
        return only

    every_case = cases(token)
    # Each server answers the cases one at a time, in order; the two servers work side by
    # side (the anchor's engine computes on the other core), which halves the wait.
    with ThreadPoolExecutor(1) as pool:
        anchor_answers = pool.submit(lambda: [post(anchor.base_url, c) for c in every_case])
        our_answers = [post(ours.base_url, c) for c in every_case]
    rows = []
    for case, theirs, mine in zip(every_case, anchor_answers.result(), our_answers, strict=True):
        outcome = verdict(anchor, case, theirs, mine)
        rows.append((case, summary(*theirs, case.path), summary(*mine, case.path), outcome))
    width = max(len(f"{c.name} ({c.path})") for c, *_ in rows)
    lines = [f"{'case':<{width}} | vLLM | this stack | verdict"]
    for case, theirs_text, ours_text, outcome in rows:
        label = f"{case.name} ({case.path})"
        lines.append(f"{label:<{width}} | {theirs_text} | {ours_text} | {outcome}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    unexplained = [
        f"{case.name} ({case.path}): {outcome}"
        for case, _, _, outcome in rows
        if not outcome.startswith("same") and case.name not in DOCUMENTED
    ]
    assert not unexplained, "\n".join(unexplained)
