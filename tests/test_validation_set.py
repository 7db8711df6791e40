"""Validation that can tell routers apart: every source, the model's own loss, a standard error
over documents, paired differences."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from maxscore.data import default_corpus_records, load_default_tokenizer
from maxscore.training.validation_set import (
    DOCUMENT_KEY,
    DocumentLosses,
    ValidationSummary,
    pack_validation,
    paired_difference,
    per_token_loss,
    ratio_standard_error,
)


@pytest.fixture(scope="module")
def split() -> tuple[list[str], list[str]]:
    records = default_corpus_records("validation")
    return [r["text"] for r in records], [r["source"] for r in records]


def sources_of(data, sources: list[str]) -> set[str]:  # type: ignore[no-untyped-def]
    return {sources[int(d)] for d in data.documents.unique()}


def test_default_is_the_whole_split_from_every_source(split: tuple[list[str], list[str]]) -> None:
    texts, sources = split
    tok = load_default_tokenizer()
    data = pack_validation(texts, tok, 512)
    assert data.num_tokens >= 150_000  # the whole split: 195k tokens, 381 blocks of 512
    assert sources_of(data, sources) == {"gutenberg", "sotu", "brown", "shakespeare", "bbc_news"}
    item = data[3]
    assert torch.equal(item["input_ids"], data.blocks[3]) and item[DOCUMENT_KEY].shape == (512,)
    # A limit keeps evenly spaced blocks: every source (the first 128 blocks hold only two).
    sampled = pack_validation(texts, tok, 512, max_blocks=64)
    assert len(sampled) == 64 and len(sources_of(sampled, sources)) == 5
    first = data.documents[:128]
    assert len({sources[int(d)] for d in first.unique()}) == 2


def test_ratio_standard_error_by_hand() -> None:
    sums, counts = [10.0, 30.0, 8.0, 0.0], [5.0, 10.0, 4.0, 0.0]  # an empty document is ignored
    mean, se = ratio_standard_error(sums, counts)
    assert mean == pytest.approx(48 / 19)
    s, t = np.array(sums[:3]), np.array(counts[:3])
    assert se == pytest.approx(math.sqrt(3 / 2 * ((s - mean * t) ** 2).sum()) / t.sum())
    assert math.isnan(ratio_standard_error([1.0], [2.0])[1])
    a = ValidationSummary.from_sums([10.0, 30.0, 8.0], [5.0, 10.0, 4.0]).to_dict()
    b = ValidationSummary.from_sums([9.0, 29.0, 7.5], [5.0, 10.0, 4.0]).to_dict()
    diff, diff_se = paired_difference(a, b)  # type: ignore[misc]
    assert diff == pytest.approx(2.5 / 19) and diff_se < a["se"]
    assert paired_difference(a, {**b, "tokens": [5.0, 10.0, 3.0]}) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 57), (20, 16)])  # one chunk; two (16 sequences each)
def test_per_token_loss_is_the_shifted_cross_entropy_to_the_bit(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    """Every position's fp32 cross-entropy of the next token, the last position left out: the
    same bits as the cross-entropy of the shifted logits (whole sequences are taken per chunk,
    so the logits are not copied to shift them)."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(*shape, 300, generator=generator) * 3).to(dtype)
    input_ids = torch.randint(0, 300, shape, generator=generator)
    shifted = logits[:, :-1].float()
    expected = torch.nn.functional.cross_entropy(
        shifted.reshape(-1, 300), input_ids[:, 1:].reshape(-1), reduction="none"
    ).view(shape[0], shape[1] - 1)
    assert torch.equal(per_token_loss(logits, input_ids), expected)


def test_document_losses_equal_the_models_own_loss(split: tuple[list[str], list[str]]) -> None:
    from maxscore.models import LlamaMoEForCausalLM
    from maxscore.models.presets import get_model_config

    texts, _ = split
    tok = load_default_tokenizer()
    data = pack_validation(texts[:6], tok, 32, max_blocks=8)
    torch.manual_seed(0)
    config = get_model_config(
        "tiny",
        router="gshard",
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_experts=4,
    )
    model = LlamaMoEForCausalLM(config).eval()
    losses = DocumentLosses()
    losses.reset(data.num_documents)
    batch = {"input_ids": data.blocks, "labels": data.blocks}
    mean = losses.add(model, batch, data.documents)
    with torch.no_grad():
        reference = model(input_ids=data.blocks, labels=data.blocks).loss
    torch.testing.assert_close(mean, reference, rtol=1e-5, atol=1e-5)
    sums, counts = losses.gather()
    assert sum(counts) == data.blocks.numel() - len(data)  # first token of each block
    summary = ValidationSummary.from_sums(sums, counts)
    assert summary.loss == pytest.approx(float(reference), rel=1e-5)
    assert summary.se > 0 and summary.documents <= data.num_documents


def test_eval_and_analysis_tables_show_the_loss_with_its_standard_error(tmp_path: Path) -> None:
    from maxscore.analysis.analyze import analyze
    from maxscore.evaluation.results import checkpoint_validation, markdown_table

    run = tmp_path / "gshard"
    (run / "checkpoint-4").mkdir(parents=True)
    records = [
        {"type": "train", "step": 2, "loss": 9.0},
        {"type": "eval", "step": 2, "eval_loss": 8.5, "eval_loss_se": 0.05, "eval_tokens": 60},
        {"type": "eval", "step": 4, "eval_loss": 8.25, "eval_loss_se": 0.04, "eval_tokens": 60},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    validation = checkpoint_validation(run, run / "checkpoint-4")
    assert validation == {"step": 4, "loss": 8.25, "se": 0.04, "tokens": 60}
    assert checkpoint_validation(None, run / "checkpoint-4") is None
    model = {"name": "gshard", "metrics": {"piqa": {"acc": 0.6}}, "validation": validation}
    table = markdown_table([model, {"name": "other", "metrics": {"piqa": {"acc": 0.5}}}])
    assert "Val loss ± SE |" in table and "| 8.2500 ± 0.0400 |" in table
    assert table.splitlines()[-1].endswith("| – |")
    result = analyze([run], tmp_path / "analysis")
    assert "| 8.2500 ± 0.0400 |" in result.markdown_path.read_text()
