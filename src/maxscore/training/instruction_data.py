"""Instruction data: chat conversations and prompt / completion pairs, the loss on the answer only.

Record formats (:data:`RECORD_FORMATS`; ``TrainConfig.data_format="auto"`` picks one from the
first record's fields, as TRL names them):

* ``chat``: ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``,
  rendered with the tokenizer's chat template; the completion is every assistant turn, with the
  template's end-of-turn text (so the model learns to stop);
* ``prompt-completion``: ``{"prompt": "...", "completion": "..."}``, the text ``prompt +
  completion + EOS``; the completion is ``completion + EOS``. (Both as message lists: rendered
  with the chat template, the completion being what the template adds for them.)

With ``completion_only_loss`` (the default) only completion tokens are targets (labels
``-100`` elsewhere); without it every token but each example's first is.

Which tokens are the completion is found on the rendered text, not by re-tokenising pieces:
the template renders the conversation up to each assistant turn (with the generation prompt)
and including it, the difference is that turn's character span, and the tokens whose characters
start inside a span (the fast tokenizer's offsets) are the completion. This works for any
template whose rendering of a prefix of the conversation is a prefix of the whole rendering
(checked; a template that is not is refused).

Packing (:func:`pack_examples`): examples are placed whole, in order, into blocks of ``seq_len``
tokens (next fit: an example that does not fit in the current block starts the next one; one
longer than a block is cut to it, counted and reported). ``position_ids`` restart at 0 for every
example, which is how transformers' mask builder knows packed sequences: attention stays inside
each example and RoPE counts from its start, as if it were alone (``masking_utils``'
``find_packed_sequence_indices``; flash-attention reads them as variable-length sequences). The
rest of a block is padding, a sequence of its own without targets. The routers see a block as
one routing group, as they do a block of packed documents.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from maxscore.config_types import ConfigError
from maxscore.data.packing import PackedDataset
from maxscore.training.validation_set import DOCUMENT_KEY, ValidationDataset

__all__ = [
    "IGNORE_INDEX",
    "RECORD_FORMATS",
    "Example",
    "InstructionDataset",
    "InstructionValidation",
    "PackedExamples",
    "detect_format",
    "encode_example",
    "pack_examples",
]

#: Label of a token that is not a target (transformers' cross-entropy ignore index).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class RecordFormat:
    """One instruction record format: the fields that identify it and how it renders.

    Attributes:
        fields: the record fields it needs.
        render: ``(record, tokenizer) -> (text, completion character spans)``.
    """

    fields: tuple[str, ...]
    render: Callable[[dict[str, Any], Any], tuple[str, list[tuple[int, int]]]]


def _template(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def _check_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "chat records need a tokenizer with a chat template, and this one has none; use the "
            "model's own tokenizer (--tokenizer), or add chat_template.jinja to its folder"
        )


def _extend(text: str, longer: str, what: str) -> str:
    """``longer``'s part after ``text``, which must be its prefix."""
    if not longer.startswith(text):
        raise ConfigError(
            f"the chat template renders {what} so that it does not extend the text before it; "
            "the completion tokens cannot be told apart (use prompt/completion records)"
        )
    return longer[len(text) :]


def _render_chat(record: dict[str, Any], tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    messages = record["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ConfigError('\'messages\' must be a list of {"role": ..., "content": ...} objects')
    _check_chat_template(tokenizer)
    text = _template(tokenizer, messages, generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _template(tokenizer, messages[:i], generation_prompt=True) if i else ""
        upto = _template(tokenizer, messages[: i + 1], generation_prompt=False)
        _extend(before, upto, f"assistant turn {i + 1}")
        _extend(upto, text, "the turns after it")
        spans.append((len(before), len(upto)))
    return text, spans


def _render_prompt_completion(
    record: dict[str, Any], tokenizer: Any
) -> tuple[str, list[tuple[int, int]]]:
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):  # conversational pair
        _check_chat_template(tokenizer)
        before = _template(tokenizer, prompt, generation_prompt=True)
        text = _template(tokenizer, [*prompt, *completion], generation_prompt=False)
        _extend(before, text, "the completion")
        return text, [(len(before), len(text))]
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ConfigError("prompt and completion must both be text, or both lists of messages")
    eos = tokenizer.eos_token or ""
    text = prompt + completion + eos
    return text, [(len(prompt), len(text))]


#: Record formats by name, tried in this order by :func:`detect_format`.
RECORD_FORMATS: dict[str, RecordFormat] = {
    "chat": RecordFormat(("messages",), _render_chat),
    "prompt-completion": RecordFormat(("prompt", "completion"), _render_prompt_completion),
}


def detect_format(record: dict[str, Any]) -> str | None:
    """The instruction format whose fields ``record`` has, or ``None`` (plain text)."""
    for name, spec in RECORD_FORMATS.items():
        if all(field in record for field in spec.fields):
            return name
    return None


@dataclass(frozen=True)
class Example:
    """One tokenised example: ``ids`` and its ``labels`` (``-100`` where not a target)."""

    ids: list[int]
    labels: list[int]


def encode_example(
    record: dict[str, Any], data_format: str, tokenizer: Any, completion_only: bool = True
) -> Example:
    """Render, tokenise and label one record (module docstring)."""
    text, spans = RECORD_FORMATS[data_format].render(record, tokenizer)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = encoding["input_ids"]
    if completion_only:
        labels = [
            token if any(lo <= start < hi for lo, hi in spans) else IGNORE_INDEX
            for token, (start, _end) in zip(ids, encoding["offset_mapping"], strict=True)
        ]
    else:
        labels = list(ids)
    if labels:
        labels[0] = IGNORE_INDEX  # predicted by nothing of this example
    return Example(ids, labels)


@dataclass
class PackedExamples:
    """Blocks of whole examples: ``[N, seq_len]`` ids, labels, positions and example indices."""

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    examples: Tensor
    truncated: int

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def block(self, index: int) -> dict[str, Tensor]:
        """Block ``index`` as a training example: its ids, labels and restarting positions."""
        return {
            "input_ids": self.input_ids[index],
            "labels": self.labels[index],
            "position_ids": self.position_ids[index],
        }


def pack_examples(
    examples: Iterable[Example], seq_len: int, pad_id: int, max_blocks: int | None = None
) -> PackedExamples:
    """Next-fit packing of whole examples into ``seq_len`` blocks (module docstring)."""
    blocks: list[tuple[list[int], list[int], list[int], list[int]]] = []
    current: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    truncated = 0

    def close() -> None:
        ids, labels, positions, owners = current
        pad = seq_len - len(ids)
        # The padding is a sequence of its own (positions from 0) without targets.
        ids.extend([pad_id] * pad)
        labels.extend([IGNORE_INDEX] * pad)
        positions.extend(range(pad))
        owners.extend([owners[-1] if owners else 0] * pad)
        blocks.append(current)

    for index, example in enumerate(examples):
        if max_blocks is not None and len(blocks) >= max_blocks:
            break
        ids, labels = example.ids[:seq_len], example.labels[:seq_len]
        truncated += len(example.ids) > seq_len
        if not any(label != IGNORE_INDEX for label in labels):
            continue  # nothing to learn from (a completion cut off entirely)
        if len(current[0]) + len(ids) > seq_len:
            close()
            current = ([], [], [], [])
        current[0].extend(ids)
        current[1].extend(labels)
        current[2].extend(range(len(ids)))
        current[3].extend([index] * len(ids))
    if current[0] and (max_blocks is None or len(blocks) < max_blocks):
        close()
    if not blocks:
        empty = torch.empty(0, seq_len, dtype=torch.long)
        return PackedExamples(empty, empty, empty, empty, truncated)
    columns = [torch.tensor([block[i] for block in blocks], dtype=torch.long) for i in range(4)]
    return PackedExamples(*columns, truncated=truncated)


class InstructionDataset(PackedDataset):
    """Packed instruction blocks: ``input_ids``, ``labels`` (completion only) and ``position_ids``
    restarting at every example."""

    def __init__(self, packed: PackedExamples) -> None:
        super().__init__(packed.input_ids)
        self.packed = packed

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.packed.block(index)


class InstructionValidation(ValidationDataset):
    """Validation blocks of whole examples; the loss over completion tokens, its standard error
    over examples (``maxscore.training.validation_set``, an example is a document)."""

    def __init__(self, packed: PackedExamples) -> None:
        owners = packed.examples
        # Example indices renumbered 0..D-1 in the order they appear.
        _, renumbered = torch.unique(owners, return_inverse=True)
        super().__init__(
            packed.input_ids, renumbered, int(renumbered.max()) + 1 if len(packed) else 0
        )
        self.packed = packed

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {**self.packed.block(index), DOCUMENT_KEY: self.documents[index]}


def encode_records(
    records: Sequence[dict[str, Any]],
    data_format: str,
    tokenizer: Any,
    completion_only: bool,
    where: str,
) -> list[Example]:
    """Every record encoded; a record of another format is refused naming where it is."""
    needed = RECORD_FORMATS[data_format].fields
    examples = []
    for number, record in enumerate(records, 1):
        missing = [field for field in needed if field not in record]
        if missing:
            raise ConfigError(
                f"{where}: record {number} has no {missing} field(s) of a {data_format} record "
                f"(fields: {sorted(record)})"
            )
        examples.append(encode_example(record, data_format, tokenizer, completion_only))
    return examples


def split_records(
    records: list[dict[str, Any]], fraction: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Seeded shuffle, then ``fraction`` of the records (at least one) held out."""
    records = list(records)
    random.Random(seed).shuffle(records)
    n_val = max(1, round(fraction * len(records))) if len(records) > 1 else 0
    return records[n_val:], records[:n_val]
