"""``--report-to``: the experiment trackers a run logs to, passed through to the HF Trainer.

Values: ``auto`` (TensorBoard if installed, the default), ``none``, or a comma-separated list of
the trackers in :data:`REPORT_BACKENDS` (``wandb``, ``mlflow``, ``trackio``, ``tensorboard``).
TensorBoard is attached by maxscore itself so that it writes into ``<run>/tensorboard``; the
others go to ``TrainingArguments(report_to=...)`` and are configured the usual way (their
environment variables: ``WANDB_PROJECT``, ``MLFLOW_TRACKING_URI``, ...). A tracker that is not
installed is refused before training with the package to install.
"""

from __future__ import annotations

from collections.abc import Callable

from maxscore.config_types import ConfigError

__all__ = [
    "REPORT_BACKENDS",
    "check_report_to",
    "parse_report_to",
    "trainer_report_to",
    "wants_tensorboard",
]


def _available(name: str) -> Callable[[], bool]:
    def check() -> bool:
        # On use: TrainConfig checks tracker names with this module when the CLI starts.
        import transformers.integrations as integrations

        return bool(getattr(integrations, f"is_{name}_available")())

    return check


#: Tracker name -> (is it installed?, the pip package that provides it).
REPORT_BACKENDS: dict[str, tuple[Callable[[], bool], str]] = {
    "tensorboard": (_available("tensorboard"), "tensorboard"),
    "wandb": (_available("wandb"), "wandb"),
    "mlflow": (_available("mlflow"), "mlflow"),
    "trackio": (_available("trackio"), "trackio"),
}


def parse_report_to(value: str) -> list[str]:
    """The tracker names of a ``report_to`` value (``auto`` / ``none`` stay as they are).

    Raises ConfigError for an unknown name, or ``auto`` / ``none`` mixed with trackers.
    """
    names = [part.strip() for part in value.split(",") if part.strip()]
    if names in (["auto"], ["none"]):
        return names
    if not names:
        raise ConfigError("report_to is empty; use auto, none or tracker names")
    unknown = [n for n in names if n not in REPORT_BACKENDS]
    if unknown:
        raise ConfigError(
            f"unknown report_to tracker(s) {unknown}; use auto, none or a comma-separated list "
            f"of {', '.join(REPORT_BACKENDS)}"
        )
    return names


def check_report_to(value: str) -> None:
    """Refuse (ConfigError) trackers that are not installed, naming the package to install."""
    for name in parse_report_to(value):
        if name in REPORT_BACKENDS:
            installed, package = REPORT_BACKENDS[name]
            if not installed():
                raise ConfigError(
                    f"--report-to {name} needs the {package} package (pip install {package}), "
                    "which is not installed; pick another tracker or --report-to none"
                )


def trainer_report_to(value: str) -> list[str]:
    """What goes to ``TrainingArguments(report_to=...)``: the trackers but TensorBoard."""
    names = parse_report_to(value)
    return [n for n in names if n not in ("auto", "none", "tensorboard")] or ["none"]


def wants_tensorboard(value: str) -> str:
    """``"required"``, ``"if-installed"`` (auto) or ``"no"`` for maxscore's TensorBoard writer."""
    names = parse_report_to(value)
    if names == ["auto"]:
        return "if-installed"
    return "required" if "tensorboard" in names else "no"
