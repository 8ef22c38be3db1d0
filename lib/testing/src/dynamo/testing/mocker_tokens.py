"""The tokens a mocker worker produces for a completion, computed the way it does, so a
fault test can tell a stream that lost or repeated tokens from one that migrated cleanly.

The mocker's tokens depend only on the engine seed, the request's seed and its prompt
(`dynamo.mocker.tokens`). A request migrated after N tokens is resumed elsewhere with the
prompt plus those N tokens, so its text is the original's first N tokens followed by what
that continuation produces; a token dropped or sent twice matches no such split.
"""

from __future__ import annotations

from pathlib import Path

from dynamo.frontend.postprocess.detokenizer import REPLACEMENT
from dynamo.llm.protocols import PreprocessedRequest, StopConditions
from dynamo.mocker.args import EngineFlags
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.model_info import ModelInfo
from dynamo.mocker.request import admit_request


class ExpectedTokens:
    """Expected mocker output for token-id prompts with `ignore_eos` and a fixed
    `max_tokens`, for workers running the mocker's default engine flags."""

    def __init__(self, model_dir: Path, model: str) -> None:
        from transformers import AutoTokenizer

        self.model = model
        self._config: MockEngineConfig = EngineFlags().engine_config(ModelInfo.load(model_dir))
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def tokens(self, prompt: list[int], count: int) -> list[int]:
        request = PreprocessedRequest(
            request_id="expected", model=self.model, token_ids=prompt,
            stop_conditions=StopConditions(max_tokens=count, ignore_eos=True),
        )  # fmt: skip
        tokens, _, _ = admit_request(request, "expected", self._config).sample(count, 0.0)
        assert len(tokens) == count
        return tokens

    def text(self, tokens: list[int]) -> str:
        """The text the frontend sends for `tokens`: a character the last tokens leave
        incomplete is dropped at the end of a stream, not sent as U+FFFD
        (`IncrementalDetokenizer.flush`)."""
        return self._tokenizer.decode(
            tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False
        ).rstrip(REPLACEMENT)

    def migrations(self, prompt: list[int], text: str, count: int, depth: int = 2) -> int | None:
        """How many times the request was resumed elsewhere (0: never) for `text` to be
        its output of `count` tokens; None when no split with up to `depth` resumptions
        gives `text` (tokens were lost or repeated)."""
        return self._explain(prompt, [], text, count, depth)

    def _explain(
        self, prompt: list[int], before: list[int], text: str, count: int, depth: int
    ) -> int | None:
        """`before` was generated, then the request was resumed with `prompt` (the original
        prompt plus `before`) for the `count` tokens left."""
        own = self.tokens(prompt, count)
        if self.text(before + own) == text:
            return 0
        if depth == 0:
            return None
        for n in range(1, count):
            head = before + own[:n]
            if not text.startswith(self.text(head)):
                continue
            found = self._explain([*prompt, *own[:n]], head, text, count - n, depth - 1)
            if found is not None:
                return found + 1
        return None
