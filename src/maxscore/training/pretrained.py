"""Training from a checkpoint: ``maxscore train --model <directory or hub name>``.

A ``--model`` that is not a model preset names a checkpoint: a maxscore checkpoint (a run's, an
upcycled one) or a supported Hugging Face MoE family (:mod:`maxscore.models.convert`), which is
converted on load. ``--router`` then routes it (``native``: the family's own routing), with
``--router-option`` overrides; ``--model-option`` sets other config fields (for instance
``eval_routing``; architecture fields must keep matching the weights). The tokenizer defaults
to the checkpoint's own when it has one.

A ``--model`` name is resolved without the Hub where it can be (:func:`check_model_name`): a
model preset, then an existing folder; a name close to a preset (a typo such as ``tiyn``) is
refused at once with the preset it resembles; a Hub name is looked up only when the Hub can be
reached (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` unset and a TCP connection to its host
within :data:`HUB_PROBE_TIMEOUT_S`), else it must be in the local Hugging Face cache. This module
imports neither torch, transformers nor huggingface_hub at import time (the functions that need
them do): the command line checks ``--model`` with it before anything heavy loads.
"""

from __future__ import annotations

import difflib
import os
import socket
import sys
import threading
import urllib.parse
import urllib.request
from functools import lru_cache
from pathlib import Path
from typing import Any

from maxscore.preset_tables import MODEL_PRESETS
from maxscore.training.config import ConfigError, TrainConfig

__all__ = [
    "HUB_PROBE_TIMEOUT_S",
    "check_model_name",
    "is_pretrained_model",
    "load_pretrained_model",
    "pretrained_model_config",
    "pretrained_tokenizer",
]

_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

#: Seconds the check for a route to the Hub waits for a TCP connection to its host (name
#: lookup included) before the Hub counts as unreachable.
HUB_PROBE_TIMEOUT_S = 1.0
#: Environment variables that switch the Hub off (huggingface_hub's and transformers' names).
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def is_pretrained_model(name: str) -> bool:
    """True when ``name`` is not a model preset (so it names a checkpoint)."""
    return name not in MODEL_PRESETS


# ------------------------------------------------------------------------------------------------
# --model names: presets, folders, typos, the Hub
# ------------------------------------------------------------------------------------------------
def _presets_list() -> str:
    return ", ".join(MODEL_PRESETS)


def _looks_like_path(name: str) -> bool:
    """A name that can only be a path (``./x``, ``../x``, ``/x``, ``~/x``), not a Hub name."""
    return name.startswith(("./", "../", "/", "~", ".\\", "..\\")) or name in (".", "..")


def _offline_variable() -> str | None:
    """The variable that switches the Hub off, or None (huggingface_hub's own flag counts too:
    it reads the environment when imported)."""
    for variable in _OFFLINE_VARIABLES:
        if os.environ.get(variable, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return variable
    hub_constants = sys.modules.get("huggingface_hub.constants")
    if getattr(hub_constants, "HF_HUB_OFFLINE", False):
        return "HF_HUB_OFFLINE"
    return None


def _hub_address() -> tuple[str, int]:
    """Host and port a Hub request connects to first: the HTTPS proxy's, when one is set for
    the Hub's host, else the Hub's (``HF_ENDPOINT``, default huggingface.co)."""
    from huggingface_hub import constants  # on use (module docstring)

    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    proxy = urllib.request.getproxies().get("https")
    if proxy and not urllib.request.proxy_bypass(host):
        address = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if address.hostname:
            return address.hostname, address.port or 80
    return host, endpoint.port or (443 if endpoint.scheme == "https" else 80)


@lru_cache(maxsize=4)
def _connection_error(host: str, port: int, timeout: float) -> str | None:
    """Why no TCP connection to ``host:port`` opens within ``timeout`` seconds (name lookup
    included, so it runs in a thread: ``getaddrinfo`` has no timeout of its own), or None when
    one does. Asked once per process and address."""
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome.append(None)
        except OSError as err:
            outcome.append(str(err) or type(err).__name__)

    thread = threading.Thread(target=connect, name="maxscore-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


def _hub_unreachable_reason() -> str | None:
    """Why the Hub cannot be asked (offline variable set, no connection), or None."""
    variable = _offline_variable()
    if variable is not None:
        return f"{variable}=1 is set"
    host, port = _hub_address()
    error = _connection_error(host, port, HUB_PROBE_TIMEOUT_S)
    return None if error is None else f"no connection to {host}:{port}: {error}"


def _in_hub_cache(name: str) -> bool:
    """Whether the Hugging Face cache holds ``name``'s ``config.json`` (no network)."""
    from huggingface_hub import try_to_load_from_cache  # on use (module docstring)

    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # an invalid repo id (HFValidationError) is simply not cached
        return False
    return isinstance(found, str)


def check_model_name(name: str) -> None:
    """Refuse at once a ``--model`` that cannot name a model (raises :class:`ConfigError`).

    In order: a model preset or an existing path passes (a folder is read later); a path-like
    name (``./x``, ``/x``, ``~/x``) that does not exist is refused; a name without ``/`` close to
    a preset is refused as a typo with the preset it resembles ("did you mean 'tiny'?"); any
    other name is a Hub name, checked only when a Hub lookup would happen: when the Hub is off
    (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``) or not reachable within
    :data:`HUB_PROBE_TIMEOUT_S`, it must be in the local Hugging Face cache, and the run then
    reads the cache only (Hub offline mode for this process) instead of retrying the Hub.
    """
    if name in MODEL_PRESETS or Path(name).expanduser().exists():
        return
    if _looks_like_path(name):
        raise ConfigError(
            f"unknown model preset {name!r}, and no checkpoint folder of that name exists "
            f"(presets: {_presets_list()})"
        )
    if "/" not in name and "\\" not in name:
        close = difflib.get_close_matches(name.lower(), list(MODEL_PRESETS), n=1, cutoff=0.6)
        if close:
            raise ConfigError(
                f"unknown model preset {name!r}; did you mean {close[0]!r}? (presets: "
                f"{_presets_list()}; a checkpoint is a folder or a Hub name such as org/name)"
            )
    reason = _hub_unreachable_reason()
    if reason is None:
        return  # online: the Hub answers (pretrained_model_config reports what it says)
    what = (
        f"model {name!r} is not a local folder"
        if "/" in name
        else f"unknown model preset {name!r} (presets: {_presets_list()}), not a local folder"
    )
    if not _in_hub_cache(name):
        raise ConfigError(
            f"{what} and not in the Hugging Face cache, and the Hub cannot be asked for it "
            f"({reason}); pass a model preset or a checkpoint folder, or download it first"
        )
    if _offline_variable() is None:
        from huggingface_hub import constants  # on use (module docstring)

        # No route to the Hub: read the cached copy without the Hub client's retries.
        constants.HF_HUB_OFFLINE = True
        os.environ["HF_HUB_OFFLINE"] = "1"
        print(
            f"maxscore: warning: the Hub cannot be reached ({reason}); using the cached copy of "
            f"{name!r} (Hub offline mode for this run)",
            file=sys.stderr,
        )


def pretrained_model_config(config: TrainConfig) -> Any:
    """The :class:`LlamaMoEConfig` the checkpoint ``config.model`` loads as (no weights read).

    Raises ConfigError naming the problem: no such directory / hub name, an unsupported family,
    an unknown router preset, bad overrides. A typo of a preset, or a Hub name while the Hub
    cannot be reached and the model is not cached, is refused before anything heavy is imported
    (:func:`check_model_name`).
    """
    check_model_name(config.model)
    # On use (module docstring).
    from transformers import AutoConfig

    from maxscore.models import LlamaMoEConfig
    from maxscore.models.convert import ConversionError, maxscore_config_from_family
    from maxscore.models.convert.load import checkpoint_config, unsupported_message
    from maxscore.training.option_checks import validate_model_options

    try:
        hf_config = AutoConfig.from_pretrained(config.model)
    except Exception as err:  # OSError, ValueError, the hub client's own errors offline
        raise ConfigError(
            f"unknown model preset {config.model!r} (presets: {sorted(MODEL_PRESETS)}), and not "
            f"a readable checkpoint directory or hub name either: {type(err).__name__}: {err}"
        ) from err
    validate_model_options(config.model_overrides)
    # The checkpoint's saved router, with --router ('native': the family's routing, refused for
    # a checkpoint of no family) and --router-option.
    kwargs: dict[str, Any] = {"router": config.router}
    if config.router_overrides:
        kwargs["router_config"] = dict(config.router_overrides)
    try:
        if hf_config.model_type == LlamaMoEConfig.model_type:
            return checkpoint_config(config.model, **kwargs, **config.model_overrides)
        return maxscore_config_from_family(hf_config, **kwargs, **config.model_overrides)
    except ConversionError as err:
        raise ConfigError(str(err)) from err
    except (TypeError, ValueError) as err:
        if getattr(hf_config, "model_type", None) is None:
            raise ConfigError(unsupported_message(None)) from err
        raise ConfigError(f"invalid model/router settings for {config.model!r}: {err}") from err


def load_pretrained_model(config: TrainConfig, model_config: Any, on_gpu: bool = False) -> Any:
    """The checkpoint's weights in ``model_config``, the run's model config
    (:func:`pretrained_model_config`'s, with the run's SoftTopk ``t`` schedule)."""
    import torch  # on use (module docstring)

    from maxscore.models.convert import ConversionError, load_pretrained

    try:
        model = load_pretrained(config.model, config=model_config)
    except ConversionError as err:
        raise ConfigError(str(err)) from err
    if on_gpu and torch.cuda.is_available():
        model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return model


def pretrained_tokenizer(config: TrainConfig) -> str:
    """The tokenizer to use: ``--tokenizer`` if given, else the checkpoint's own if it has one."""
    if config.tokenizer not in ("default", "embedded"):
        return config.tokenizer
    path = Path(config.model)
    if path.is_dir():
        return str(path) if any((path / m).is_file() for m in _TOKENIZER_MARKERS) else "default"
    return config.model  # a hub name: its tokenizer (needs the hub, like the weights)
