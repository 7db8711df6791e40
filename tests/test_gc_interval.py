"""Python's garbage collector during training (``--gc-interval``): no automatic collection
during the steps, the young generations collected on a schedule, the collector restored after
the run, also when it fails."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from maxscore.training import train
from test_training import small_config


class _GarbageCollectionLog(TrainerCallback):
    """Records, step by step, whether Python's collector is on and which collections ran."""

    def __init__(self, fail_at: int = 0) -> None:
        self.step = 0
        self.fail_at = fail_at
        self.enabled: list[bool] = []
        self.collections: list[tuple[int, int]] = []  # (step, generation)

    def record(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.collections.append((self.step, info["generation"]))

    def on_train_begin(self, args: object, state: object, control: object, **kw: object) -> None:
        gc.callbacks.append(self.record)

    def remove(self) -> None:
        if self.record in gc.callbacks:
            gc.callbacks.remove(self.record)

    def on_step_begin(self, args: object, state: Any, control: object, **kw: object) -> None:
        self.step = state.global_step + 1
        self.enabled.append(gc.isenabled())
        if self.step == self.fail_at:
            raise RuntimeError("a failing step")


@pytest.mark.parametrize("interval", [0, 2])
def test_garbage_collection_on_a_schedule(tmp_path: Path, interval: int) -> None:
    """gc_interval N: no automatic collection during training, the young generations collected
    at every N-th step's end, the collector restored after training; 0: automatic as before."""
    log = _GarbageCollectionLog()
    try:
        train(small_config(tmp_path, max_steps=6, save_steps=0, gc_interval=interval), [log])
    finally:
        log.remove()
    assert gc.isenabled()
    if interval == 0:  # Python's own collections, generation 0 first
        assert all(log.enabled) and any(gen == 0 for _, gen in log.collections)
        return
    assert log.enabled == [False] * 6
    scheduled = [(step, gen) for step, gen in log.collections if step <= 6 and gen == 1]
    assert [step for step, _ in scheduled] == [2, 4, 6]
    # Python's automatic collections are of generation 0 first; the full ones left are explicit
    # gc.collect() calls of the libraries (the final checkpoint's save makes one).
    assert not [step for step, gen in log.collections if gen == 0]


def test_garbage_collection_restored_when_training_fails(tmp_path: Path) -> None:
    log = _GarbageCollectionLog(fail_at=3)
    try:
        with pytest.raises(RuntimeError, match="a failing step"):
            train(small_config(tmp_path, max_steps=6, gc_interval=2), [log])
    finally:
        log.remove()
    assert log.enabled == [False] * 3
    assert gc.isenabled()
