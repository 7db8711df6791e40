"""``--model`` names: a preset typo is refused at once with a suggestion, a Hub name is not
retried against an offline Hub, and ``maxscore presets`` reads its tables without torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Imported here, so that the timings below are the check's, not the first import's.
import maxscore.training.run  # noqa: F401
from maxscore.cli import main
from maxscore.training import ConfigError, pretrained
from test_data_txt import SMALL_FLAGS


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything asks the network or the Hub cache."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(pretrained, "_connection_error", forbidden)
    monkeypatch.setattr(pretrained, "_in_hub_cache", forbidden)
    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", forbidden)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], float]:
    start = time.perf_counter()
    code = main(argv)
    elapsed = time.perf_counter() - start
    return code, capsys.readouterr().err.strip().splitlines(), elapsed


def test_a_preset_typo_is_refused_at_once_with_a_suggestion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_hub: None
) -> None:
    run = tmp_path / "run"
    argv = ["train", *SMALL_FLAGS, "--model", "tiyn", "--output-dir", str(run)]
    code, err, elapsed = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert "unknown model preset 'tiyn'; did you mean 'tiny'?" in err[0]
    assert elapsed < 2, elapsed
    assert not run.exists()
    with pytest.raises(ConfigError, match="did you mean 'base-2x32'"):
        pretrained.check_model_name("base2x32")


def test_offline_hub_name_fails_at_once_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_probe(*args: object) -> None:
        raise AssertionError("the network was probed although HF_HUB_OFFLINE is set")

    monkeypatch.setattr(pretrained, "_connection_error", no_probe)
    run = tmp_path / "run"
    argv = ["train", *SMALL_FLAGS, "--model", "someorg/somemodel", "--output-dir", str(run)]
    code, err, elapsed = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert "'someorg/somemodel' is not a local folder and not in the Hugging Face cache" in err[0]
    assert "HF_HUB_OFFLINE=1" in err[0]
    assert elapsed < 2, elapsed
    assert not run.exists()


def test_no_network_is_detected_once_and_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls: list[tuple[str, int]] = []

    def refused(host: str, port: int, timeout: float) -> str:
        calls.append((host, port))
        return "[Errno 111] Connection refused"

    monkeypatch.setattr(pretrained, "_connection_error", refused)
    with pytest.raises(ConfigError, match=r"unknown model preset 'gigantic' .*no connection to"):
        pretrained.check_model_name("gigantic")
    assert len(calls) == 1
    # A cached model is read from the cache, without the Hub client's retries.
    monkeypatch.setattr(pretrained, "_in_hub_cache", lambda name: True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored by monkeypatch after the test
    pretrained.check_model_name("someorg/cached-model")
    assert constants.HF_HUB_OFFLINE is True and os.environ["HF_HUB_OFFLINE"] == "1"


def test_a_real_probe_is_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    # A closed local port: refused at once (and at most the timeout for any address).
    start = time.perf_counter()
    error = pretrained._connection_error.__wrapped__("127.0.0.1", 9, 0.5)
    assert error is not None and time.perf_counter() - start < 1.5


def test_presets_and_folders_never_ask_the_hub(tmp_path: Path, no_hub: None) -> None:
    for name in ("tiny", "base-2x64", "dense-xl", str(tmp_path)):
        pretrained.check_model_name(name)
    with pytest.raises(ConfigError, match="no checkpoint folder of that name exists"):
        pretrained.check_model_name("./no-such-run")


def _expected_presets_output() -> str:
    """`maxscore presets` as printed before, from the registries themselves."""
    from maxscore.models.presets import MODEL_PRESETS
    from maxscore.routing.presets import ROUTER_PRESETS

    lines = ["router presets (--router):"]
    for name, preset in ROUTER_PRESETS.items():
        paper = preset.paper_name
        label = f" [{paper}]" if paper and paper.lower() != name else ""
        lines.append(f"  {name:<22}{preset.description}{label}")
    lines += ["", "model presets (--model):"]
    lines += [f"  {name:<22}{preset.description}" for name, preset in MODEL_PRESETS.items()]
    return "\n".join(lines) + "\n"


def test_presets_command_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys\n"
        "from maxscore.cli import main\n"
        "code = main(['presets'])\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == _expected_presets_output()


def test_router_preset_table_is_the_registrys_source() -> None:
    from maxscore.preset_tables import ROUTER_PRESET_TABLE
    from maxscore.routing.presets import ROUTER_PRESETS

    assert list(ROUTER_PRESET_TABLE) == list(ROUTER_PRESETS)
    for name, data in ROUTER_PRESET_TABLE.items():
        preset = ROUTER_PRESETS[name]
        assert (preset.description, preset.paper_name) == (data.description, data.paper_name)
        for field, value in data.fields.items():
            assert getattr(preset.config, field) == value
