"""What the paper-claims study trains: arms (a router at a model shape and routing group), seeds,
budget, recipe, and the order a device call takes them in.

An *arm* is one training setting: a router preset, its overrides (routing group, SoftTopk
schedule, operator) and a model shape (sparsity). Every arm trains once per seed with the same
budget; two arms with the same seed share the initialisation of every common parameter and the
data order, so their per-seed difference is the paired measurement of :mod:`claims_report`.

The model is the paper's Llama-MoE at a smaller width (:data:`STUDY_MODEL`: hidden 512, 8 layers,
8 heads, expert FFN ``4 * hidden / k`` as in the paper, vocabulary 32,000) so that many seeds fit
the GPU budget; the regime is the paper's: 16 experts with k = 2, capacity factor 1, 512-token
sequences, the paper's optimiser and schedule shape (``--recipe paper-shape``), the auxiliary
loss of Eq. 9 at 1e-2.

Routing groups. The authors' code routes the flow routers (MaxScore, MaxScore-I, GShard-M) per
512-token sequence and the baselines (GShard, -S, -I, DropLess) per micro-batch, so a comparison
of the presets as they are mixes the router with the group. Arms ending in ``@seq`` route every
router per sequence; arms ending in ``@8seq`` per 4,096 tokens (8 sequences). A claim says which
groups it rests on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

#: The study's model: Base's architecture at hidden 512 / 8 layers (Base: 768 / 12).
STUDY_MODEL: dict[str, Any] = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8}

#: Model shapes of the sparsity sweep: overrides on top of :data:`STUDY_MODEL`. The expert width
#: follows ``4 * hidden / k`` (so every shape activates the same FFN width, 2 x 1024); the
#: DeepSeek shape splits it into 6 routed experts of 256 and one shared expert of 512.
SHAPES: dict[str, dict[str, Any]] = {
    "2:16": {},
    "2:32": {"num_experts": 32},
    "2:64": {"num_experts": 64},
    "8:128": {"num_experts": 128, "num_experts_per_tok": 8},
    "6:64+1": {
        "num_experts": 64,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 256,
        "num_shared_experts": 1,
        "shared_expert_intermediate_size": 512,
    },
}

SEQUENCE_GROUP: dict[str, Any] = {"group": "sequence"}
EIGHT_SEQUENCES: dict[str, Any] = {"group": "tokens", "group_size": 4096}


@dataclass(frozen=True)
class Arm:
    """One training setting of the study.

    Attributes:
        name: the arm's key (results live in ``raw/<name>/seed-<s>.json``).
        router: router preset (``maxscore presets router``).
        shape: key of :data:`SHAPES`.
        router_overrides: RouterConfig fields changed from the preset.
        seeds: how many seeds (1..seeds) the arm is planned for.
        tier: order of work (lower first); within a tier, seed by seed across arms, so that a
            call cut short leaves complete pairs.
        group: the routing group in words (for the report).
    """

    name: str
    router: str
    shape: str = "2:16"
    router_overrides: dict[str, Any] = field(default_factory=dict)
    seeds: int = 16
    tier: int = 0
    group: str = "authors'"


def _arms() -> tuple[Arm, ...]:
    seq, eight = SEQUENCE_GROUP, EIGHT_SEQUENCES
    arms = [
        # The headline: MaxScore against GShard, with the authors' groups and per sequence.
        Arm("gshard", "gshard", group="micro-batch", seeds=24),
        Arm("maxscore", "maxscore", group="sequence", seeds=24),
        Arm("gshard@seq", "gshard", router_overrides=seq, group="sequence", seeds=24),
        Arm("dropless", "dropless", group="micro-batch", seeds=4, tier=1),
    ]
    # The sparsity sweep (Table 7 / Fig. 7): GShard, DropLess and MaxScore at each shape.
    for shape, seeds, tier in (("2:32", 4, 1), ("2:64", 4, 1), ("8:128", 2, 3), ("6:64+1", 2, 3)):
        for router, group in (
            ("gshard", "micro-batch"),
            ("dropless", "micro-batch"),
            ("maxscore", "sequence"),
        ):
            arms.append(
                Arm(f"{router}/{shape}", router, shape=shape, seeds=seeds, tier=tier, group=group)
            )
    # Table 3's ablation, authors' groups and per sequence.
    arms += [
        Arm("gshard-s", "gshard-s", group="micro-batch", seeds=8, tier=2),
        Arm("gshard-m", "gshard-m", group="sequence", seeds=8, tier=2),
        Arm("gshard-i", "gshard-i", group="micro-batch", seeds=8, tier=2),
        Arm("maxscore-i", "maxscore-i", group="sequence", seeds=8, tier=2),
        Arm("gshard-s@seq", "gshard-s", router_overrides=seq, seeds=8, tier=2, group="sequence"),
        Arm("gshard-i@seq", "gshard-i", router_overrides=seq, seeds=8, tier=2, group="sequence"),
    ]
    # The SoftTopk schedule (Fig. 10): t from 3 to 0 (the authors' code, factor 4 -> 1; ours)
    # against the paper's text read in its equation, t0 = 4 decaying to 1 (factor 5 -> 2), and t
    # held at 3. The operators of Table 2 with the flow assignment (Fig. 9).
    text_schedule = {"temperature": {"start": 4.0, "end": 1.0}}
    constant = {"temperature": {"start": 3.0, "end": 3.0, "shape": "constant"}}
    arms += [
        Arm(
            "maxscore/t4to1",
            "maxscore",
            router_overrides=text_schedule,
            seeds=4,
            tier=3,
            group="sequence",
        ),
        Arm(
            "maxscore/t3const",
            "maxscore",
            router_overrides=constant,
            seeds=4,
            tier=3,
            group="sequence",
        ),
    ]
    for operator in ("softkmax", "itertopk", "gradtopk", "sigmoid"):
        arms.append(
            Arm(
                f"flow/{operator}",
                "maxscore",
                router_overrides={"operator": operator},
                seeds=2,
                tier=4,
                group="sequence",
            )
        )
    # One common group larger than a sequence: 8 sequences (4,096 tokens) for both.
    arms += [
        Arm("gshard@8seq", "gshard", router_overrides=eight, seeds=4, tier=4, group="8 sequences"),
        Arm(
            "maxscore@8seq",
            "maxscore",
            router_overrides=eight,
            seeds=4,
            tier=4,
            group="8 sequences",
        ),
    ]
    return tuple(arms)


ARMS: tuple[Arm, ...] = _arms()


def arm_slug(name: str) -> str:
    """A file-name-safe form of an arm's name (``dropless/2:32`` -> ``dropless_2x32``)."""
    return name.replace("/", "_").replace(":", "x").replace("@", "-at-").replace("+", "p")


ARMS_BY_NAME: dict[str, Arm] = {arm.name: arm for arm in ARMS}
#: Seeds past this many of the headline arms come after every other tier.
HEADLINE_FIRST_SEEDS = 8


@dataclass(frozen=True)
class StudyConfig:
    """The shared settings of every run (the tests shrink them).

    Attributes:
        model: model preset the study's shape overrides start from.
        model_overrides: :data:`STUDY_MODEL` (the tests use a tinier one).
        tokens: training tokens per run (every arm the same budget).
        seq_len, batch_size: tokens per optimizer step = their product.
        lr: peak learning rate (a run of a few hundred steps needs more than the paper's 3e-5).
        recipe: ``paper-shape``: AdamW (0.9, 0.95), eps 1e-6, wd 0.1, WSD with warmup 2/180 and
            decay 6/180 of the run, SoftTopk t annealed over 1/6 of it.
        deterministic: deterministic kernels (``--deterministic``), so a rerun of one seed
            gives the same loss and the paired differences carry no run-to-run noise (0.6-0.8x
            the tokens/s on an H200, ``benchmarks/determinism/``). The recorded study ran
            without it; a study that turns it on starts a fresh results folder.
        eval_steps: validation interval (the loss curves' points).
        max_eval_blocks: ``None``: the whole validation split.
        arms / seeds: restrict the plan (tests, partial studies); ``seeds`` caps every arm.
    """

    model: str = "base"
    model_overrides: dict[str, Any] = field(default_factory=lambda: dict(STUDY_MODEL))
    tokens: int = 240 * 64 * 512
    seq_len: int = 512
    batch_size: int = 64
    lr: float = 1e-3
    recipe: str = "paper-shape"
    deterministic: bool = False
    eval_steps: int = 80
    max_eval_blocks: int | None = None
    arms: tuple[str, ...] | None = None
    seeds: int | None = None

    def plan(self) -> list[Arm]:
        names = self.arms or tuple(ARMS_BY_NAME)
        unknown = [n for n in names if n not in ARMS_BY_NAME]
        if unknown:
            raise ValueError(f"unknown study arm(s) {unknown}; known: {sorted(ARMS_BY_NAME)}")
        arms = [ARMS_BY_NAME[n] for n in names]
        if self.seeds is not None:
            arms = [replace(a, seeds=min(a.seeds, self.seeds)) for a in arms]
        return arms

    def queue(self) -> list[tuple[str, int]]:
        """Every ``(arm, seed)`` in the order a call takes them: by tier, then seed by seed
        across the tier's arms (complete pairs first); the headline arms' seeds past
        :data:`HEADLINE_FIRST_SEEDS` last."""
        keyed = []
        for order, arm in enumerate(self.plan()):
            for seed in range(1, arm.seeds + 1):
                tier = arm.tier if seed <= HEADLINE_FIRST_SEEDS else 9
                keyed.append(((tier, seed, order), (arm.name, seed)))
        return [run for _, run in sorted(keyed)]

    def train_config(self, arm_name: str, seed: int, output_dir: str) -> Any:
        """The :class:`~maxscore.training.TrainConfig` of one run (recipe applied)."""
        from maxscore.training import TrainConfig, apply_recipe

        arm = ARMS_BY_NAME[arm_name]
        config = TrainConfig(
            model=self.model,
            model_overrides={**self.model_overrides, **SHAPES[arm.shape]},
            router=arm.router,
            router_overrides=dict(arm.router_overrides),
            dataset="default",
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            max_tokens=self.tokens,
            lr=self.lr,
            seed=seed,
            deterministic=self.deterministic,
            eval_steps=self.eval_steps,
            max_eval_blocks=self.max_eval_blocks,
            save_steps=0,
            save_final=False,
            logging_steps=max(1, min(10, self.eval_steps)),
            report_to="none",
            quiet=True,
            output_dir=output_dir,
            recipe=self.recipe,
        )
        # The recipe fills only its own fields (optimiser, schedule shape, t length), none of
        # which are set above.
        return apply_recipe(config)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StudyConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown study setting(s) {unknown}; known: {sorted(known)}")
        values = dict(data)
        if values.get("arms") is not None:
            values["arms"] = tuple(values["arms"])
        return cls(**values)


#: ``gpu``: the study as run on H200s; ``cpu-smoke``: a few seconds a run on a CPU (tests).
PROFILES: dict[str, StudyConfig] = {
    "gpu": StudyConfig(),
    "cpu-smoke": StudyConfig(
        model="tiny",
        model_overrides={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2},
        tokens=6 * 4 * 64,
        seq_len=64,
        batch_size=4,
        lr=1e-3,
        eval_steps=3,
        max_eval_blocks=4,
        deterministic=False,
    ),
}
