"""The tasks bench/convergence.py trains: two it was tuned on, and two held back to test that its choices generalise.

Tuned on: the digits MLP and a character-level transformer language model on
the English of Python's own reference manual (``pydoc_data.topics``, part of
CPython: about 465,000 characters of the language reference that ``help()``
shows). Held back (no setting was chosen on them): a small
convolutional network with batch norm on the same 8x8 digits as images, and a
word-level transformer language model over a 2,048-token vocabulary of Python
source: the standard library's top-level modules, split into identifiers,
numbers and single punctuation characters (a different text, tokenisation,
vocabulary and model size: about 1.1M parameters, half of them the embedding
and the output layer). Everything ships with what gradq already installs, so
nothing is downloaded. The last tenth of each text is held out; batches are
drawn by a generator seeded by (seed, rank, step), so every method sees the
same data in the same order.
"""

from __future__ import annotations

import collections
import glob
import math
import re
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["Task", "TASKS", "CharTransformer", "DigitsConvNet"]

VOCABULARY = 128  # ASCII; anything else becomes '?'
CONTEXT = 48  # characters per sequence
HELD_OUT_SHARE = 0.1
WORD_VOCABULARY = 2048  # the most frequent tokens of the source; the rest share one "unknown" token
WORD_CONTEXT = 32  # tokens per sequence
SOURCE_CHARACTERS = 1_500_000  # of the standard library's top-level modules, in file-name order
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|\n|[^\sA-Za-z0-9_]")


@dataclass(frozen=True, slots=True)
class Task:
    """What one task trains and how it is scored."""

    key: str
    label: str
    batch_size: int  # per rank
    learning_rates: dict[str, float]  # optimizer key -> learning rate
    data: str  # "digits", "images" (the digits as 1x8x8), "text" (characters) or "source" (word tokens)
    tuned: bool = True  # False: held back, no setting of gradq was chosen on it

    def build_model(self) -> nn.Module:
        """A fresh model; call after seeding torch so every method starts from the same weights."""
        if self.data == "digits":
            return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        if self.data == "images":
            return DigitsConvNet()
        if self.data == "source":
            return CharTransformer(WORD_VOCABULARY, WORD_CONTEXT, width=128, layers=3)
        return CharTransformer()

    def batch(self, rank: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's training batch of ``step``: (inputs, targets)."""
        generator = np.random.default_rng([seed, rank, step])
        if self.data in ("digits", "images"):
            x_train, y_train, _, _ = _digits(seed)
            picked = generator.integers(0, len(y_train), self.batch_size)
            return self._features(x_train[picked]), torch.from_numpy(y_train[picked])
        train, _, context = self._sequences()
        starts = generator.integers(0, len(train) - context - 1, self.batch_size)
        return _windows(train, starts, context)

    def held_out(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed held-out set: every digits test image, or 256 sequences of held-out text."""
        if self.data in ("digits", "images"):
            _, _, x_test, y_test = _digits(seed)
            return self._features(x_test), torch.from_numpy(y_test)
        _, held_out, context = self._sequences()
        starts = np.linspace(0, len(held_out) - context - 1, 256).astype(np.int64)
        return _windows(held_out, starts, context)

    def _features(self, rows: np.ndarray) -> torch.Tensor:
        features = torch.from_numpy(rows)
        return features.reshape(-1, 1, 8, 8) if self.data == "images" else features

    def _sequences(self) -> tuple[np.ndarray, np.ndarray, int]:
        if self.data == "source":
            return (*_source(), WORD_CONTEXT)
        return (*_text(), CONTEXT)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (per character for the language model, in nats)."""
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]).float(), targets.reshape(-1))

    def accuracy(self, output: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Percent correct for digits; None for the language models (their loss is the score)."""
        if self.data not in ("digits", "images"):
            return None
        return 100.0 * float((output.argmax(dim=-1) == targets).float().mean())


class DigitsConvNet(nn.Module):
    """Two 3x3 convolutions with batch norm, a pooling and a linear head over 1x8x8 digits (about 12,000 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits of ``images`` (batch, 1, 8, 8)."""
        return self.head(self.features(images).flatten(1))


class CharTransformer(nn.Module):
    """A small pre-norm causal transformer language model (by default over ASCII characters: 230,000 parameters)."""

    def __init__(
        self, vocabulary: int = VOCABULARY, context: int = CONTEXT, width: int = 96, layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-character logits for every position of ``tokens`` (batch, length <= CONTEXT)."""
        length = tokens.shape[1]
        hidden = self.embed(tokens) * math.sqrt(self.embed.embedding_dim) + self.position[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def _windows(text: np.ndarray, starts: np.ndarray, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([text[start : start + context + 1] for start in starts]).astype(np.int64)
    return torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])


_DIGITS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
_TEXT: list[tuple[np.ndarray, np.ndarray]] = []
_SOURCE: list[tuple[np.ndarray, np.ndarray]] = []


def _digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if seed not in _DIGITS:
        from gradq.client.apps.training import load_digits_split  # here: the language tasks run without gradq

        _DIGITS[seed] = load_digits_split(seed)
    return _DIGITS[seed]


def _text() -> tuple[np.ndarray, np.ndarray]:
    if not _TEXT:
        from pydoc_data.topics import topics  # the reference manual's text, shipped with CPython

        corpus = "\n\n".join(topics[name] for name in sorted(topics))
        codes = np.frombuffer(corpus.encode("ascii", errors="replace"), np.uint8).copy()
        codes[codes >= VOCABULARY] = ord("?")
        cut = int(len(codes) * (1 - HELD_OUT_SHARE))
        _TEXT.append((codes[:cut], codes[cut:]))
    return _TEXT[0]


def _source() -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the standard library's source: the vocabulary is counted on the training part only."""
    if not _SOURCE:
        parts, size = [], 0
        for path in sorted(glob.glob(f"{sysconfig.get_paths()['stdlib']}/*.py")):
            with open(path, encoding="utf-8", errors="replace") as file:
                parts.append(file.read())
            size += len(parts[-1])
            if size >= SOURCE_CHARACTERS:
                break
        words = _WORD.findall("\n".join(parts)[:SOURCE_CHARACTERS])
        cut = int(len(words) * (1 - HELD_OUT_SHARE))
        common = [word for word, _ in collections.Counter(words[:cut]).most_common(WORD_VOCABULARY - 1)]
        ids = {word: index + 1 for index, word in enumerate(common)}  # 0: unknown
        codes = np.fromiter((ids.get(word, 0) for word in words), np.int16, len(words))
        _SOURCE.append((codes[:cut], codes[cut:]))
    return _SOURCE[0]


TASKS = {
    task.key: task
    for task in (
        Task("digits", "digits MLP", 32, {"sgd": 0.05, "adamw": 1e-3}, "digits"),
        Task("transformer", "char transformer LM", 16, {"sgd": 0.1, "adamw": 2e-3}, "text"),
        Task("digits-cnn", "digits conv net (held back)", 32, {"sgd": 0.05, "adamw": 2e-3}, "images", tuned=False),
        Task("source-lm", "Python-source word LM (held back)", 16, {"sgd": 0.1, "adamw": 1e-3}, "source", tuned=False),
    )
}
