"""A full disk or a read-only folder under ``analyze``, ``report`` and ``eval``: one line, exit 2.

Their files (``analysis.json`` / ``.md``, the PNGs, ``report.md``, ``eval_results.json`` /
``.md``, ``samples_*.jsonl``) go through ``maxscore.write_errors``: each is written into a
temporary file beside it and renamed over it when complete. Each fault here is injected into
the command line as a user meets it and must end in one error line naming the file, exit status
2, no traceback, an earlier file of the same name unchanged and no temporary file left behind.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
from matplotlib.figure import Figure

from maxscore.cli import main
from maxscore.evaluation import commands as eval_commands
from maxscore.evaluation.results import write_results
from maxscore.training.write_errors import RunWriteError
from maxscore.training.write_errors import reported_write as run_reported_write
from maxscore.write_errors import (
    FileWriteError,
    replaced_file,
    reported_write,
    write_text_atomically,
)
from test_analysis import make_run

EARLIER = "an earlier, complete file\n"


def no_space(path: object) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def read_only(path: object) -> OSError:
    return OSError(errno.EROFS, "Read-only file system", str(path))


def error_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The one line on stderr, ``maxscore <command>: error: ...``; no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"maxscore {command}: error: could not write "), err
    return lines[0]


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def fail_writing(monkeypatch: pytest.MonkeyPatch, name: str, error: Any) -> None:
    """``Path.write_text`` of the file called ``name`` (or its temporary file) writes half the
    text, then fails with ``error(path)`` as a filling disk does."""
    real = Path.write_text

    def write_text(self: Path, data: str, *args: Any, **kw: Any) -> int:
        if self.name == name or self.name.startswith(f".{name}."):
            real(self, data[: len(data) // 2], *args, **kw)
            raise error(self)
        return real(self, data, *args, **kw)

    monkeypatch.setattr(Path, "write_text", write_text)


def fail_renaming_onto(monkeypatch: pytest.MonkeyPatch, name: str, error: Any) -> None:
    """``os.replace`` onto the file called ``name`` fails with ``error(path)``."""
    real = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        if Path(dst).name == name:
            raise error(dst)
        real(src, dst, *args, **kw)

    monkeypatch.setattr(os, "replace", replace)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path / "gshard", "gshard", 0)


# ------------------------------------------------------------------------------------------------
# maxscore analyze
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "inject", "error", "reason"),
    [
        ("analysis.json", fail_writing, no_space, "(the disk is full)"),
        ("analysis.md", fail_writing, read_only, "(the file system is read-only)"),
        ("analysis.json", fail_renaming_onto, read_only, "(the file system is read-only)"),
    ],
)
def test_analyze_keeps_the_earlier_analysis(
    run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    inject: Any,
    error: Any,
    reason: str,
) -> None:
    out = tmp_path / "analysis"
    assert main(["analyze", str(run), "--output", str(out)]) == 0
    (out / name).write_text(EARLIER)
    capsys.readouterr()
    inject(monkeypatch, name, error)
    assert main(["analyze", str(run), "--output", str(out)]) == 2
    line = error_line(capsys, "analyze")
    assert f"{out / name} {reason}; an earlier file of that name is unchanged;" in line
    assert "choose another --output" in line
    assert (out / name).read_text() == EARLIER
    assert temporaries(out) == []


def test_analyze_with_a_read_only_figure_keeps_the_earlier_png(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "analysis"
    assert main(["analyze", str(run), "--output", str(out)]) == 0
    earlier = (out / "loss_curves.png").read_bytes()
    capsys.readouterr()
    real_savefig = Figure.savefig

    def savefig(self: Figure, fname: Any, *args: Any, **kw: Any) -> None:
        if Path(fname).name.startswith(".loss_curves.png."):
            Path(fname).write_bytes(b"\x89PNG half")
            raise no_space(fname)
        real_savefig(self, fname, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    assert main(["analyze", str(run), "--output", str(out)]) == 2
    line = error_line(capsys, "analyze")
    assert f"could not write the figure {out / 'loss_curves.png'} (the disk is full)" in line
    assert (out / "loss_curves.png").read_bytes() == earlier
    assert temporaries(out) == []


def test_analyze_into_a_read_only_folder(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The output folder itself cannot be made: one line naming it."""
    out = tmp_path / "ro" / "analysis"
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: Any, **kw: Any) -> None:
        if self == out:
            raise read_only(self)
        real_mkdir(self, *args, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert main(["analyze", str(run), "--output", str(out)]) == 2
    line = error_line(capsys, "analyze")
    assert f"the output folder {out} (the file system is read-only)" in line


# ------------------------------------------------------------------------------------------------
# maxscore report
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("inject", "error", "reason"),
    [
        (fail_writing, no_space, "(the disk is full)"),
        (fail_renaming_onto, read_only, "(the file system is read-only)"),
    ],
)
def test_report_keeps_the_earlier_report(
    run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    inject: Any,
    error: Any,
    reason: str,
) -> None:
    assert main(["analyze", str(run)]) == 0  # into RUN/analysis, which the report embeds
    report = tmp_path / "site" / "report.md"
    assert main(["report", str(run), "--output", str(report)]) == 0
    assert "## Routing analysis" in report.read_text()
    report.write_text(EARLIER)
    capsys.readouterr()
    inject(monkeypatch, "report.md", error)
    assert main(["report", str(run), "--output", str(report)]) == 2
    line = error_line(capsys, "report")
    assert f"could not write the report {report} {reason}" in line
    assert report.read_text() == EARLIER
    assert temporaries(report.parent) == []


# ------------------------------------------------------------------------------------------------
# maxscore eval (its result files; the evaluation itself is replaced by a fixed result)
# ------------------------------------------------------------------------------------------------
MODEL_RESULT = {
    "name": "tiny",
    "metrics": {"piqa": {"acc": 0.61}},
    "routing": {"eval_routing": "causal"},
}


def test_eval_keeps_the_earlier_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "eval"
    write_results(out, [MODEL_RESULT], {"limit": None})
    (out / "eval_results.json").write_text(EARLIER)
    monkeypatch.setattr(eval_commands, "resolve_model_path", lambda path: None)
    monkeypatch.setattr(eval_commands, "resolve_tasks", lambda tasks, source: None)
    monkeypatch.setattr(eval_commands, "evaluate_model", lambda path, tasks, **kw: MODEL_RESULT)
    fail_writing(monkeypatch, "eval_results.json", no_space)
    argv = ["eval", str(tmp_path / "ckpt"), "--tasks", "piqa", "--output", str(out)]
    assert main(argv) == 2
    line = error_line(capsys, "eval")
    assert f"the evaluation results {out / 'eval_results.json'} (the disk is full)" in line
    assert (out / "eval_results.json").read_text() == EARLIER
    assert temporaries(out) == []


def test_eval_samples_are_written_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class WithSamples:
        name = "tiny"
        samples: ClassVar[dict[str, Any]] = {
            "piqa": [{"doc_id": 0, "acc": 1.0}, {"doc_id": 1, "acc": 0.0}]
        }

        def to_dict(self) -> dict[str, Any]:
            return MODEL_RESULT

    out = tmp_path / "eval"
    write_results(out, [WithSamples()], {})
    samples = out / "samples_tiny.jsonl"
    assert [json.loads(line)["doc_id"] for line in samples.read_text().splitlines()] == [0, 1]
    samples.write_text(EARLIER)
    fail_renaming_onto(monkeypatch, "samples_tiny.jsonl", no_space)
    with pytest.raises(FileWriteError, match=r"the evaluation samples .* \(the disk is full\)"):
        write_results(out, [WithSamples()], {})
    assert samples.read_text() == EARLIER
    assert temporaries(out) == []


# ------------------------------------------------------------------------------------------------
# the shared writer
# ------------------------------------------------------------------------------------------------
def test_an_unrecognised_failure_keeps_its_traceback_and_the_earlier_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a full disk or a read-only folder: a bug, raised as it is, nothing replaced."""
    path = tmp_path / "table.md"
    path.write_text(EARLIER)
    fail_writing(monkeypatch, "table.md", lambda p: ValueError("a bug"))
    with pytest.raises(ValueError, match="a bug"):
        write_text_atomically(path, "new text", "the table")
    assert path.read_text() == EARLIER
    assert temporaries(tmp_path) == []


def test_a_new_file_gets_the_usual_mode(tmp_path: Path) -> None:
    """The temporary file's 0600 is not what the user finds: ``open(path, "w")``'s mode."""
    mask = os.umask(0o022)
    try:
        with replaced_file(tmp_path / "a.md") as tmp:
            tmp.write_text("x")
    finally:
        os.umask(mask)
    assert (tmp_path / "a.md").stat().st_mode & 0o777 == 0o644


def test_a_shared_writer_inside_a_run_gets_the_runs_advice(tmp_path: Path) -> None:
    """A figure of ``compare`` (written by the shared writer) fails: the run's advice, in the
    run's error class (one of the CLI's user errors)."""
    figure = tmp_path / "loss_curves.png"
    with (
        pytest.raises(RunWriteError, match=r"loss_curves.png \(the disk is full\)") as caught,
        run_reported_write("the comparison files in", tmp_path, advice="rerun with --overwrite"),
        reported_write("the figure", figure),
    ):
        raise no_space(figure)
    assert str(caught.value).endswith("rerun with --overwrite")
