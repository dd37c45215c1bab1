"""DiLoCo hosts of a job whose outer step runs on the aggregator, as the outer-state tests make them."""

from __future__ import annotations

from collections.abc import Callable

from gradq.client import JobSpec, WorkerClient
from gradq.client.elastic import ANY_RANK
from gradq.qcore import QuantConfig, Scheme
from gradq.qcore.outer_step import OuterStep

EXACT = QuantConfig(scheme=Scheme.FLOAT32)  # the mean is the pushes' exact average: the arithmetic is checkable
STEP = OuterStep(lr=0.7, momentum=0.9, nesterov=True)
Host = Callable[..., WorkerClient]


def joiner_of(port: int, clients: list[WorkerClient], timeout_s: float = 20.0) -> Host:
    """Joins elastic hosts of a DiLoCo job on the aggregator at ``port``; each is added to ``clients``."""

    def join(outer_step: OuterStep | None = STEP, job: str = "d", hosts: int = 2) -> WorkerClient:
        client = WorkerClient(
            f"127.0.0.1:{port}",
            job,
            ANY_RANK,
            JobSpec(world_size=hosts, elastic=True, outer_step=outer_step),
            EXACT,
            timeout_s=timeout_s,
        )
        clients.append(client)
        client.join()
        return client

    return join
