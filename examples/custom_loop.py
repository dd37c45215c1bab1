"""A training loop of its own (as torchtitan writes one), elastic through the gradq session alone.

    gradq serve --port 50051 &
    GRADQ_AGGREGATORS=HOST:50051 GRADQ_JOB_ID=custom GRADQ_ELASTIC_HOSTS=2 python examples/custom_loop.py

No DDP, no comm hook, no DiLoCo: the loop lays its gradients end to end,
averages them through ``GradqSession.reduce`` once per step and steps its own
optimizer. Every lifecycle question goes to the session's member: a joiner
takes a live host's state (``member.receive``), a live host serves joiners at
a step boundary (``member.serve_joiners``), and a host the aggregator dropped
while it was silent joins again on the same terms (``member.rejoin``) and
takes the state at the step the others have reached. The gradq lines::

    session = GradqSession.connect(GradqConfig.from_env(), job=JobSpec(model_signature=model_signature(shared)))
    step = session.member.receive(shared, 0)
    while step < total:
        session.member.serve_joiners(shared, step)
        ...backward...
        mean = session.reduce(flat_gradient, step, 0, parameters=params).wait()
        session.end_step()
    # a dropped host: session = session.member.rejoin(error); step = session.member.receive(shared, step)

``--report FILE`` writes the host's result as JSON (steps trained, rejoins,
the parameters' digest), for tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from torch import nn

from gradq.client.config import GradqConfig
from gradq.client.sending import AggregationError
from gradq.client.session import GradqSession, JobSpec
from gradq.client.session.elastic import model_signature
from gradq.client.session.member import dropped_from_job


def main() -> None:
    """Parse the flags, train this host to ``--steps``, print (and report) its result."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="the job's steps: every host stops there")
    parser.add_argument("--data-seed", type=int, default=0, help="this host's data (the model's seed is shared)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to pause after each step")
    parser.add_argument("--report", type=Path, help="write the result as JSON to this file")
    args = parser.parse_args()

    torch.manual_seed(0)  # every host starts from the same model
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = [param for param in model.parameters() if param.requires_grad]
    shared = [model, optimizer]  # what a joiner receives from a live host
    target = torch.linspace(-1.0, 1.0, 8)

    session = GradqSession.connect(GradqConfig.from_env(), job=JobSpec(model_signature=model_signature(shared)))
    step = session.member.receive(shared, 0)  # a joiner trains from a live host's step, a starter from 0
    trained, loss = 0, torch.tensor(float("nan"))  # a joiner that arrives at the job's end trains no step
    while step < args.steps:
        session.member.serve_joiners(shared, step)  # the boundary a joiner enters at
        data = torch.Generator().manual_seed(args.data_seed * 1_000_003 + step)
        inputs = torch.randn(16, 8, generator=data)
        loss = nn.functional.mse_loss(model(inputs).squeeze(1), inputs @ target)
        optimizer.zero_grad()
        loss.backward()
        flat = torch.cat([param.grad.reshape(-1) for param in params])  # type: ignore[union-attr]
        try:
            mean = session.reduce(flat, step, 0, parameters=params).wait()
        except AggregationError as error:
            if not dropped_from_job(error):
                raise
            session = session.member.rejoin(error)  # a newcomer again: its steps of the missed round are dropped
            step = session.member.receive(shared, step)
            continue
        session.end_step()
        offset = 0
        for param in params:
            param.grad = mean[offset : offset + param.numel()].view_as(param).to(param.dtype)
            offset += param.numel()
        optimizer.step()
        step, trained = step + 1, trained + 1
        if args.step_sleep:
            time.sleep(args.step_sleep)  # a slower host, for demonstrations
    rejoins = session.member.rejoins
    session.close()
    digest = hashlib.sha256(b"".join(param.detach().numpy().tobytes() for param in params)).hexdigest()
    result = {"step": step, "trained": trained, "rejoins": rejoins, "digest": digest, "loss": loss.item()}
    print(json.dumps(result), flush=True)
    if args.report is not None:
        args.report.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
