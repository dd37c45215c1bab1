"""The HF Trainer with gradq: `torchrun --nproc_per_node 2 transformers_train.py STEPS OUT_DIR`.

A tiny BERT built from a config (no downloads), trained twice (a second
``train()`` reuses the DDP model) with gradient accumulation. Configured by
GRADQ_*; each rank writes what it saw to OUT_DIR/rank<N>.json.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

from gradq.client.integrations.transformers import GradqCallback


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sequences of 8 tokens; the label says whether token 7 occurs in it."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 32, (size, 8), generator=generator)
        self.labels = (self.ids == 7).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


class Losses(TrainerCallback):
    """Every logged training loss, in order."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main(steps: int, out_dir: Path) -> None:
    """Train ``steps`` optimizer steps twice; report losses, weights and what the hook state saw."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=2
    )
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=str(out_dir / "trainer"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    losses = Losses()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(1024), callbacks=[losses])
    gradq = GradqCallback(trainer)  # reads GRADQ_*
    trainer.add_callback(gradq)
    trainer.train()
    wrapped = trainer.model_wrapped
    trainer.train()  # again: the same DDP object, registered once
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    stats = gradq.state.stats()
    report = {
        "model": type(trainer.model_wrapped).__name__,
        "same_ddp": trainer.model_wrapped is wrapped,
        "mode": gradq.state.mode,
        "hook_steps": gradq.state.step,
        "pushes": stats.pushes if stats else 0,
        "losses": losses.losses,
        "weights": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
    }
    (out_dir / f"rank{trainer.args.process_index}.json").write_text(json.dumps(report))
    gradq.state.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
