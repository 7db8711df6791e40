"""Plain ``.txt`` corpora: the document rule (``--txt-documents``) and why a file gives no
validation documents (empty, only white space, one document without blank lines, too few
documents for the validation fraction)."""

from __future__ import annotations

from pathlib import Path

import pytest

from maxscore.cli import build_parser, config_from_args, main
from maxscore.data.sources import load_text_splits, split_txt_documents
from maxscore.training import ConfigError, DataError, TrainConfig, prepare, train
from maxscore.training.data import build_training_data, load_tokenizer
from test_training import SMALL_MODEL, small_config

#: ``small_config``'s model and sizes as ``maxscore train`` flags.
SMALL_FLAGS = [
    *(flag for key, value in SMALL_MODEL.items() for flag in ("--model-option", f"{key}={value}")),
    *("--seq-len", "16", "--batch-size", "2", "--max-eval-blocks", "2"),
    *("--report-to", "none", "--quiet"),
]


def one_per_line(path: Path, lines: int = 300) -> Path:
    """A file of one document per line, no blank lines (like a 20,000-line corpus)."""
    path.write_text(
        "".join(f"line document {i} says something about routing\n" for i in range(lines))
    )
    return path


def splits_error(path: Path, **config: object) -> str:
    with pytest.raises(DataError) as caught:
        load_text_splits(TrainConfig(dataset=str(path), **config))  # type: ignore[arg-type]
    return str(caught.value)


# ------------------------------------------------------------------------------------------------
# the rule
# ------------------------------------------------------------------------------------------------
def test_paragraphs_are_separated_by_blank_lines_lines_by_newlines() -> None:
    text = "first doc\nits second line\n\nsecond doc\n   \t\nthird doc\r\n\r\nfourth\n\n\n"
    assert split_txt_documents(text) == [
        "first doc\nits second line",
        "second doc",
        "third doc",
        "fourth",
    ]
    assert split_txt_documents(text, "lines") == [
        "first doc",
        "its second line",
        "second doc",
        "third doc",
        "fourth",
    ]
    with pytest.raises(DataError, match=r"unknown \.txt document rule"):
        split_txt_documents(text, "sentences")


def test_one_document_per_line_needs_the_lines_rule(tmp_path: Path) -> None:
    path = one_per_line(tmp_path / "corpus.txt")
    message = splits_error(path)
    assert "gives no validation documents" in message
    assert "the whole file is one document" in message
    assert "300 lines have no blank line" in message
    assert "--txt-documents lines" in message
    splits = load_text_splits(TrainConfig(dataset=str(path), txt_documents="lines"))
    assert len(splits.train or []) + len(splits.validation) == 300
    assert len(splits.validation) == 3  # validation_fraction 0.01


def test_empty_and_white_space_files_say_so(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n\t\n   \n")
    for rule in ("paragraphs", "lines"):
        assert splits_error(empty, txt_documents=rule).endswith(
            "gives no validation documents: the file is empty"
        )
        assert splits_error(blank, txt_documents=rule).endswith(
            "gives no validation documents: the file holds only white space"
        )
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("")
    (folder / "b.jsonl").write_text("")
    assert "its 2 data files are empty" in splits_error(folder)


def test_a_single_document_names_the_count_and_fraction(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_text("just one document on one line\n")
    message = splits_error(path, validation_fraction=0.05)
    assert "the file holds 1 document" in message
    assert "validation_fraction=0.05" in message
    assert "at least 2" in message


def test_too_few_validation_tokens_name_documents_and_fraction(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("\n\n".join(f"short document {i}" for i in range(40)))
    config = TrainConfig(dataset=str(path), seq_len=256, validation_fraction=0.01)
    with pytest.raises(DataError) as caught:
        build_training_data(config, load_tokenizer("default"))
    message = str(caught.value)
    assert "the 1 validation document of" in message
    assert "validation_fraction=0.01 of 40 documents" in message
    assert "no block of seq_len=256" in message


# ------------------------------------------------------------------------------------------------
# the option
# ------------------------------------------------------------------------------------------------
def test_option_is_a_config_field_and_a_flag() -> None:
    assert TrainConfig().txt_documents == "paragraphs"
    with pytest.raises(ConfigError, match="txt_documents must be one of"):
        TrainConfig(txt_documents="sentences")  # type: ignore[arg-type]
    args = build_parser().parse_args(["train", "--txt-documents", "lines"])
    assert config_from_args(args).txt_documents == "lines"
    assert config_from_args(build_parser().parse_args(["train"])).txt_documents == "paragraphs"


def test_help_documents_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "separated by blank lines" in out
    assert "--txt-documents {paragraphs,lines}" in out


def test_lines_rule_is_refused_where_it_means_nothing(tmp_path: Path) -> None:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert "applies to .txt files" in splits_error(jsonl, txt_documents="lines")
    with pytest.raises(DataError, match=r"applies to local \.txt files"):
        load_text_splits(TrainConfig(txt_documents="lines"))


# ------------------------------------------------------------------------------------------------
# end to end
# ------------------------------------------------------------------------------------------------
def test_cli_error_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = one_per_line(tmp_path / "corpus.txt")
    run = tmp_path / "run"
    argv = ["train", *SMALL_FLAGS, "--dataset", str(path), "--output-dir", str(run)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--txt-documents lines" in err[0], err
    assert not run.exists()


def test_a_one_document_per_line_file_trains(tmp_path: Path) -> None:
    path = one_per_line(tmp_path / "corpus.txt")
    config = small_config(
        tmp_path, dataset=str(path), txt_documents="lines", max_steps=2, save_steps=0
    )
    prepared = prepare(config)
    assert "corpus.txt" in prepared.data.description
    result = train(config, prepared=prepared)
    assert result.steps == 2
    assert result.eval_loss is not None and result.eval_loss == result.eval_loss  # not NaN
