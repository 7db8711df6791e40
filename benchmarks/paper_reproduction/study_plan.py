"""What the miniature reproduction of the paper trains: routers, seeds, budget, recipe.

Every router preset of the paper's Tables 2 and 3 plus the dense baseline, at the Base preset
(DeepSeek at its fine-grained ``deepseek-base`` shape, as in the paper) on the embedded corpus,
with the same token budget per run and the paper's recipe shape scaled to the run
(``--recipe paper-shape``: AdamW betas (0.9, 0.95), eps 1e-6, weight decay 0.1, WSD with warmup
over 2/180 and decay over the last 6/180 of the run, SoftTopk ``t`` annealed over 1/6 of it).
Three seeds for the routers of the paper's ablation (Table 3: GShard, GShard-I, GShard-S,
GShard-M, MaxScore-I, MaxScore), one for the others.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from maxscore.training import TrainConfig


@dataclass(frozen=True)
class RouterPlan:
    """One router of the study: its preset, model preset and seeds."""

    router: str
    paper_name: str
    seeds: tuple[int, ...]
    model: str = "base"


#: Seeds of the ablation routers; the others use the first.
SEEDS: tuple[int, ...] = (42, 43, 44)

#: The study's routers, in the paper's Table 2 order, then the Table 3 ablations.
ROUTERS: tuple[RouterPlan, ...] = (
    RouterPlan("dense", "Dense", SEEDS[:1]),
    RouterPlan("gshard", "GShard", SEEDS),
    RouterPlan("gshard-i", "GShard-I", SEEDS),
    RouterPlan("sbase", "SBASE", SEEDS[:1]),
    RouterPlan("expert-choice", "ExpertChoice", SEEDS[:1]),
    RouterPlan("dropless", "DropLess", SEEDS[:1]),
    RouterPlan("deepseek", "DeepSeek", SEEDS[:1], model="deepseek-base"),
    RouterPlan("maxscore-i", "MaxScore-I", SEEDS),
    RouterPlan("maxscore", "MaxScore", SEEDS),
    RouterPlan("gshard-s", "GShard-S", SEEDS),
    RouterPlan("gshard-m", "GShard-M", SEEDS),
)

#: Routers whose training routing differs from the causal evaluation routing (capacity or
#: flow): lm-eval runs for them with both routings.
BOTH_ROUTINGS: frozenset[str] = frozenset(
    {
        "gshard",
        "gshard-i",
        "gshard-s",
        "gshard-m",
        "sbase",
        "expert-choice",
        "maxscore-i",
        "maxscore",
    }
)


@dataclass(frozen=True)
class StudyConfig:
    """The shared settings of every run (tests shrink them; the study uses the defaults).

    Attributes:
        model: model preset for every router without its own (``RouterPlan.model``).
        tokens: training tokens per run (the same budget for every run).
        seq_len, batch_size, grad_accum: tokens per optimizer step = their product.
        lr: peak learning rate (the paper's 3e-5 belongs to its batch of 688 x 180k steps; a
            run of a few hundred steps needs a larger one; 6e-4 is what the measured 400-step
            Base runs used).
        recipe: ``paper-shape`` (see the module docstring).
        compile: torch.compile the layers (GPU).
        eval_steps: validation interval in optimizer steps (the loss curves' points).
        save_steps: checkpoint interval (a run cut by a time limit resumes from the last one).
        max_eval_blocks: ``None``: the whole validation split (tests use a few blocks).
        eval_tasks: lm-eval tasks (the eight with offline data) and ``eval_limit``: documents
            per task (``None``: all).
        routers / seeds_override: restrict the plan (tests, partial studies).
    """

    model: str = "base"
    tokens: int = 25_000_000
    seq_len: int = 512
    batch_size: int = 128
    grad_accum: int = 1
    lr: float = 6e-4
    recipe: str = "paper-shape"
    compile: bool = True
    eval_steps: int = 64
    save_steps: int = 64
    max_eval_blocks: int | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)
    eval_tasks: str = "bundled"
    eval_limit: int | None = None
    eval_batch_size: int = 32
    routers: tuple[str, ...] | None = None
    seeds_override: tuple[int, ...] | None = None

    def plans(self) -> list[RouterPlan]:
        """The routers of this study (all, or those named in ``routers``), with their seeds."""
        known = {p.router: p for p in ROUTERS}
        names = self.routers or tuple(known)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown study router(s) {unknown}; known: {sorted(known)}")
        plans = [known[n] for n in names]
        if self.seeds_override is not None:
            plans = [replace(p, seeds=self.seeds_override[: len(p.seeds)]) for p in plans]
        return plans

    def runs(self) -> list[tuple[str, int]]:
        """Every ``(router, seed)`` of the study, in plan order."""
        return [(p.router, s) for p in self.plans() for s in p.seeds]

    def train_config(self, router: str, seed: int, output_dir: str) -> TrainConfig:
        """The :class:`TrainConfig` of one run (the recipe applied, explicit fields kept)."""
        from maxscore.training import apply_recipe

        plan = {p.router: p for p in ROUTERS}[router]
        model = self.model if plan.model == "base" else plan.model
        config = TrainConfig(
            model=model,
            model_overrides=dict(self.model_overrides),
            router=router,
            dataset="default",
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            max_tokens=self.tokens,
            lr=self.lr,
            seed=seed,
            compile=self.compile,
            eval_steps=self.eval_steps,
            max_eval_blocks=self.max_eval_blocks,
            save_steps=self.save_steps,
            save_total_limit=1,
            logging_steps=max(1, min(10, self.eval_steps)),
            report_to="none",
            quiet=True,
            output_dir=output_dir,
            recipe=self.recipe,
        )
        explicit = {f for f in asdict(config) if f != "recipe"} - _RECIPE_FIELDS
        return apply_recipe(config, explicit)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Fields the recipe decides (not set explicitly above).
_RECIPE_FIELDS: frozenset[str] = frozenset(
    {
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_eps",
        "lr_schedule",
        "warmup_steps",
        "warmup_ratio",
        "decay_steps",
        "decay_ratio",
        "temperature_steps",
        "temperature_fraction",
    }
)
