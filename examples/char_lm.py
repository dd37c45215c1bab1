"""The small task the examples train: a causal character transformer on CPython's reference manual.

Every process builds the same model from the same seed and draws its batches
from its own generator, so hosts train on different data of one corpus.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["BATCH", "CONTEXT", "VOCABULARY", "CharTransformer", "text", "windows"]

VOCABULARY = 128  # ASCII; anything else becomes '?'
CONTEXT = 48  # characters per sequence
BATCH = 8  # sequences per rank and micro-batch


class CharTransformer(nn.Module):
    """A pre-norm causal transformer language model over ASCII characters."""

    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4, recompute: bool = False) -> None:
        super().__init__()
        self.recompute = recompute  # activation checkpointing: blocks recompute their activations in backward
        self.embed = nn.Embedding(VOCABULARY, width)
        self.position = nn.Parameter(torch.randn(CONTEXT, width) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-character logits for every position of ``tokens`` (batch, CONTEXT)."""
        hidden = self.embed(tokens) * math.sqrt(self.embed.embedding_dim) + self.position
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for block in self.blocks:
            if self.recompute:
                hidden = checkpoint(block, hidden, src_mask=mask, is_causal=True, use_reentrant=False)
            else:
                hidden = block(hidden, src_mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def text() -> tuple[np.ndarray, np.ndarray]:
    """CPython's reference manual as ASCII codes: (training part, held-out tenth)."""
    from pydoc_data.topics import topics

    codes = np.frombuffer("\n\n".join(topics[name] for name in sorted(topics)).encode("ascii", "replace"), np.uint8)
    cut = int(len(codes) * 0.9)
    return codes[:cut], codes[cut:]


def windows(codes: np.ndarray, generator: np.random.Generator, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` random windows of ``codes``: (inputs, next characters)."""
    starts = generator.integers(0, len(codes) - CONTEXT - 1, count)
    rows = torch.from_numpy(np.stack([codes[start : start + CONTEXT + 1] for start in starts]).astype(np.int64))
    return rows[:, :-1], rows[:, 1:]
