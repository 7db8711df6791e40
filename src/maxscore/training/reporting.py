"""``--report-to``: the experiment trackers a run logs to, passed through to the HF Trainer.

Values: ``auto`` (TensorBoard if installed, the default), ``none``, ``all`` (every tracker the
installed Trainer finds installed, as ``TrainingArguments(report_to="all")``), or a
comma-separated list of the Trainer's integrations (``transformers.integrations``'
``INTEGRATION_TO_CALLBACK``: ``wandb``, ``mlflow``, ``tensorboard``, ``trackio``, ``comet_ml``,
``clearml``, ``dvclive``, ``swanlab``, ...). TensorBoard is attached by maxscore itself so that
it writes into ``<run>/tensorboard``; the others go to ``TrainingArguments(report_to=...)`` and
are configured the usual way (their environment variables: ``WANDB_PROJECT``,
``MLFLOW_TRACKING_URI``, ...).

Checked in two places: :func:`parse_report_to` (in ``TrainConfig.validate``, no import) checks
the form; :func:`check_report_to` (before anything is written) refuses names the installed
Trainer does not know and trackers that are not installed, with the package to install. A
tracker that fails to start at the first step (a bad tracking URI, a store it cannot write) stops
the run with one line naming it (:func:`guard_tracker_start`, :class:`TrackerStartError`), and
the run directory is kept.
"""

from __future__ import annotations

import re
from typing import Any

from maxscore.config_types import ConfigError
from maxscore.training.continue_command import how_to_continue

__all__ = [
    "TRACKER_PACKAGES",
    "TrackerStartError",
    "check_report_to",
    "guard_tracker_start",
    "parse_report_to",
    "tracker_installed",
    "trainer_report_to",
    "trainer_trackers",
    "wants_tensorboard",
]

#: The values that stand alone.
_SPECIAL = ("auto", "none", "all")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

#: The pip package of a Trainer integration, where it is not the integration's own name.
TRACKER_PACKAGES: dict[str, str] = {
    "azure_ml": "azureml-core",
    "flyte": "flytekit",
    "kubeflow": "kubeflow-training",
}


class TrackerStartError(ConfigError):
    """A tracker of ``--report-to`` failed to start; the message says which and what to do."""


def trainer_trackers() -> dict[str, type]:
    """The installed Trainer's integrations: name -> callback class."""
    # On use: TrainConfig checks tracker names with this module when the CLI starts.
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    return dict(INTEGRATION_TO_CALLBACK)


def tracker_installed(name: str) -> bool:
    """Whether the Trainer finds integration ``name``'s package installed."""
    # On use: TrainConfig checks tracker names with this module when the CLI starts.
    from transformers.integrations import integration_utils

    if name in integration_utils.get_available_reporting_integrations():
        return True
    check = getattr(integration_utils, f"is_{name.replace('_', '')}_available", None)
    check = check or getattr(integration_utils, f"is_{name}_available", None)
    return bool(check is not None and check())


def parse_report_to(value: str) -> list[str]:
    """The tracker names of a ``report_to`` value (``auto`` / ``none`` / ``all`` stay as they are).

    Checks the form only (no import): raises ConfigError for an empty value, a name that cannot
    be a tracker's, or ``auto`` / ``none`` / ``all`` mixed with other names.
    """
    names = [part.strip() for part in value.split(",") if part.strip()]
    if not names:
        raise ConfigError("report_to is empty; use auto, none, all or tracker names")
    if len(names) > 1 and set(names) & set(_SPECIAL):
        raise ConfigError(
            f"report_to {value!r}: auto, none and all stand alone; list tracker names without them"
        )
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        raise ConfigError(
            f"report_to holds {bad}, not tracker names; use auto, none, all or a "
            "comma-separated list such as wandb,tensorboard"
        )
    return names


def check_report_to(value: str) -> None:
    """Refuse (ConfigError) names the installed Trainer does not know and trackers that are
    not installed, naming the package to install."""
    names = parse_report_to(value)
    if names[0] in _SPECIAL:
        return
    known = trainer_trackers()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"unknown report_to tracker(s) {unknown}; this transformers knows "
            f"{', '.join(sorted(known))} (or auto, none, all)"
        )
    for name in names:
        if not tracker_installed(name):
            package = TRACKER_PACKAGES.get(name, name)
            raise ConfigError(
                f"--report-to {name} needs the {package} package (pip install {package}; "
                "pip install 'maxscore[trackers]' installs tensorboard, wandb and mlflow), "
                "which is not installed; pick another tracker or --report-to none"
            )


def trainer_report_to(value: str) -> list[str]:
    """What goes to ``TrainingArguments(report_to=...)``: the trackers but TensorBoard (which
    maxscore attaches itself); ``all``: every installed one."""
    names = parse_report_to(value)
    if names == ["all"]:
        # On use: TrainConfig checks tracker names with this module when the CLI starts.
        from transformers.integrations import get_available_reporting_integrations

        names = get_available_reporting_integrations()
    return [n for n in names if n not in (*_SPECIAL, "tensorboard")] or ["none"]


def wants_tensorboard(value: str) -> str:
    """``"required"``, ``"if-installed"`` (auto, all) or ``"no"`` for maxscore's TensorBoard
    writer."""
    names = parse_report_to(value)
    if names in (["auto"], ["all"]):
        return "if-installed"
    return "required" if "tensorboard" in names else "no"


def guard_tracker_start(trainer: Any) -> None:
    """Make a tracker callback of ``trainer`` that fails to start raise :class:`TrackerStartError`.

    The Trainer's integrations connect to their service in ``on_train_begin`` (``setup``); an
    error there would end the run with a traceback from inside the Trainer. It becomes one line
    naming the tracker, its error and what to do; the run directory is kept (the tracker may
    have written into it). Errors at later events are the tracker's own.
    """
    by_class = {cls: name for name, cls in trainer_trackers().items()}
    for callback in trainer.callback_handler.callbacks:
        name = by_class.get(type(callback))
        if name is not None:
            callback.on_train_begin = _guarded(callback.on_train_begin, name)


def _guarded(start: Any, name: str) -> Any:
    def on_train_begin(*args: Any, **kwargs: Any) -> Any:
        try:
            return start(*args, **kwargs)
        except Exception as err:
            detail = f"{type(err).__name__}: {err}".strip().splitlines()[0]
            raise TrackerStartError(
                f"--report-to {name}: the tracker failed to start ({detail}); fix its settings "
                "(its environment variables) or leave it out (--report-to none). The run "
                f"directory is kept; then {how_to_continue(True)}"
            ) from err

    return on_train_begin
