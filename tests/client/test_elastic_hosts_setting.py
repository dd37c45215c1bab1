"""Hosts that disagree on GRADQ_ELASTIC_HOSTS are told that setting, not only the world_size it becomes."""

from __future__ import annotations

import re

import pytest
from test_apps_cli import gradq, gradq_process
from waiting import wait_until

from gradq.client import AggregationError, JobSpec, WorkerClient
from gradq.client.elastic import ANY_RANK
from gradq.server.app import AggregatorServer

# What the refusal says, after the job's name: the setting each host set, and the job's.
MISMATCH = (
    r"world_size=3 \(the host's elastic_hosts, GRADQ_ELASTIC_HOSTS\) does not match elastic job 'hosts-apart' "
    r"\((no incarnation|incarnation='.*')\), which starts with 2 hosts \(elastic_hosts=2\); every host of an "
    "elastic job must set the same"
)


def test_a_host_joining_with_other_elastic_hosts_is_refused_naming_the_setting(aggregator: AggregatorServer) -> None:
    address = f"127.0.0.1:{aggregator.port}"
    with WorkerClient(address, "hosts-apart", ANY_RANK, JobSpec(world_size=2, elastic=True), timeout_s=10.0):
        other = WorkerClient(address, "hosts-apart", ANY_RANK, JobSpec(world_size=3, elastic=True), timeout_s=10.0)
        try:
            with pytest.raises(AggregationError, match=MISMATCH) as raised:
                other.join()
        finally:
            other.close()
    assert raised.value.code is not None and raised.value.code.name == "FAILED_PRECONDITION"


def test_a_fixed_job_s_world_size_mismatch_still_names_world_size(aggregator: AggregatorServer) -> None:
    address = f"127.0.0.1:{aggregator.port}"
    with WorkerClient(address, "fixed", 0, 2, timeout_s=10.0):
        other = WorkerClient(address, "fixed", 1, 3, timeout_s=10.0)
        try:
            with pytest.raises(AggregationError, match=r"world_size=3 does not match job 'fixed' .*world_size=2$"):
                other.join()
        finally:
            other.close()


@pytest.mark.e2e
def test_two_gradq_worker_hosts_with_different_elastic_hosts(aggregator: AggregatorServer) -> None:
    environment = {"GRADQ_AGGREGATORS": f"127.0.0.1:{aggregator.port}", "GRADQ_JOB_ID": "hosts-apart"}
    first = gradq_process("worker", "--min-accuracy", "0", env={**environment, "GRADQ_ELASTIC_HOSTS": "2"})
    try:

        def joined() -> bool:
            with aggregator.table.jobs.lock:
                job = aggregator.table.jobs.current("hosts-apart")
                return job is not None and bool(job.joined)

        wait_until(
            joined,
            "the first host (GRADQ_ELASTIC_HOSTS=2) joined its job",
            timeout_s=180,
            alive=lambda: first.poll() is None,
        )
        second = gradq("worker", "--min-accuracy", "0", env={**environment, "GRADQ_ELASTIC_HOSTS": "3"}, timeout=240)
    finally:
        first.kill()
        first.communicate()
    assert second.returncode == 1, second.stdout + second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("gradq worker: error:")]
    assert len(errors) == 1, second.stderr
    assert re.search(MISMATCH, errors[0]), errors[0]
