"""`dynamo.vllm.speculative.k_in_force`: the K an adaptive scheduler chose, shared from vLLM's
engine core with the worker through a memory-mapped file."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from dynamo.vllm.speculative.k_in_force import (
    SpeculationSnapshot,
    SpeculationStateReader,
    SpeculationStateWriter,
    new_state_path,
)


def write_in_another_process(path: str, ks: list[int]) -> None:
    writer = SpeculationStateWriter(Path(path))
    for k in ks:
        writer.write(k)
    writer.close()


def test_the_reader_sees_nothing_until_the_scheduler_wrote(tmp_path: Path) -> None:
    path = tmp_path / "state"
    reader = SpeculationStateReader(path)
    assert reader.read() is None  # the engine core has not created the file yet
    writer = SpeculationStateWriter(path)
    assert reader.read() is None  # created, no decoding step yet
    writer.write(3)
    assert reader.read() == SpeculationSnapshot(k=3, steps=1, steps_at_k=(0, 0, 0, 1))
    writer.write(0)
    writer.write(2)
    writer.write(0)
    assert reader.read() == SpeculationSnapshot(k=0, steps=4, steps_at_k=(2, 0, 1, 1))
    writer.close()
    reader.close(remove=True)
    assert not path.exists()


def test_a_k_written_in_another_process_is_read_here(tmp_path: Path) -> None:
    path = tmp_path / "state"
    process = multiprocessing.get_context("spawn").Process(
        target=write_in_another_process, args=(str(path), [3, 1, 0, 2])
    )
    process.start()
    process.join(60)
    assert process.exitcode == 0
    reader = SpeculationStateReader(path)
    assert reader.read() == SpeculationSnapshot(k=2, steps=4, steps_at_k=(1, 1, 1, 1))
    reader.close(remove=True)


def test_each_worker_gets_its_own_path() -> None:
    first, second = new_state_path(), new_state_path()
    assert first != second and first.parent == second.parent
    assert not first.exists()
