"""Checkpoint integrity records: the size and SHA-256 of every file, written at save time.

A checkpoint folder holds ``integrity.json``::

    {"format": 1, "algorithm": "sha256",
     "files": {"model.safetensors": {"size": 123, "sha256": "..."}, ...}}

written in the staging folder after every other file and before the folder is published
(``checkpoint.publish_checkpoint``), so a published checkpoint always carries the record of the
bytes it was saved with. :func:`verify_checkpoint` finds truncated, overwritten or missing
files; a checkpoint saved without a record (older maxscore, or any Hugging Face model folder)
gets a structural check of its ``.safetensors`` files instead (header readable, data as long as
the header says), which catches truncation but not overwritten bytes.

Nothing here imports torch: ``maxscore eval`` and ``--resume`` check files before loading them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

INTEGRITY_FILE = "integrity.json"
_FORMAT = 1
_CHUNK = 1 << 22

#: Files a model loader reads; ``eval`` verifies only these (the optimizer state can be twice
#: the model's size and does not affect evaluation).
TRAINING_STATE_FILES = frozenset(
    {"optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin", "rng_state.pth"}
)


def is_training_state(name: str) -> bool:
    """Whether ``name`` (relative path) is optimizer / scheduler / RNG state, not the model
    (``optimizer.dcp/``: the optimizer state of an expert-parallel run)."""
    return (
        name in TRAINING_STATE_FILES
        or name.startswith("rng_state")
        or name.startswith("optimizer.dcp/")
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != INTEGRITY_FILE)


def write_integrity_record(folder: Path) -> Path:
    """Record size and SHA-256 of every file under ``folder`` in ``folder/integrity.json``."""
    files = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(folder)
    }
    record = {"format": _FORMAT, "algorithm": "sha256", "files": files}
    path = folder / INTEGRITY_FILE
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file (header length, JSON, data length)."""
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                return f"{path.name}: header claims {header_len} bytes, file has {size}"
            header = json.loads(handle.read(header_len))
    except (struct.error, ValueError) as err:
        return f"{path.name}: unreadable safetensors header ({err})"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return f"{path.name}: truncated ({size} bytes, the header needs {expected})"
    return None


def verify_checkpoint(
    folder: Path, include: Callable[[str], bool] = lambda name: True
) -> list[str]:
    """Problems found in checkpoint ``folder`` (empty: intact), one short sentence each.

    With a record: every recorded file that ``include`` accepts must exist with the recorded
    size and SHA-256. Without one: every ``.safetensors`` file must be complete.
    """
    record_path = folder / INTEGRITY_FILE
    if not record_path.is_file():
        return [
            problem
            for path in sorted(folder.glob("*.safetensors"))
            if (problem := _safetensors_problem(path)) is not None
        ]
    try:
        record = json.loads(record_path.read_text())
        files: dict[str, dict] = record["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{INTEGRITY_FILE}: unreadable ({err})"]
    problems = []
    for name, expected in sorted(files.items()):
        if not include(name):
            continue
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != expected["size"]:
            problems.append(
                f"{name}: {path.stat().st_size} bytes, {expected['size']} when saved (truncated?)"
            )
        elif _sha256(path) != expected["sha256"]:
            problems.append(f"{name}: contents changed since it was saved (checksum mismatch)")
    return problems


def has_integrity_record(folder: Path) -> bool:
    return (folder / INTEGRITY_FILE).is_file()


def newest_intact(
    checkpoints: Iterable[Path],
    include: Callable[[str], bool] = lambda name: True,
) -> tuple[Path | None, dict[Path, list[str]]]:
    """The newest checkpoint of ``checkpoints`` (oldest first) that verifies, and the problems
    of every newer one that does not."""
    damaged: dict[Path, list[str]] = {}
    for folder in reversed(list(checkpoints)):
        problems = verify_checkpoint(folder, include)
        if not problems:
            return folder, damaged
        damaged[folder] = problems
    return None, damaged


def describe_damage(damaged: dict[Path, list[str]]) -> str:
    """``checkpoint-8 (model.safetensors: ...); checkpoint-6 (...)`` for messages."""
    return "; ".join(f"{path.name} ({', '.join(problems)})" for path, problems in damaged.items())
