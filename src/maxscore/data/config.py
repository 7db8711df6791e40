"""The data settings of a run (:class:`DataConfig`): where its documents come from and how they
become token blocks.

:class:`~maxscore.training.config.TrainConfig` extends it with the model, optimisation and run
settings; the data modules (:mod:`maxscore.data.sources`, :mod:`maxscore.data.packing`) and
the analysis of a run's stored config (:mod:`maxscore.analysis.checkpoint_stats`) read a
``DataConfig`` alone. Plain data, checked when made (:func:`maxscore.config_types.check_fields`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from maxscore.config_types import ConfigError, at_least, check_fields, option, within

__all__ = ["DataConfig", "DataFormat", "TxtDocuments"]

TxtDocuments = Literal["paragraphs", "lines"]
DataFormat = Literal["auto", "text", "chat", "prompt-completion"]

_POSITIVE = (at_least(1),)
_SHARE = (within(0, 1),)


@dataclass
class DataConfig:
    """Where a run's documents come from and how they are cut into blocks.

    Each field's ``metadata`` holds its command-line help and flag group
    (:func:`maxscore.config_types.option`) and the rules its value must meet.

    Attributes:
        dataset: ``"default"`` (the embedded corpus), a Hugging Face dataset name (``"c4"`` is
            ``allenai/c4``, config ``en``), or a local ``.txt`` / ``.jsonl`` file or folder.
        dataset_config: Hugging Face dataset config name (``"en"`` for C4).
        text_field: the text column of a HF dataset or a JSONL record.
        streaming: stream a HF dataset instead of downloading it (``None``: only for C4).
        txt_documents: how a local ``.txt`` file is cut into documents: ``"paragraphs"``
            (default): documents are separated by blank lines (lines that are empty or only white
            space); ``"lines"``: every non-blank line is a document. Refused for a source
            without ``.txt`` files (:mod:`maxscore.data.sources`).
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
        tokenizer: ``"default"`` (the embedded 32k LLaMA-style tokenizer), or a HF tokenizer name
            or local path.
        seq_len: tokens per training sequence (documents are packed into blocks of this length).
        seed: seeds model initialisation, document order and batch order.
    """

    dataset: str = field(
        default="default",
        metadata=option(
            group="data",
            help="'default' (embedded corpus), a HF dataset name ('c4' = allenai/c4 en, streamed) "
            "or a local .txt/.jsonl file or folder. Documents: one JSON object per .jsonl line; "
            "in a .txt file, text separated by blank lines (see --txt-documents); 1%% of them "
            "(at least one; --validation-fraction) is held out for validation",
        ),
    )
    dataset_config: str | None = field(
        default=None, metadata=option(group="data", help="HF dataset config name (e.g. en)")
    )
    text_field: str = field(
        default="text",
        metadata=option(group="data", help="text column / JSON field (default {default})"),
    )
    streaming: bool | None = field(
        default=None,
        metadata=option(group="data", help="stream the HF dataset (default: only for c4)"),
    )
    txt_documents: TxtDocuments = field(
        default="paragraphs",
        metadata=option(
            group="data",
            help="how a .txt file is cut into documents: paragraphs = separated by blank lines "
            "(lines empty or only white space), lines = every non-blank line (default {default})",
        ),
    )
    data_format: DataFormat = field(
        default="auto",
        metadata=option(
            group="data",
            help="text (a document per record), chat (a 'messages' list, rendered with the "
            "tokenizer's chat template) or prompt-completion ('prompt' + 'completion'); auto "
            "(default): from a .jsonl's first record",
        ),
    )
    completion_only_loss: bool = field(
        default=True,
        metadata=option(
            group="data",
            help="chat / prompt-completion data: loss on the completion (assistant turns) only "
            "(default on)",
        ),
    )
    validation_fraction: float = field(
        default=0.01,
        metadata=option(
            group="data",
            rules=_SHARE,
            help="share of the documents held out for validation when the source has no "
            "validation split (default {default}; at least one document)",
        ),
    )
    max_train_documents: int | None = field(
        default=None, metadata=option(group="data", help="use only the first N documents")
    )
    max_eval_blocks: int | None = field(
        default=None,
        metadata=option(
            group="data",
            rules=_POSITIVE,
            help="validation blocks, evenly spaced over the split (default: the whole split)",
        ),
    )
    tokenizer: str = field(
        default="default",
        metadata=option(
            group="data", help="'default' (embedded 32k LLaMA-style) or a HF name / local path"
        ),
    )
    seq_len: int = field(
        default=128,
        metadata=option(
            group="data", rules=_POSITIVE, help="tokens per sequence (default {default})"
        ),
    )
    # numpy's seeding range (a negative seed fails there)
    seed: int = field(
        default=42,
        metadata=option(
            group="optimisation",
            rules=(within(0, 2**32 - 1, label="[0, 2^32 - 1]"),),
            help="(default {default})",
        ),
    )

    def __post_init__(self) -> None:
        check_fields(self, "data config", ConfigError)

    @classmethod
    def of(cls, settings: dict[str, Any]) -> DataConfig:
        """The data settings among ``settings`` (e.g. a run's stored training config; the
        others are ignored, missing ones take their defaults)."""
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in settings.items() if key in names})
