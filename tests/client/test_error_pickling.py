"""Typed client errors survive pickling, as Ray and multiprocessing carry them between processes."""

import pickle

import grpc

from gradq.client.contact import UnreachableError, resolution_failure
from gradq.client.membership import JobEndedError
from gradq.client.sending import AggregationError
from gradq.client.serde import Refusal


def test_an_aggregation_error_keeps_its_message_and_fields() -> None:
    error = AggregationError("127.0.0.1:1", grpc.StatusCode.ABORTED, "host 0 failed", "LOST")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is AggregationError
    assert str(copy) == str(error)
    assert (copy.address, copy.code, copy.details, copy.refusal) == (
        "127.0.0.1:1",
        grpc.StatusCode.ABORTED,
        "host 0 failed",
        "LOST",
    )
    assert copy.refusal is Refusal.LOST  # a name given as a string is read as the client's Refusal


def test_subclasses_keep_their_type_and_their_own_fields() -> None:
    cause = AggregationError("127.0.0.1:1", grpc.StatusCode.FAILED_PRECONDITION, "ended", "JOB_ENDED")
    ended = pickle.loads(pickle.dumps(JobEndedError("job-a", "run-1", cause)))
    assert isinstance(ended, JobEndedError)
    assert (ended.job_id, ended.incarnation, ended.refusal) == ("job-a", "run-1", "JOB_ENDED")
    assert "job 'job-a'" in str(ended)

    reach = resolution_failure("name-that-does-not-resolve.invalid:50051")
    assert reach is not None
    unreachable = pickle.loads(pickle.dumps(UnreachableError("x:1", grpc.StatusCode.UNAVAILABLE, "no answer", reach)))
    assert isinstance(unreachable, UnreachableError)
    assert unreachable.reach == reach
    assert str(unreachable) == "aggregator x:1: UNAVAILABLE: no answer"
