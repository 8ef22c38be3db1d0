"""A decode worker admits transferred KV only when it is laid out like its own, and says
why it refused once per foreign layout, not once per request."""

from __future__ import annotations

import logging

import pytest

from dynamo.vllm.kv_transfer.layout import KV_LAYOUT_PARAM, KvLayoutCheck

OWN = "2 layers + 1 draft layers (mtp), 1 KV heads x 64, block 32, bfloat16"
PLAIN = "2 layers + no draft layers, 1 KV heads x 64, block 32, bfloat16"
OTHER_BLOCK = "2 layers + 1 draft layers (mtp), 1 KV heads x 64, block 64, bfloat16"


def test_same_layout_and_unnamed_layouts_are_admitted() -> None:
    check = KvLayoutCheck(OWN)
    assert check.admits({KV_LAYOUT_PARAM: OWN}, "r1")
    # A client's own kv_transfer_params, or a prefill worker that names no layout.
    assert check.admits({"remote_block_ids": [1]}, "r2")


def test_a_foreign_layout_is_refused_and_reported_once_per_layout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check = KvLayoutCheck(OWN)
    with caplog.at_level(logging.ERROR, logger="dynamo.vllm.kv_transfer.layout"):
        results = [check.admits({KV_LAYOUT_PARAM: layout}, f"r{i}")
                   for i, layout in enumerate([PLAIN, PLAIN, OTHER_BLOCK, PLAIN])]  # fmt: skip
    assert results == [False, False, False, False]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert PLAIN in messages[0] and OWN in messages[0] and "r0" in messages[0]
    assert OTHER_BLOCK in messages[1] and "r2" in messages[1]
    assert "--speculative-config" in messages[0]
