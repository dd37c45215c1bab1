"""FSDP2 with gradq across hosts: 2 emulated hosts x 2 ranks under real torchrun (c10d rendezvous), a real aggregator.

Each host is one ``torchrun --nnodes 2 --nproc_per_node 2`` of examples/fsdp_train.py,
a small transformer sharded per block over the host's ranks; the two meet at
one rendezvous on loopback. Native HSDP (the 2-D mesh, gloo all-reduce across
hosts) trains the same model on the same batches for comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from aggregator_metrics import received_bytes

from gradq.client.apps.demo import free_port
from gradq.client.torch_support import torch_release
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "fsdp_train.py"
REFUSALS = Path(__file__).with_name("fsdp_refusals.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
HOSTS, LOCAL = 2, 2
STEPS = 6
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def aggregator() -> Iterator[AggregatorServer]:
    # The clients' error feedback is what a checkpoint carries; the aggregator's own would restart from zero.
    policy = RoundPolicy(round_timeout_s=60.0, server_error_feedback=False)
    server = AggregatorServer(policy, ServerOptions("127.0.0.1:0", metrics_port=0))
    server.start()
    yield server
    server.stop()


@dataclass
class Rank:
    figures: dict[str, Any]
    shards: dict[str, torch.Tensor]


def train(
    aggregator: AggregatorServer, out: Path, job_id: str, *args: str, bits: int = 8, ef: bool = True
) -> list[Rank]:
    """Both hosts' torchruns of the example; returns every rank's report in global rank order."""
    env = {
        **os.environ,
        "GRADQ_AGGREGATORS": f"127.0.0.1:{aggregator.port}",
        "GRADQ_JOB_ID": job_id,
        "GRADQ_BITS": str(bits),
        "GRADQ_ERROR_FEEDBACK": "1" if ef else "0",
        "OMP_NUM_THREADS": "1",
    }
    rendezvous = f"127.0.0.1:{free_port()}"
    launch = [str(TORCHRUN), "--nnodes", str(HOSTS), "--nproc_per_node", str(LOCAL), "--rdzv-backend", "c10d"]
    command = [*launch, "--rdzv-endpoint", rendezvous, str(EXAMPLE), "--hosts", str(HOSTS), "--report", str(out), *args]
    logs = [out.parent / f"{out.name}-host{host}.log" for host in range(HOSTS)]
    hosts = [
        subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO) for log in logs
    ]
    codes = [host.wait(timeout=RUN_TIMEOUT_S) for host in hosts]
    assert codes == [0] * HOSTS, "\n".join(log.read_text()[-3000:] for log in logs)
    return [
        Rank(json.loads((out / f"rank{rank}.json").read_text()), torch.load(out / f"rank{rank}.pt"))
        for rank in range(HOSTS * LOCAL)
    ]


def assert_hosts_identical(ranks: list[Rank]) -> None:
    """The same local rank holds bit-identical shards on every host."""
    for local in range(LOCAL):
        first = ranks[local].shards
        for host in range(1, HOSTS):
            other = ranks[host * LOCAL + local].shards
            for name, values in first.items():
                assert torch.equal(values, other[name]), f"{name}: host {host} differs from host 0 (local rank {local})"


def test_hosts_hold_identical_shards_track_native_hsdp_and_push_one_model_copy_per_step(
    aggregator: AggregatorServer, tmp_path: Path
) -> None:
    # Two micro-batches per step: FSDP reduces only on the one that syncs, so the bytes count steps, not backwards.
    gradq = train(aggregator, tmp_path / "gradq", "fsdp-8bit", "--steps", str(STEPS), "--micro-batches", "2")
    native = train(aggregator, tmp_path / "native", "unused", "--steps", str(STEPS), "--micro-batches", "2", "--native")

    assert [(rank.figures["host"], rank.figures["local_rank"]) for rank in gradq] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {rank.figures["mode"] for rank in gradq} == {"gradq"}
    assert_hosts_identical(gradq)
    assert_hosts_identical(native)  # the reference itself is consistent
    # 8 bits per element: each step's loss and the held-out loss stay within 1% of native HSDP's.
    for mine, reference in zip(gradq[0].figures["losses"], native[0].figures["losses"], strict=True):
        assert abs(mine - reference) <= 0.01 * reference
    assert (
        abs(gradq[0].figures["held_out_loss"] - native[0].figures["held_out_loss"])
        <= 0.01 * native[0].figures["held_out_loss"]
    )
    # Not a no-op: the trained shards moved away from the initial weights, as native HSDP's did.
    assert gradq[0].figures["losses"][-1] < gradq[0].figures["losses"][0] - 0.1

    # A host's ranks push one copy of the model between them: the shards of each unit add up to it (FSDP pads
    # each parameter's first dimension to a multiple of the ranks, no more).
    parameters = sum(values.numel() for rank in gradq[:LOCAL] for values in rank.shards.values())
    per_host = sum(sum(rank.figures["shard_elements"]) for rank in gradq[:LOCAL])
    assert parameters <= per_host <= parameters * 1.02
    # What the aggregator received: every host's copy once per step at 8 bits, plus per-channel scales.
    predicted = HOSTS * STEPS * per_host * 8 / 8
    got = received_bytes(aggregator, "fsdp-8bit")
    assert predicted <= got <= predicted * 1.1, (got, predicted)
    assert sum(rank.figures["bytes_sent"] for rank in gradq) >= got  # what the ranks sent includes the framing
    # fp32 shards become the gradients themselves: their means land while backward computes the units before.
    for rank in gradq:
        assert rank.figures["waited_s"] < rank.figures["traveled_s"]


def test_bf16_reductions_and_activation_checkpointing_track_native_hsdp(
    aggregator: AggregatorServer, tmp_path: Path
) -> None:
    # The shard arrives in bf16 and FSDP casts it to the parameters' fp32 right after the hook: the hook waits.
    common = ("--steps", str(STEPS), "--reduce-dtype", "bfloat16", "--activation-checkpointing")
    gradq = train(aggregator, tmp_path / "gradq", "fsdp-bf16", *common)
    native = train(aggregator, tmp_path / "native", "unused", *common, "--native")

    assert_hosts_identical(gradq)
    for mine, reference in zip(gradq[0].figures["losses"], native[0].figures["losses"], strict=True):
        assert abs(mine - reference) <= 0.01 * reference
    assert gradq[0].figures["waited_s"] == pytest.approx(gradq[0].figures["traveled_s"], rel=0.5)


def test_checkpoint_resumes_exactly_error_feedback_included(aggregator: AggregatorServer, tmp_path: Path) -> None:
    common = ("--steps", str(STEPS), "--micro-batches", "2")
    whole = train(aggregator, tmp_path / "whole", "fsdp-whole", *common, bits=4)
    checkpoint = tmp_path / "checkpoint"
    train(
        aggregator,
        tmp_path / "first",
        "fsdp-resumed",
        *common,
        "--checkpoint",
        str(checkpoint),
        "--save-at",
        "3",
        bits=4,
    )
    resumed = train(
        aggregator, tmp_path / "second", "fsdp-resumed", *common, "--checkpoint", str(checkpoint), "--resume", bits=4
    )

    # Every rank's own residuals are in the checkpoint, under names no other rank uses.
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    residuals = sorted(name for name in saved if name.startswith("gradq.residual/"))
    units = len(whole[0].figures["shard_elements"])
    assert len(residuals) == HOSTS * LOCAL * units
    assert_hosts_identical(resumed)
    for rank, (uninterrupted, again) in enumerate(zip(whole, resumed, strict=True)):
        assert again.figures["losses"] == uninterrupted.figures["losses"][3:], f"rank {rank}"
        for name, values in uninterrupted.shards.items():
            assert torch.equal(values, again.shards[name]), f"rank {rank}: {name} differs after the resume"


def test_use_gradq_refuses_what_it_cannot_serve_by_name(aggregator: AggregatorServer) -> None:
    run = subprocess.run(
        [sys.executable, str(REFUSALS), f"127.0.0.1:{aggregator.port}", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["not sharded"].startswith("TypeError: model is Linear, not sharded with FSDP2")
    assert found["2-D mesh"].startswith("ValueError: FSDP unit '<root>' is sharded over a 2-D mesh (native HSDP")
    if torch_release(torch.__version__) >= (2, 12):  # per-parameter meshes, and so several groups per unit
        assert found["parameter groups"].startswith("ValueError: FSDP unit '<root>' holds 2 parameter groups")
    else:
        assert found["parameter groups"] == f"not possible on torch {torch.__version__}"
    assert found["not a config"].startswith("TypeError: config is dict; expected a GradqConfig")
    assert found["adaptive"].startswith("ValueError: bit_policy='adaptive' is not served under FSDP yet")
    assert found["trained"] == "[1]"  # the refusals left the model free to connect and train
    assert found["twice"].startswith("RuntimeError: use_gradq was already called on this model")
