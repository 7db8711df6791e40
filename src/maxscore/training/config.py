"""Typed training configuration (:class:`TrainConfig`) and the paper's recipe.

A ``TrainConfig`` is plain data: the CLI fills one from its flags, the Python API takes one, and
the run directory stores the *resolved* one (``config.json``) so a later ``--resume`` can check
it is continuing the same experiment.

Recipes (:data:`RECIPES`; fields the user set explicitly win over a recipe):

* ``"paper"``: the paper's setup: context 512, global batch 688 sequences, 180k steps, AdamW
  lr 3e-5, weight decay 0.1, betas (0.9, 0.95), eps 1e-6, a warmup-stable-decay schedule with 2k
  warmup steps and decay over the last 6k, the SoftTopk ``t`` annealed over 30k steps, bf16,
  activation checkpointing, C4 and a LLaMA tokenizer.
* ``"paper-shape"``: the paper's optimizer and schedule *shape* scaled to the run's length, for
  short runs: the same AdamW betas / eps / weight decay, WSD with warmup over 2/180 and decay
  over the last 6/180 of the run, ``t`` annealed over 1/6 of it (30k of 180k). Model, data,
  batch, learning rate and budget stay the user's.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from maxscore.config_types import check_dataclass_types
from maxscore.training.errors import ConfigError
from maxscore.training.reporting import parse_report_to

Precision = Literal["auto", "bf16", "fp16", "fp32"]
LRSchedule = Literal["wsd", "cosine", "linear", "constant"]
DecayShape = Literal["linear", "cosine", "1-sqrt"]
CompileMode = Literal["default", "max-autotune-no-cudagraphs"]
COMPILE_MODES: tuple[str, ...] = ("default", "max-autotune-no-cudagraphs")
TxtDocuments = Literal["paragraphs", "lines"]
TXT_DOCUMENTS: tuple[str, ...] = ("paragraphs", "lines")
DataFormat = Literal["auto", "text", "chat", "prompt-completion"]
DATA_FORMATS: tuple[str, ...] = ("auto", "text", "chat", "prompt-completion")

#: Fields that may differ between a run directory's stored config and a ``--resume`` of it
#: without a warning: they say where/how to run, not what is trained.
RUNTIME_FIELDS: frozenset[str] = frozenset(
    {
        "output_dir",
        "resume",
        "overwrite",
        "num_workers",
        "report_to",
        "quiet",
        "deepspeed",
        "compile",
        "compile_mode",
        "expert_parallel",
        "gc_interval",
    }
)


@dataclass
class TrainConfig:
    """Everything that defines a training run.

    Attributes:
        model: model preset name (``maxscore.models.presets.MODEL_PRESETS``), or a checkpoint
            directory / hub name: a maxscore checkpoint or a supported Hugging Face MoE family
            (``maxscore.training.pretrained``).
        model_overrides: fields of the model config to replace (``{"num_hidden_layers": 2}``).
        router: router preset name (``maxscore.routing.presets.ROUTER_PRESETS``); for a
            converted checkpoint also ``"native"`` (the family's own routing).
        router_overrides: fields of the router config to replace (``{"capacity_factor": 1.25}``).
        dataset: ``"default"`` (the embedded corpus), a Hugging Face dataset name (``"c4"`` is
            ``allenai/c4``, config ``en``), or a local ``.txt`` / ``.jsonl`` file or folder.
        dataset_config: Hugging Face dataset config name (``"en"`` for C4).
        text_field: the text column of a HF dataset or a JSONL record.
        streaming: stream a HF dataset instead of downloading it (``None``: only for C4).
        txt_documents: how a local ``.txt`` file is cut into documents: ``"paragraphs"``
            (default): documents are separated by blank lines (lines that are empty or only white
            space); ``"lines"``: every non-blank line is a document. Refused for a source
            without ``.txt`` files (:mod:`maxscore.training.data`).
        data_format: what a record is: ``"text"`` (a document in ``text_field``), ``"chat"``
            (``messages``, rendered with the tokenizer's chat template) or
            ``"prompt-completion"`` (``prompt`` + ``completion``); ``"auto"``: chat or
            prompt-completion when a local .jsonl's first record has those fields and no
            ``text_field``, else text (:mod:`maxscore.training.instruction_data`).
        completion_only_loss: for chat / prompt-completion records, the loss on the completion
            tokens (assistant turns) only; false: on every token.
        validation_fraction: share of documents held out when the source has no validation split.
        max_train_documents: use only the first N (seed-shuffled) training documents.
        max_eval_blocks: validation blocks per evaluation, evenly spaced over the split so every
            source keeps its share; ``None`` (default): the whole split, up to 2^20 tokens
            (:mod:`maxscore.training.validation_set`).
        temperature_steps: optimizer steps over which the SoftTopk ``t`` goes from its start to
            its end value; ``None``: ``temperature_fraction`` of the run's steps
            (:mod:`maxscore.training.temperature`).
        temperature_fraction: share of the run's optimizer steps over which ``t`` anneals when
            ``temperature_steps`` is not given (default 1/6: the paper's 30k of 180k).
        tokenizer: ``"default"`` (the embedded 32k LLaMA-style tokenizer), or a HF tokenizer name
            or local path.
        seq_len: tokens per training sequence (documents are packed into blocks of this length).
        batch_size: sequences per device per micro-batch.
        grad_accum: micro-batches per optimizer step.
        max_steps: optimizer steps to train for (ignored when ``max_tokens`` is given).
        max_tokens: token budget; sets ``max_steps = ceil(max_tokens / tokens_per_step)``.
        lr, weight_decay, adam_beta1, adam_beta2, adam_eps, max_grad_norm: AdamW settings.
        lr_schedule: ``"wsd"`` (warmup-stable-decay, transformers' ``get_wsd_schedule``),
            ``"cosine"``, ``"linear"`` or ``"constant"`` (all with warmup).
        warmup_steps / warmup_ratio: warmup length (steps win when > 0).
        decay_steps / decay_ratio: WSD decay length at the end of training (steps win when > 0).
        decay_shape: shape of the WSD decay.
        min_lr_ratio: learning rate at the end of the decay, as a fraction of ``lr``.
        seed: seeds model initialisation, document order and batch order.
        precision: ``"auto"`` is bf16 on a CUDA GPU that supports it, fp32 otherwise.
        gradient_checkpointing: recompute activations in the backward pass.
        compile: ``torch.compile`` every decoder layer and the LM loss
            (:meth:`LlamaMoEForCausalLM.compile_layers`): on a GPU the Base preset trains
            1.7x faster (benchmarks/train_throughput/README.md); the first steps pay ~1 min of
            compilation. Checkpoints are the same as without it.
        compile_mode: ``torch.compile`` mode for ``compile``: ``"default"`` or
            ``"max-autotune-no-cudagraphs"``. (``"reduce-overhead"``, CUDA graphs per layer, is
            refused: under the Trainer's gradient accumulation its graph outputs are overwritten
            before the backward pass reads them, seen with torch 2.11.)
        deterministic: same-seed reruns agree bit for bit on one GPU type (and on the CPU):
            ``torch.use_deterministic_algorithms(True)`` (an operation without a deterministic
            implementation fails instead of running), cuDNN deterministic without benchmarking,
            ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, and with ``compile`` inductor's deterministic
            mode (no autotuning by timing); refused with ``compile`` on a torch without that
            mode. Set for the run and restored after it
            (:class:`~maxscore.training.callbacks.DeterministicAlgorithms`); slower.
        lora: train LoRA adapters (``peft``) instead of every weight
            (:mod:`maxscore.training.lora`); checkpoints hold the adapter, the run's ``base/``
            the model it adapts.
        lora_r, lora_alpha: the adapters' rank and scale (``alpha / r`` multiplies ``B A``).
        lora_targets: comma-separated :data:`maxscore.models.adapters.LORA_TARGETS`:
            ``attention``, ``experts``, ``mlp`` (LoRA) and ``router`` (the gate, in full).
        output_dir: run directory (``None``: ``runs/<model>-<router>``).
        eval_steps, save_steps, logging_steps: intervals in optimizer steps (0 disables).
        save_total_limit: checkpoints kept (oldest deleted after a new one is complete).
        save_final: write a checkpoint at the last step (so a run always ends with one).
        resume: continue from the last checkpoint in ``output_dir``.
        overwrite: delete an existing ``output_dir`` first.
        deepspeed: a DeepSpeed config: ``"zero2"`` / ``"zero3"`` (shipped) or a JSON path.
        expert_parallel: spread every MoE layer's experts over this many processes (all-to-all
            token exchange, ``maxscore.training.parallel``); must divide the number of
            processes and of experts. 1: every process holds every expert.
        num_workers: DataLoader worker processes.
        gc_interval: Python's garbage collector during training: every N optimizer steps a
            collection of the young generations, and no automatic one
            (:class:`~maxscore.training.callbacks.GarbageCollectionCallback`); 0 leaves
            Python's automatic collection on. An automatic full collection walks every object
            the process holds, torch.compile's graphs included, and stalls the step it falls in
            (0.4-0.6 s for a compiled 128-expert model's objects).
        report_to: ``"auto"`` (TensorBoard if installed), ``"none"``, ``"all"`` (every installed
            tracker), or a comma-separated list of the HF Trainer's integrations
            (``tensorboard``, ``wandb``, ``mlflow``, ``trackio``, ...;
            ``maxscore.training.reporting``).
        quiet: no progress bar.
        recipe: ``None``, ``"paper"`` or ``"paper-shape"`` (:data:`RECIPES`); applied by
            :func:`apply_recipe`.
    """

    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    router: str = "maxscore"
    router_overrides: dict[str, Any] = field(default_factory=dict)
    dataset: str = "default"
    dataset_config: str | None = None
    text_field: str = "text"
    streaming: bool | None = None
    txt_documents: TxtDocuments = "paragraphs"
    data_format: DataFormat = "auto"
    completion_only_loss: bool = True
    validation_fraction: float = 0.01
    max_train_documents: int | None = None
    max_eval_blocks: int | None = None
    temperature_steps: int | None = None
    temperature_fraction: float = 1 / 6
    tokenizer: str = "default"
    seq_len: int = 128
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 250
    max_tokens: int | None = None
    lr: float = 2e-3
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-6
    max_grad_norm: float = 1.0
    lr_schedule: LRSchedule = "wsd"
    warmup_steps: int = 0
    warmup_ratio: float = 0.05
    decay_steps: int = 0
    decay_ratio: float = 0.2
    decay_shape: DecayShape = "linear"
    min_lr_ratio: float = 0.0
    seed: int = 42
    precision: Precision = "auto"
    gradient_checkpointing: bool = False
    compile: bool = False
    compile_mode: CompileMode = "default"
    deterministic: bool = False
    lora: bool = False
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_targets: str = "attention,experts,router"
    output_dir: str | None = None
    # Every 250 steps: one evaluation of the whole validation split (195k tokens) costs about a
    # sixth of the default 250-step CPU run, so the default run evaluates once, at its end.
    eval_steps: int = 250
    save_steps: int = 125
    logging_steps: int = 10
    save_total_limit: int = 2
    save_final: bool = True
    resume: bool = False
    overwrite: bool = False
    deepspeed: str | None = None
    expert_parallel: int = 1
    num_workers: int = 0
    gc_interval: int = 50
    report_to: str = "auto"
    quiet: bool = False
    recipe: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the values that can be checked without loading anything (raises ConfigError).

        Types first (a value from a JSON/YAML file or a ``KEY=VALUE`` flag can be a string
        where a number belongs), then ranges and combinations.
        """
        check_dataclass_types(self, "training config", ConfigError)
        positive = {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "expert_parallel": self.expert_parallel,
        }
        if self.max_eval_blocks is not None:
            positive["max_eval_blocks"] = self.max_eval_blocks
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.gc_interval < 0:
            raise ConfigError(
                f"gc_interval must be >= 0 (0: Python's automatic collection), got {self.gc_interval}"
            )
        if self.max_tokens is None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.adam_beta1 < 1 or not 0 <= self.adam_beta2 < 1:
            raise ConfigError(
                f"betas must be in [0, 1), got ({self.adam_beta1}, {self.adam_beta2})"
            )
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(
                f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}"
            )
        if self.txt_documents not in TXT_DOCUMENTS:
            raise ConfigError(
                f"txt_documents must be one of {', '.join(TXT_DOCUMENTS)} (documents of a .txt "
                f"file: separated by blank lines, or one per line), got {self.txt_documents!r}"
            )
        if self.data_format not in DATA_FORMATS:
            raise ConfigError(
                f"data_format must be one of {', '.join(DATA_FORMATS)}, got {self.data_format!r}"
            )
        if self.precision not in ("auto", "bf16", "fp16", "fp32"):
            raise ConfigError(f"precision must be auto, bf16, fp16 or fp32, got {self.precision!r}")
        if self.lr_schedule not in ("wsd", "cosine", "linear", "constant"):
            raise ConfigError(
                f"lr_schedule must be wsd, cosine, linear or constant, got {self.lr_schedule!r}"
            )
        if self.decay_shape not in ("linear", "cosine", "1-sqrt"):
            raise ConfigError(
                f"decay_shape must be linear, cosine or 1-sqrt, got {self.decay_shape!r}"
            )
        if not 0 <= self.seed < 2**32:  # numpy's seeding range (a negative seed fails there)
            raise ConfigError(f"seed must be in [0, 2^32 - 1], got {self.seed}")
        if self.temperature_steps is not None and self.temperature_steps < 0:
            raise ConfigError(f"temperature_steps must be >= 0, got {self.temperature_steps}")
        for name in (
            "warmup_ratio",
            "decay_ratio",
            "validation_fraction",
            "min_lr_ratio",
            "temperature_fraction",
        ):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
        for name in ("warmup_steps", "decay_steps", "eval_steps", "save_steps", "logging_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other; pick one")
        parse_report_to(self.report_to)  # names only; installation is checked by prepare()
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ConfigError(
                f"unknown recipe {self.recipe!r}; known recipes: {', '.join(RECIPES)}"
            )

    # ----------------------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        """The run directory (``output_dir`` or ``runs/<model>-<router>``)."""
        # A checkpoint path as --model names the run by its last component.
        return Path(self.output_dir or f"runs/{Path(self.model).name}-{self.router}")

    def tokens_per_step(self, world_size: int = 1) -> int:
        """Tokens per optimizer step: ``seq_len * batch_size * grad_accum * world_size``."""
        return self.seq_len * self.batch_size * self.grad_accum * world_size

    def total_steps(self, world_size: int = 1) -> int:
        """Optimizer steps the run trains for (from ``max_tokens`` when given)."""
        if self.max_tokens is not None:
            return max(1, math.ceil(self.max_tokens / self.tokens_per_step(world_size)))
        return self.max_steps

    def warmup_and_decay(self, world_size: int = 1) -> tuple[int, int]:
        """Warmup and (WSD) decay lengths in optimizer steps, clipped to the run length."""
        total = self.total_steps(world_size)
        warmup = self.warmup_steps or round(self.warmup_ratio * total)
        decay = self.decay_steps or round(self.decay_ratio * total)
        warmup = min(warmup, total)
        decay = min(decay, total - warmup)
        return warmup, decay

    # ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(
                f"unknown training config field(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        """Load from a JSON or YAML file (a run directory's ``config.json`` works too)."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        # A run directory's config.json nests the training config next to derived values.
        data = data.get("train", data)
        return cls.from_dict(data)

    def differences(self, other: TrainConfig, ignore: frozenset[str] = RUNTIME_FIELDS) -> dict:
        """``{field: (self_value, other_value)}`` for fields that differ (``ignore`` skipped)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return {
            k: (mine[k], theirs[k]) for k in mine if k not in ignore and mine[k] != theirs.get(k)
        }


#: The paper's training setup. ``dataset="c4"`` streams allenai/c4 ``en``.
PAPER_RECIPE: dict[str, Any] = {
    "model": "base",
    "dataset": "c4",
    "dataset_config": "en",
    "streaming": True,
    "tokenizer": "default",
    "seq_len": 512,
    # 688 sequences per optimizer step in total; with 8 GPUs x 43 x 2 = 688.
    "batch_size": 43,
    "grad_accum": 2,
    "max_steps": 180_000,
    "lr": 3e-5,
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_eps": 1e-6,
    "lr_schedule": "wsd",
    "warmup_steps": 2_000,
    "decay_steps": 6_000,
    # The authors' t schedule: 3 -> 0 over the first 30k optimizer steps.
    "temperature_steps": 30_000,
    "precision": "bf16",
    "gradient_checkpointing": True,
    "compile": True,
    "eval_steps": 2_000,
    "save_steps": 2_000,
    "logging_steps": 50,
    "save_total_limit": 3,
}

#: The paper's optimizer and schedule shape, scaled to a run of any length: its 2k warmup and
#: 6k decay steps and 30k ``t`` steps as shares of its 180k steps.
PAPER_SHAPE_RECIPE: dict[str, Any] = {
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_eps": 1e-6,
    "lr_schedule": "wsd",
    "warmup_steps": 0,
    "warmup_ratio": 2_000 / 180_000,
    "decay_steps": 0,
    "decay_ratio": 6_000 / 180_000,
    "temperature_steps": None,
    "temperature_fraction": 30_000 / 180_000,
}

#: Recipes by name (``--recipe``): the fields each one sets.
RECIPES: dict[str, dict[str, Any]] = {"paper": PAPER_RECIPE, "paper-shape": PAPER_SHAPE_RECIPE}

#: Global batch of the paper's recipe, in sequences.
PAPER_GLOBAL_BATCH = 688


def apply_recipe(
    config: TrainConfig, explicit: set[str] | frozenset[str] = frozenset()
) -> TrainConfig:
    """Fill ``config`` with its recipe's values, except fields named in ``explicit``.

    ``explicit`` holds the fields the user set on the command line / in code, which win over the
    recipe. The paper's global batch of 688 sequences is ``batch_size * grad_accum * world_size``;
    the recipe's 43 x 2 assumes 8 GPUs — adjust ``grad_accum`` for other GPU counts.
    """
    if config.recipe is None:
        return config
    if config.recipe not in RECIPES:
        raise ConfigError(f"unknown recipe {config.recipe!r}; known recipes: {', '.join(RECIPES)}")
    data = config.to_dict()
    for key, value in RECIPES[config.recipe].items():
        if key not in explicit:
            data[key] = value
    return TrainConfig.from_dict(data)
