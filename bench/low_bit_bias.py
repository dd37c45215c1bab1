"""Where low-bit + EF gradients pick up a bias: each leg of the path, measured on real gradients over many steps.

Run from the repository root with the virtualenv's interpreter::

    python bench/low_bit_bias.py                          # 2-bit + EF on the char transformer, 300 steps
    python bench/low_bit_bias.py --bits 1 --scheme per_channel_sign --task digits

Two ranks compute real gradients of a task of bench/convergence_tasks.py on
their own batches; the model follows the exact fp32 mean with AdamW (open
loop: every row sees the very same gradients). Each row sends them through the
path a round takes, in numpy with qcore's own kernels: each rank encodes its
gradient with client error feedback, the aggregator decodes and averages,
re-encodes the mean on the return grid, and the ranks decode it. Rows differ
in one stage each, so a stage's share of the error is the difference between
rows. For each row, over all steps:

- drift: ``||sum_t (delivered_t - mean_t)|| / ||sum_t mean_t||``, the error
  that survives averaging over time (a bias; EF keeps the push leg's bounded);
- signed: ``sum_i sum_t (delivered - mean)`` over ``sum_i |sum_t mean|``: the
  share of the accumulated update that moves every parameter the same way;
- noise: the mean per-step ``||delivered_t - mean_t|| / ||mean_t||``;
- AdamW: a shadow AdamW fed the delivered gradients from the same start ends
  this far from the one fed the exact mean, relative to how far that one moved
  (``||theta' - theta|| / ||theta - theta_0||``), and its parameter sum moves
  ``sum(theta' - theta)`` (a biased mean's symptom).

This is a benchmark, not a test: it prints a table (and writes it under
``bench/results/`` with --save).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

for _variable in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from convergence_tasks import TASKS, Task  # noqa: E402

from gradq.qcore import ErrorFeedback, QuantConfig, Rounding, Scheme, codec_for, decode, encode  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SEED = 0
WORLD = 2
WEIGHT_DECAY = 0.01


@dataclass(frozen=True, slots=True)
class Row:
    """One path: what the ranks push and what the aggregator sends back."""

    label: str
    push: bool  # ranks push on the low-bit grid with EF (else the exact gradient)
    back: str  # "fp32", "same" (the pushers' grid, nearest), "same-sr" (stochastic), "same-ef" (server EF), "8bit"


ROWS = (
    Row("push leg only (EF), mean back in fp32", push=True, back="fp32"),
    Row("return leg only: exact mean, back on the push grid", push=False, back="same"),
    Row("full path, mean back on the push grid, no server EF (the former default)", push=True, back="same"),
    Row("full path, mean back on the push grid + server EF (the default now)", push=True, back="same-ef"),
    Row("full path, mean back on the push grid, stochastic", push=True, back="same-sr"),
    Row("full path, mean back at 8 bits, nearest", push=True, back="8bit"),
)


class RowState:
    """One row's state: the ranks' and the server's residuals, and the sums the figures come from."""

    def __init__(self, row: Row, push: QuantConfig, size: int) -> None:
        self.row = row
        self.push = push
        own = codec_for(push.scheme).mean_config(push.bits, push.channel_size)
        self.back = {
            "same": own,
            "same-ef": own,
            "same-sr": QuantConfig(own.scheme, own.bits, own.channel_size, Rounding.STOCHASTIC),
            "8bit": QuantConfig(Scheme.PER_CHANNEL_AFFINE, 8, own.channel_size),
        }.get(row.back)
        self.ranks = [ErrorFeedback() for _ in range(WORLD)]
        self.server = ErrorFeedback()
        self.rng = np.random.default_rng(SEED)
        self.error_sum = np.zeros(size)
        self.noise: list[float] = []
        self.adam = ShadowAdamW(size)

    def deliver(self, grads: Sequence[np.ndarray]) -> np.ndarray:
        """The mean the ranks decode after one round of ``grads``."""
        if self.row.push:
            sent = [decode(ef.encode(0, g, self.push, rng=self.rng)) for ef, g in zip(self.ranks, grads, strict=True)]
        else:
            sent = list(grads)
        mean = _mean(sent)
        if self.back is None:
            return mean
        if self.row.back == "same-ef":
            return decode(self.server.encode(0, mean, self.back))
        return decode(encode(mean, self.back, rng=self.rng))


class ShadowAdamW:
    """torch.optim.AdamW's update on a flat float64 vector (betas 0.9, 0.999; eps 1e-8)."""

    def __init__(self, size: int) -> None:
        self.m = np.zeros(size)
        self.v = np.zeros(size)
        self.t = 0

    def step(self, theta: np.ndarray, grad: np.ndarray, lr: float) -> None:
        self.t += 1
        theta *= 1 - lr * WEIGHT_DECAY
        self.m = 0.9 * self.m + 0.1 * grad
        self.v = 0.999 * self.v + 0.001 * grad * grad
        m_hat = self.m / (1 - 0.9**self.t)
        v_hat = self.v / (1 - 0.999**self.t)
        theta -= lr * m_hat / (np.sqrt(v_hat) + 1e-8)


def _mean(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return np.asarray(np.mean(arrays, axis=0, dtype=np.float32))


def _flat_grads(model: torch.nn.Module) -> np.ndarray:
    # DDP lays a bucket out in reverse parameter order; one bucket holds these small models.
    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None][::-1]
    return torch.cat(grads).numpy().astype(np.float32)


def measure(task: Task, push: QuantConfig, steps: int, rows: Sequence[Row]) -> list[dict[str, float]]:
    """Run ``steps`` rounds of real gradients through every row; the figures per row."""
    torch.manual_seed(SEED)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.learning_rates["adamw"], weight_decay=WEIGHT_DECAY)
    lr = task.learning_rates["adamw"]
    size = sum(p.numel() for p in model.parameters())
    paths = [RowState(row, push, size) for row in rows]
    exact = ShadowAdamW(size)
    start = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()][::-1]).astype(np.float64)
    theta_exact = start.copy()
    thetas = [start.copy() for _ in paths]
    mean_sum = np.zeros(size)
    for step in range(1, steps + 1):
        grads = []
        for rank in range(WORLD):
            model.zero_grad(set_to_none=True)
            inputs, targets = task.batch(rank, step, SEED)
            task.loss(model(inputs), targets).backward()
            grads.append(_flat_grads(model))
        mean = _mean(grads)
        mean_sum += mean
        exact.step(theta_exact, mean.astype(np.float64), lr)
        for path, theta in zip(paths, thetas, strict=True):
            delivered = path.deliver(grads)
            error = delivered.astype(np.float64) - mean
            path.error_sum += error
            path.noise.append(float(np.linalg.norm(error)) / max(float(np.linalg.norm(mean)), 1e-30))
            path.adam.step(theta, delivered.astype(np.float64), lr)
        # The model follows the exact mean, so every row sees the same gradients.
        with torch.no_grad():
            for p, g in zip(model.parameters(), _unflatten(model, mean), strict=True):
                p.grad = g
        optimizer.step()
    moved = np.linalg.norm(theta_exact - start)
    figures = []
    for path, theta in zip(paths, thetas, strict=True):
        figures.append(
            {
                "drift": float(np.linalg.norm(path.error_sum) / np.linalg.norm(mean_sum)),
                "signed": float(path.error_sum.sum() / np.abs(mean_sum).sum()),
                "noise": float(np.mean(path.noise)),
                "adamw_gap": float(np.linalg.norm(theta - theta_exact) / moved),
                "adamw_sum": float((theta - theta_exact).sum()),
            }
        )
    return figures


def _unflatten(model: torch.nn.Module, flat: np.ndarray) -> list[torch.Tensor]:
    params = list(model.parameters())
    pieces, offset = [], 0
    for p in params[::-1]:
        pieces.append(torch.from_numpy(flat[offset : offset + p.numel()].copy()).reshape(p.shape))
        offset += p.numel()
    return pieces[::-1]


def format_table(title: str, rows: Sequence[Row], figures: Sequence[dict[str, float]]) -> str:
    """A markdown table of the figures, one line per row."""
    lines = [
        f"### {title}",
        "",
        "| path | drift | signed | noise per step | AdamW gap | AdamW param-sum shift |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row, f in zip(rows, figures, strict=True):
        lines.append(
            f"| {row.label} | {f['drift']:.4f} | {f['signed']:+.4f} | {f['noise']:.3f} | "
            f"{f['adamw_gap']:.3f} | {f['adamw_sum']:+.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, rows: Sequence[Row] = ROWS, extra: Callable[[], str] | None = None) -> int:
    """Measure every row and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=list(TASKS), default="transformer")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--scheme", default="per_channel_affine")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    push = QuantConfig(Scheme.parse(args.scheme), args.bits)
    figures = measure(TASKS[args.task], push, args.steps, rows)
    title = (
        f"{TASKS[args.task].label}, world {WORLD}, {args.steps} steps, push {push.scheme.name.lower()} "
        f"{push.bits}-bit (channel {push.channel_size}) + EF"
    )
    table = format_table(title, rows, figures)
    print(table)
    if args.save is not None:
        args.save.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
