"""Data for the BERT benchmark: a generated, learnable sentence-classification set, GLUE-style TSV I/O,
and a word-level tokenizer (no download).

The generated task ("synthetic sentiment"): every sentence is filler words drawn from a
Zipf-like distribution over a large vocabulary (like real text: a few frequent words, a long
tail of rare ones), with a handful of *polar* words mixed in. The label is the polarity that
occurs more often (1 = positive); a small fraction of labels is flipped as noise, so the best
reachable accuracy is about ``1 - label_noise``. A model has to find the polar words among the
fillers and compare their counts: trivial for a lookup table that knows the lexicon, not for a
randomly initialised BERT that starts at chance (0.5). The split is balanced.

Everything is a pure function of ``seed``: the same files on every machine and every run.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "SPECIAL_TOKENS",
    "SyntheticSpec",
    "Example",
    "make_vocabulary",
    "generate_split",
    "write_tsv",
    "read_tsv",
    "WordTokenizer",
    "words_of",
]

# [PAD] first so that id 0 is BERT's pad_token_id.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of the generated task."""

    vocab_words: int = 8000  # distinct words (the tokenizer adds SPECIAL_TOKENS)
    polar_words: int = 40  # per polarity
    min_words: int = 8
    max_words: int = 24
    label_noise: float = 0.02


@dataclass
class Example:
    sentence: str
    label: int


def _syllable_word(index: int) -> str:
    """A pronounceable, unique pseudo-word for every index (base-70 syllables)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    out = []
    index += len(syllables)  # every word has at least two syllables
    while True:
        index, rest = divmod(index, len(syllables))
        out.append(syllables[rest])
        if index == 0:
            break
    return "".join(reversed(out))


def make_vocabulary(spec: SyntheticSpec) -> Tuple[List[str], List[str], List[str]]:
    """``(fillers, positive, negative)`` word lists; together ``spec.vocab_words`` distinct words."""
    if spec.vocab_words < 2 * spec.polar_words + 10:
        raise ValueError(f"vocab_words={spec.vocab_words} is too small for {spec.polar_words} polar words per class")
    words = [_syllable_word(i) for i in range(spec.vocab_words)]
    positive = words[: spec.polar_words]
    negative = words[spec.polar_words : 2 * spec.polar_words]
    fillers = words[2 * spec.polar_words :]
    return fillers, positive, negative


def generate_split(spec: SyntheticSpec, size: int, seed: int) -> List[Example]:
    """``size`` examples, balanced labels, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    fillers, positive, negative = make_vocabulary(spec)
    ranks = np.arange(len(fillers), dtype=np.float64)
    zipf = 1.0 / (ranks + 5.0)
    zipf /= zipf.sum()
    examples = []
    for i in range(size):
        label = i % 2  # balanced; order shuffled below
        length = int(rng.integers(spec.min_words, spec.max_words + 1))
        majority = int(rng.integers(1, 4))
        minority = int(rng.integers(0, majority))
        polar = [(label, majority), (1 - label, minority)]
        words = list(rng.choice(len(fillers), size=max(length - majority - minority, 1), p=zipf))
        tokens = [fillers[w] for w in words]
        for polarity, count in polar:
            lexicon = positive if polarity == 1 else negative
            for _ in range(count):
                tokens.insert(int(rng.integers(0, len(tokens) + 1)), lexicon[int(rng.integers(len(lexicon)))])
        if rng.random() < spec.label_noise:
            label = 1 - label
        examples.append(Example(" ".join(tokens), label))
    order = rng.permutation(size)
    return [examples[i] for i in order]


# ---------------------------------------------------------------------------------------- TSV
def write_tsv(path: str, examples: Sequence[Example]) -> None:
    """GLUE-style ``sentence<TAB>label`` with a header line (the layout of SST-2's train.tsv)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as handle:
        handle.write("sentence\tlabel\n")
        for example in examples:
            handle.write(f"{example.sentence}\t{example.label}\n")


def read_tsv(path: str) -> List[Example]:
    """Read a GLUE-style single-sentence TSV (SST-2, CoLA with header): columns ``sentence`` and ``label``.

    A header naming ``sentence`` and ``label`` is used when present; without one, the text is the
    first column and the label the last. Labels must be integers (0, 1, ...).
    """
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    rows = [r for r in rows if r and any(cell.strip() for cell in r)]
    if not rows:
        raise ValueError(f"{path} has no rows")
    header = [cell.strip().lower() for cell in rows[0]]
    text_col, label_col = 0, -1
    if "sentence" in header and "label" in header:
        text_col, label_col = header.index("sentence"), header.index("label")
        rows = rows[1:]
    examples = []
    for number, row in enumerate(rows, start=2 if header else 1):
        try:
            examples.append(Example(row[text_col], int(row[label_col])))
        except (IndexError, ValueError):
            raise ValueError(
                f"{path}, line {number}: expected a sentence and an integer label separated by a tab, got {row!r}"
            ) from None
    return examples


# ---------------------------------------------------------------------------------------- tokenizer
_WORD = re.compile(r"\w+|[^\w\s]")


def words_of(sentence: str) -> List[str]:
    """Lower-cased words and punctuation marks (the tokenization of both front ends without --model)."""
    return _WORD.findall(sentence.lower())


class WordTokenizer:
    """Word-level tokenizer: ``[CLS] w1 w2 ... [SEP]``, padded to ``max_length`` with [PAD] (id 0)."""

    def __init__(self, words: Sequence[str]):
        self.itos = list(SPECIAL_TOKENS) + [w for w in words if w not in SPECIAL_TOKENS]
        self.stoi: Dict[str, int] = {w: i for i, w in enumerate(self.itos)}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id = (self.stoi[t] for t in SPECIAL_TOKENS)

    def __len__(self) -> int:
        return len(self.itos)

    @classmethod
    def from_examples(cls, examples: Sequence[Example], max_words: Optional[int] = None) -> "WordTokenizer":
        """The ``max_words`` most frequent words of ``examples`` (ties broken alphabetically)."""
        counts: Dict[str, int] = {}
        for example in examples:
            for word in words_of(example.sentence):
                counts[word] = counts.get(word, 0) + 1
        ordered = sorted(counts, key=lambda w: (-counts[w], w))
        return cls(ordered[:max_words] if max_words else ordered)

    def encode(self, sentence: str, max_length: int) -> Tuple[List[int], List[int]]:
        """``(input_ids, attention_mask)`` of length ``max_length`` (truncated, then padded)."""
        ids = [self.stoi.get(w, self.unk_id) for w in words_of(sentence)][: max_length - 2]
        ids = [self.cls_id] + ids + [self.sep_id]
        mask = [1] * len(ids)
        pad = max_length - len(ids)
        return ids + [self.pad_id] * pad, mask + [0] * pad
