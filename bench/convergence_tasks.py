"""The two tasks bench/convergence.py trains: the digits MLP and a character-level transformer language model.

Both datasets ship with what gradq already installs, so nothing is downloaded:
scikit-learn's 8x8 digits, and for text the English of Python's own reference
manual (``pydoc_data.topics``, part of CPython: about 465,000 characters of the
language reference that ``help()`` shows). The last tenth of the text is held
out; batches are drawn by a generator seeded by (seed, rank, step), so every
method sees the same data in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gradq.client.apps.training import load_digits_split

__all__ = ["Task", "TASKS", "CharTransformer"]

VOCABULARY = 128  # ASCII; anything else becomes '?'
CONTEXT = 48  # characters per sequence
HELD_OUT_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class Task:
    """What one task trains and how it is scored."""

    key: str
    label: str
    batch_size: int  # per rank
    learning_rates: dict[str, float]  # optimizer key -> learning rate

    def build_model(self) -> nn.Module:
        """A fresh model; call after seeding torch so every method starts from the same weights."""
        if self.key == "digits":
            return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        return CharTransformer()

    def batch(self, rank: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's training batch of ``step``: (inputs, targets)."""
        generator = np.random.default_rng([seed, rank, step])
        if self.key == "digits":
            x_train, y_train, _, _ = _digits(seed)
            picked = generator.integers(0, len(y_train), self.batch_size)
            return torch.from_numpy(x_train[picked]), torch.from_numpy(y_train[picked])
        train, _ = _text()
        starts = generator.integers(0, len(train) - CONTEXT - 1, self.batch_size)
        return _windows(train, starts)

    def held_out(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed held-out set: every digits test image, or 256 sequences of held-out text."""
        if self.key == "digits":
            _, _, x_test, y_test = _digits(seed)
            return torch.from_numpy(x_test), torch.from_numpy(y_test)
        _, held_out = _text()
        starts = np.linspace(0, len(held_out) - CONTEXT - 1, 256).astype(np.int64)
        return _windows(held_out, starts)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (per character for the language model, in nats)."""
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]).float(), targets.reshape(-1))

    def accuracy(self, output: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Percent correct for digits; None for the language model (its loss is the score)."""
        if self.key != "digits":
            return None
        return 100.0 * float((output.argmax(dim=-1) == targets).float().mean())


class CharTransformer(nn.Module):
    """A small pre-norm causal transformer over ASCII characters (about 230,000 parameters)."""

    def __init__(self, width: int = 96, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, width)
        self.position = nn.Parameter(torch.randn(CONTEXT, width) * 0.02)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-character logits for every position of ``tokens`` (batch, length <= CONTEXT)."""
        length = tokens.shape[1]
        hidden = self.embed(tokens) * math.sqrt(self.embed.embedding_dim) + self.position[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def _windows(text: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([text[start : start + CONTEXT + 1] for start in starts]).astype(np.int64)
    return torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])


_DIGITS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
_TEXT: list[tuple[np.ndarray, np.ndarray]] = []


def _digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if seed not in _DIGITS:
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


TASKS = {
    task.key: task
    for task in (
        Task("digits", "digits MLP", batch_size=32, learning_rates={"sgd": 0.05, "adamw": 1e-3}),
        Task("transformer", "char transformer LM", batch_size=16, learning_rates={"sgd": 0.1, "adamw": 2e-3}),
    )
}
