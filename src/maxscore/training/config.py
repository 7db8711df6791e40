"""Typed training configuration (:class:`TrainConfig`): the run's settings, checked when made.

A ``TrainConfig`` is plain data: the CLI fills one from its flags (which are generated from its
fields: :func:`maxscore.cli_options.add_dataclass_options`), the Python API takes one, and the
run directory stores the *resolved* one (``config.json``) so a later ``--resume`` can check it is
continuing the same experiment. Its values are checked by their types (``Literal`` choices
included) and by each field's rules (:func:`maxscore.config_types.check_fields`); the router
named by ``router`` / ``router_overrides`` is resolved once, when the run's model config is
built (:mod:`maxscore.training.model_build`).

Recipes (:data:`~maxscore.training.recipes.RECIPES`) fill in fields the user did not set
(:func:`apply_recipe`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from maxscore.config_types import (
    ConfigError,
    Rule,
    at_least,
    check_fields,
    greater_than,
    option,
    within,
)
from maxscore.data.config import DataConfig
from maxscore.training.recipes import RECIPES
from maxscore.training.reporting import parse_report_to

__all__ = ["RUNTIME_FIELDS", "ConfigError", "TrainConfig", "apply_recipe"]

Precision = Literal["auto", "bf16", "fp16", "fp32", "fp8"]
LRSchedule = Literal["wsd", "cosine", "linear", "constant"]
DecayShape = Literal["linear", "cosine", "1-sqrt"]
CompileMode = Literal["default", "max-autotune-no-cudagraphs"]

_POSITIVE = (at_least(1),)
_COUNT = (at_least(0),)
_SHARE = (within(0, 1),)
_KNOWN_RECIPE = Rule(
    lambda name: name in RECIPES, f"unknown recipe {{value!r}}; known recipes: {', '.join(RECIPES)}"
)


@dataclass
class TrainConfig(DataConfig):
    """Everything that defines a training run: its data (the :class:`DataConfig` fields:
    ``dataset``, ``tokenizer``, ``seq_len``, ``seed``, ...) and the fields below.

    Each field's ``metadata`` holds its command-line help (``maxscore train --flag``, generated
    from the fields by :func:`maxscore.cli_options.add_dataclass_options`), its flag group and the
    :class:`~maxscore.config_types.Rule` objects its value must meet.

    Attributes:
        model: model preset name (``maxscore.models.presets.MODEL_PRESETS``), or a checkpoint
            directory / hub name: a maxscore checkpoint or a supported Hugging Face MoE family
            (``maxscore.training.pretrained``).
        model_overrides: fields of the model config to replace (``{"num_hidden_layers": 2}``).
        router: router preset name (``maxscore.routing.presets.ROUTER_PRESETS``); for a
            converted checkpoint also ``"native"`` (the family's own routing).
        router_overrides: fields of the router config to replace (``{"capacity_factor": 1.25}``).
        temperature_steps: optimizer steps over which the SoftTopk ``t`` goes from its start to
            its end value; ``None``: ``temperature_fraction`` of the run's steps
            (:mod:`maxscore.training.temperature`).
        temperature_fraction: share of the run's optimizer steps over which ``t`` anneals when
            ``temperature_steps`` is not given (default 1/6: the paper's 30k of 180k).
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
        precision: ``"auto"`` is bf16 on a CUDA GPU that supports it, fp32 otherwise.
            ``"fp8"`` is bf16 autocast plus torchao's float8 training of the dense
            ``nn.Linear`` layers (attention projections, dense and shared-expert MLPs; not the
            LM head, routers or the routed experts, which stay bf16:
            :func:`~maxscore.training.precision.apply_float8`); it needs torchao and a GPU of
            compute capability 8.9+ (H100/H200/Ada).
        fused_loss: compute the LM head and the next-token cross-entropy in one fused kernel
            (liger-kernel), so the ``[tokens, vocab]`` logits are never materialised in
            training; the loss is the same (a mean over the non-ignored targets). Training
            forwards return ``logits=None``; evaluation and generation are unchanged. Needs
            liger-kernel and a CUDA GPU (:mod:`maxscore.training.fused_loss`).
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
        output_dir: run directory (``None``: ``runs/<model>-<router>``).
        eval_steps, save_steps, logging_steps: intervals in optimizer steps (0 disables).
        save_total_limit: checkpoints kept (oldest deleted after a new one is complete).
        save_final: write a checkpoint at the last step (so a run always ends with one).
        resume: continue from the last checkpoint in ``output_dir``.
        overwrite: delete an existing ``output_dir`` first.
        deepspeed: a DeepSpeed config: ``"zero2"`` / ``"zero3"`` (shipped) or a JSON path.
        lora: train LoRA adapters (``peft``) instead of every weight
            (:mod:`maxscore.training.lora`); checkpoints hold the adapter, the run's ``base/``
            the model it adapts.
        lora_r, lora_alpha: the adapters' rank and scale (``alpha / r`` multiplies ``B A``).
        lora_targets: comma-separated :data:`maxscore.models.adapters.LORA_TARGETS`:
            ``attention``, ``experts``, ``mlp`` (LoRA) and ``router`` (the gate, in full).
        expert_parallel: spread every MoE layer's experts over this many processes (all-to-all
            token exchange, ``maxscore.training.parallel``); must divide the number of
            processes and of experts. 1: every process holds every expert.
        fsdp: shard the dense parameters (attention, embeddings, routers, norms) and their
            optimizer state over all processes with FSDP2 instead of replicating them under DDP
            (``maxscore.parallel.fsdp``); the experts stay expert-parallel. Needs
            ``expert_parallel >= 2``.
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
        recipe: ``None``, ``"paper"`` or ``"paper-shape"``
            (:data:`~maxscore.training.recipes.RECIPES`); applied by :func:`apply_recipe`.
    """

    model: str = field(
        default="tiny",
        metadata=option(
            group="model",
            help="model preset (default {default}; see `maxscore presets`), or a checkpoint "
            "directory / hub name (maxscore, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; a hub name is "
            "read from the HF cache when the Hub is offline or unreachable)",
        ),
    )
    model_overrides: dict[str, Any] = field(
        default_factory=dict,
        metadata=option(
            group="model",
            flag="--model-option",
            metavar="KEY=VALUE",
            help="override a model config field, e.g. num_hidden_layers=2 (repeatable)",
        ),
    )
    router: str = field(
        default="maxscore",
        metadata=option(
            group="model",
            help="router preset (default {default}); 'native' keeps a converted model's own",
        ),
    )
    router_overrides: dict[str, Any] = field(
        default_factory=dict,
        metadata=option(
            group="model",
            flag="--router-option",
            metavar="KEY=VALUE",
            help="override a router config field, e.g. capacity_factor=1.25 (repeatable)",
        ),
    )
    temperature_steps: int | None = field(
        default=None,
        metadata=option(
            group="optimisation",
            rules=_COUNT,
            help="optimizer steps over which the SoftTopk t anneals (default: "
            "--temperature-fraction of the run; the paper recipe: 30000)",
        ),
    )
    temperature_fraction: float = field(
        default=1 / 6,
        metadata=option(
            group="optimisation",
            rules=_SHARE,
            help="share of the run's optimizer steps over which t anneals when --temperature-steps "
            "is not given (default 1/6: the paper's 30k of 180k)",
        ),
    )
    batch_size: int = field(
        default=8,
        metadata=option(
            group="optimisation", rules=_POSITIVE, help="sequences per device (default {default})"
        ),
    )
    grad_accum: int = field(
        default=1,
        metadata=option(
            group="optimisation",
            rules=_POSITIVE,
            help="micro-batches per optimizer step (default {default})",
        ),
    )
    max_steps: int = field(
        default=250,
        metadata=option(group="optimisation", help="optimizer steps (default {default})"),
    )
    max_tokens: int | None = field(
        default=None,
        metadata=option(
            group="optimisation", rules=_POSITIVE, help="token budget instead of --max-steps"
        ),
    )
    lr: float = field(
        default=2e-3,
        metadata=option(
            group="optimisation",
            rules=(greater_than(0),),
            help="peak learning rate (default {default})",
        ),
    )
    weight_decay: float = field(
        default=0.1,
        metadata=option(group="optimisation", help="AdamW weight decay (default {default})"),
    )
    adam_beta1: float = field(
        default=0.9,
        metadata=option(
            group="optimisation", rules=(within(0, 1, open_high=True),), help="(default {default})"
        ),
    )
    adam_beta2: float = field(
        default=0.95,
        metadata=option(
            group="optimisation", rules=(within(0, 1, open_high=True),), help="(default {default})"
        ),
    )
    adam_eps: float = field(
        default=1e-6, metadata=option(group="optimisation", help="(default {default})")
    )
    max_grad_norm: float = field(
        default=1.0, metadata=option(group="optimisation", help="clipping (default {default})")
    )
    lr_schedule: LRSchedule = field(
        default="wsd",
        metadata=option(
            group="optimisation", help="learning-rate schedule (default wsd: warmup-stable-decay)"
        ),
    )
    warmup_steps: int = field(
        default=0,
        metadata=option(
            group="optimisation", rules=_COUNT, help="warmup steps (default: --warmup-ratio)"
        ),
    )
    warmup_ratio: float = field(
        default=0.05,
        metadata=option(group="optimisation", rules=_SHARE, help="(default {default})"),
    )
    decay_steps: int = field(
        default=0,
        metadata=option(
            group="optimisation", rules=_COUNT, help="WSD decay steps at the end (default: ratio)"
        ),
    )
    decay_ratio: float = field(
        default=0.2, metadata=option(group="optimisation", rules=_SHARE, help="(default {default})")
    )
    decay_shape: DecayShape = field(
        default="linear",
        metadata=option(group="optimisation", help="shape of the WSD decay (default {default})"),
    )
    min_lr_ratio: float = field(
        default=0.0,
        metadata=option(
            group="optimisation",
            rules=_SHARE,
            help="learning rate at the end of the decay, as a share of --lr (default {default})",
        ),
    )
    precision: Precision = field(
        default="auto",
        metadata=option(
            group="optimisation",
            help="auto = bf16 on a GPU, fp32 on CPU; fp8 = bf16 autocast + torchao float8 "
            "matmuls in the attention projections and dense / shared-expert MLPs (routed experts, "
            "routers and the LM head stay bf16; needs an H100/H200/Ada GPU and "
            "pip install 'maxscore[speed]')",
        ),
    )
    fused_loss: bool = field(
        default=False,
        metadata=option(
            group="optimisation",
            runtime=True,
            help="LM head + cross-entropy in one liger-kernel kernel, without materialising the "
            "logits in training (same loss, less memory; CUDA GPU, pip install "
            "'maxscore[speed]'; default off)",
        ),
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata=option(
            group="optimisation",
            help="recompute activations in backward (activation checkpointing)",
        ),
    )
    compile: bool = field(
        default=False,
        metadata=option(
            group="optimisation",
            runtime=True,
            help="torch.compile each decoder layer and the loss (GPU speed; ~1 min warm-up)",
        ),
    )
    compile_mode: CompileMode = field(
        default="default",
        metadata=option(
            group="optimisation", runtime=True, help="torch.compile mode for --compile"
        ),
    )
    deterministic: bool = field(
        default=False,
        metadata=option(
            group="optimisation",
            help="same-seed reruns agree bit for bit on one GPU type: torch's deterministic "
            "algorithms (an op without one fails), cuDNN deterministic, CUBLAS_WORKSPACE_CONFIG="
            ":4096:8, inductor's deterministic mode with --compile (slower; default off)",
        ),
    )
    output_dir: str | None = field(
        default=None,
        metadata=option(
            group="run directory",
            runtime=True,
            help="run directory (default runs/<model>-<router>)",
        ),
    )
    # Every 250 steps: one evaluation of the whole validation split (195k tokens) costs about a
    # sixth of the default 250-step CPU run, so the default run evaluates once, at its end.
    eval_steps: int = field(
        default=250,
        metadata=option(
            group="run directory", rules=_COUNT, help="evaluate every N steps (default {default})"
        ),
    )
    save_steps: int = field(
        default=125,
        metadata=option(
            group="run directory", rules=_COUNT, help="checkpoint every N steps (default {default})"
        ),
    )
    logging_steps: int = field(
        default=10,
        metadata=option(
            group="run directory", rules=_COUNT, help="log every N steps (default {default})"
        ),
    )
    save_total_limit: int = field(
        default=2,
        metadata=option(group="run directory", help="checkpoints kept (default {default})"),
    )
    save_final: bool = field(
        default=True,
        metadata=option(group="run directory", help="checkpoint at the last step (default on)"),
    )
    resume: bool = field(
        default=False,
        metadata=option(group="run directory", runtime=True, switch=True, help="continue the run"),
    )
    overwrite: bool = field(
        default=False,
        metadata=option(
            group="run directory",
            runtime=True,
            switch=True,
            help="replace an existing run directory",
        ),
    )
    deepspeed: str | None = field(
        default=None,
        metadata=option(
            group="optimisation",
            runtime=True,
            help="zero2, zero3 (shipped configs) or a DeepSpeed JSON path",
        ),
    )
    lora: bool = field(
        default=False,
        metadata=option(
            group="optimisation",
            help="train LoRA adapters (peft; pip install 'maxscore[lora]') instead of every weight",
        ),
    )
    lora_r: int = field(
        default=16,
        metadata=option(group="optimisation", help="LoRA rank (default {default})"),
    )
    lora_alpha: float = field(
        default=32.0,
        metadata=option(group="optimisation", help="LoRA scale alpha (default {default})"),
    )
    lora_targets: str = field(
        default="attention,experts,router",
        metadata=option(
            group="optimisation",
            help="comma-separated: attention, experts, mlp (LoRA), router (trained in full) "
            "(default {default})",
        ),
    )
    expert_parallel: int = field(
        default=1,
        metadata=option(
            group="optimisation",
            rules=_POSITIVE,
            runtime=True,
            metavar="N",
            help="spread each MoE layer's experts over N processes (torchrun; N divides the "
            "processes and the experts; default {default})",
        ),
    )
    fsdp: bool = field(
        default=False,
        metadata=option(
            group="optimisation",
            runtime=True,
            help="with --expert-parallel: shard the dense parameters and their optimizer state "
            "over all processes (FSDP2) instead of replicating them (DDP); default off",
        ),
    )
    num_workers: int = field(
        default=0,
        metadata=option(
            group="run directory", runtime=True, help="DataLoader workers (default {default})"
        ),
    )
    gc_interval: int = field(
        default=50,
        metadata=option(
            group="run directory",
            rules=(at_least(0, " (0: Python's automatic collection)"),),
            runtime=True,
            metavar="N",
            help="collect Python's garbage every N steps instead of automatically (no stalls from "
            "full collections; 0: automatic; default {default})",
        ),
    )
    report_to: str = field(
        default="auto",
        metadata=option(
            group="run directory",
            runtime=True,
            help="auto (TensorBoard if installed), none, all (every installed tracker), or "
            "comma-separated trackers the HF Trainer knows: tensorboard, wandb, mlflow, trackio, "
            "comet_ml, clearml, dvclive, swanlab, ... (pip install 'maxscore[trackers]')",
        ),
    )
    quiet: bool = field(
        default=False,
        metadata=option(group="run directory", runtime=True, switch=True, help="no progress bar"),
    )
    recipe: str | None = field(
        default=None,
        metadata=option(
            group=None,
            rules=(_KNOWN_RECIPE,),
            choices=tuple(RECIPES),
            help="paper: the paper's setup (Base, C4, 180k steps, t over 30k); paper-shape: its "
            "optimizer and WSD / t schedule proportions scaled to this run (flags override both)",
        ),
    )

    def __post_init__(self) -> None:
        """Types and each field's rules, then the rules that join several fields."""
        check_fields(self, "training config", ConfigError)
        if self.max_tokens is None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other; pick one")
        parse_report_to(self.report_to)  # names only; installation is checked by prepare()

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
        yaml_file = path.suffix in (".yaml", ".yml")
        data = (yaml.safe_load(text) or {}) if yaml_file else json.loads(text)
        # A run directory's config.json nests the training config next to derived values.
        data = data.get("train", data)
        return cls.from_dict(data)

    def differences(self, other: TrainConfig, ignore: frozenset[str] | None = None) -> dict:
        """``{field: (self_value, other_value)}`` for fields that differ (``ignore`` skipped;
        default :data:`RUNTIME_FIELDS`)."""
        ignore = RUNTIME_FIELDS if ignore is None else ignore
        mine, theirs = self.to_dict(), other.to_dict()
        return {
            k: (mine[k], theirs[k]) for k in mine if k not in ignore and mine[k] != theirs.get(k)
        }


#: Fields that may differ between a run directory's stored config and a ``--resume`` of it
#: without a warning: they say where/how to run, not what is trained.
RUNTIME_FIELDS: frozenset[str] = frozenset(
    f.name for f in fields(TrainConfig) if f.metadata.get("runtime")
)


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
    data = config.to_dict()
    for key, value in RECIPES[config.recipe].items():
        if key not in explicit:
            data[key] = value
    return TrainConfig.from_dict(data)
