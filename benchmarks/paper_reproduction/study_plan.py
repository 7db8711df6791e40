"""What the miniature reproduction of the paper trains: routers, seeds, budget, recipe.

Every router preset of the paper's Tables 2 and 3 plus the dense baseline, at the Base preset
(DeepSeek at its fine-grained ``deepseek-base`` shape, as in the paper) on the embedded corpus,
with the same token budget per run and the paper's recipe shape scaled to the run
(``--recipe paper-shape``: AdamW betas (0.9, 0.95), eps 1e-6, weight decay 0.1, WSD with warmup
over 2/180 and decay over the last 6/180 of the run, SoftTopk ``t`` annealed over 1/6 of it).
Three seeds for the routers of the paper's ablation (Table 3: GShard, GShard-I, GShard-S,
GShard-M, MaxScore-I, MaxScore), one for the others.

Two profiles (:data:`PROFILES`) size the runs. ``full`` is the study as specified (25M tokens
per run, micro-batch 128, compiled). ``one-call`` is what fits one device call of about nine
minutes on two H100s; see :data:`ONE_CALL` for its choices. :func:`priority` orders the runs so
that a call too short for the whole plan does the claims first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
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

#: The routers of the paper's Table 3 ablation besides GShard and MaxScore.
ABLATION: tuple[str, ...] = ("gshard-s", "gshard-m", "gshard-i", "maxscore-i")


def priority(router: str, seed_index: int) -> int:
    """Tier of a run in the work queue (lower first).

    0: GShard and MaxScore, every seed (the headline claim); 1: the other ablation routers,
    first two seeds; 2: Dense and DropLess, one seed; 3: the ablation's third seeds;
    4: the remaining baselines (DeepSeek, ExpertChoice, SBASE).
    """
    if router in ("gshard", "maxscore"):
        return 0
    if router in ABLATION:
        return 1 if seed_index < 2 else 3
    if router in ("dense", "dropless"):
        return 2
    return 4


#: Where a run trained again for its lm-eval keeps the files of the run it replaced (inside the
#: run's results folder).
SUPERSEDED = "before-retraining"

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
        save_final: write a final checkpoint (lm-eval reads it; without lm-eval it is not kept).
        lm_eval: run the offline lm-eval tasks on each final checkpoint.
        eval_steps: validation interval in optimizer steps (the loss curves' points).
        save_steps: checkpoint interval (a run cut by a time limit resumes from the last one;
            0: none).
        max_eval_blocks: ``None``: the whole validation split (tests use a few blocks).
        eval_tasks: lm-eval tasks (the eight with offline data) and ``eval_limit``: documents
            per task (``None``: all), the first ones of each task's split. All eight tasks'
            documents make 75,725 loglikelihood requests per routing, about 4 minutes on an
            H200 at batch 32 (measured), so two routings do not fit the device call that trains
            the run; 1,000 per task (7,500 documents, 22,996 requests) at batch 64 takes about a
            minute per routing and MoE run (causal: 52-54 s on an H200, 58-72 s on an H100;
            training routing 62-111 s on an H100; Dense 33 s). On an H200 a run and both its
            lm-eval routings fit one call; on an H100 the training routing needs a second call
            on the same machine (``run_gpu.sh`` with ``RESTORE=1``).
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
    save_final: bool = True
    lm_eval: bool = True
    eval_steps: int = 64
    save_steps: int = 64
    max_eval_blocks: int | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)
    eval_tasks: str = "bundled"
    eval_limit: int | None = 1000
    eval_batch_size: int = 64
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

    def queue(self) -> list[tuple[str, int]]:
        """Every ``(router, seed)`` in the order a call takes them (:func:`priority`)."""
        order = {p.router: i for i, p in enumerate(self.plans())}
        keyed = [
            ((priority(p.router, i), i, order[p.router]), (p.router, s))
            for p in self.plans()
            for i, s in enumerate(p.seeds)
        ]
        return [run for _, run in sorted(keyed)]

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
            save_final=self.save_final,
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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StudyConfig:
        """The inverse of :meth:`to_dict` (JSON lists back to tuples; unknown keys ignored)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for name in ("routers", "seeds_override"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)


#: The study that fits ONE device call of about nine minutes (540 s, compilation and start-up
#: included) on two H100s, one process per GPU taking the next pending run from a queue.
#:
#: - Budget: about 2 x 500 GPU-seconds for the 14 runs of the claims (GShard and MaxScore x 3
#:   seeds, GShard-S / -M / -I and MaxScore-I x 2 seeds), so about 70 s per run, of which some
#:   15 s are fixed (tokenising the corpus, building the model, validation, files).
#: - No ``torch.compile``: it costs 30-60 s per run (every run compiles) against 1.7x faster
#:   steps (~165 against ~95 ms at micro-batch 64): it pays off only beyond ~550 steps, and
#:   these runs have 200. Eager steps take about 165 ms (GShard; about 200 ms with the flow
#:   solver of GShard-M / MaxScore), so a run takes about 50 s and the 14 runs of the claims
#:   about 6 minutes; the rest of the call goes to Dense, DropLess and third seeds.
#: - Micro-batch 64 x 512 (32,768 tokens per step) and 200 steps: 6.55M tokens per run (0.67
#:   passes over the 9.8M-token training split). At the same tokens, micro-batch 64 gives twice
#:   the optimizer steps of 128 (a short run's loss depends on steps more than on batch size)
#:   and the warmup / t annealing / decay get 2 / 33 / 7 steps instead of 1 / 17 / 4.
#: - The recipe stays ``paper-shape``: warmup 2/180, decay 6/180, t annealed over 1/6 of the run.
#: - Validation on the whole validation split (195k tokens) every 50 steps (four points).
#: - No checkpoints (nothing resumes across calls; a run cut by the deadline is not counted)
#:   and no lm-eval (not installed on the machine, and models of this size score at chance).
ONE_CALL = StudyConfig(
    tokens=200 * 64 * 512,
    batch_size=64,
    compile=False,
    save_final=False,
    lm_eval=False,
    eval_steps=50,
    save_steps=0,
)

#: The study's profiles: ``full`` as specified, ``one-call`` (:data:`ONE_CALL`).
PROFILES: dict[str, StudyConfig] = {"full": StudyConfig(), "one-call": ONE_CALL}


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
