"""The embedded corpus and tokenizer load offline and behave as documented."""

from __future__ import annotations

from maxscore.data import default_corpus_records, load_default_corpus, load_default_tokenizer


def test_corpus_splits_are_disjoint_and_nonempty() -> None:
    corpus = load_default_corpus()
    assert len(corpus["train"]) > 1000
    assert len(corpus["validation"]) > 50
    train_ids = {r["id"] for r in default_corpus_records("train")}
    val_ids = {r["id"] for r in default_corpus_records("validation")}
    assert train_ids.isdisjoint(val_ids)
    assert {r["source"] for r in default_corpus_records()} == {
        "gutenberg",
        "sotu",
        "brown",
        "shakespeare",
        "bbc_news",
    }
    assert all(r["text"].strip() for r in default_corpus_records("validation"))


def test_tokenizer_round_trip_and_special_tokens() -> None:
    tok = load_default_tokenizer()
    assert len(tok) == 32000
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    text = "Maximum Score Routing assigns tokens to experts. Ünïcödé 日本 🙂"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.unk_token_id not in ids  # byte fallback covers every character
    assert tok.decode(ids, skip_special_tokens=True) == text
    # Hand-checked pieces of the LLaMA-style vocabulary.
    assert tok.convert_ids_to_tokens(tok("Hello world").input_ids[1:]) == ["▁Hello", "▁world"]
