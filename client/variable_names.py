"""Every GRADQ_* name gradq reads, and a warning for one set that none does (``GRADQ_BIT=4`` is not GRADQ_BITS).

A misspelt variable would otherwise be ignored without a word: the job trains
on the default. The worker's own names are gradq.client.env's; the others
are listed here, so a name another part of gradq reads (the aggregator's, set
in the same shell that starts the ranks) is no misspelling. The warning goes
to the ``gradq`` logger (a warning shows without any logging set up).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable, Mapping

__all__ = ["OTHER_VARIABLES", "unknown_variables", "warn_unknown_variables"]

log = logging.getLogger(__name__)

# The GRADQ_* names other parts of gradq read than the worker's own: the aggregator's (gradq.server.env, which a
# worker does not import), `gradq worker`'s flags, the Compose files', the Slurm script's, the benchmarks' and the
# test suite's.
# tests/client/test_env_names.py holds this list to every reader's.
OTHER_VARIABLES = frozenset(
    {
        # `gradq serve` and its health check (gradq.server.env)
        "GRADQ_ADVERTISE_HOST",
        "GRADQ_BIND_HOST",
        "GRADQ_EXIT_AFTER_JOBS",
        "GRADQ_GRACE",
        "GRADQ_JOB_IDLE_TIMEOUT",
        "GRADQ_KEEPALIVE_TIMEOUT",
        "GRADQ_LOG_FORMAT",
        "GRADQ_LOG_LEVEL",
        "GRADQ_MAX_BUCKET_ELEMENTS",
        "GRADQ_MAX_JOBS",
        "GRADQ_MAX_JOBS_PER_PEER",
        "GRADQ_MAX_JOB_MEMORY_BYTES",
        "GRADQ_MAX_MEMORY_BYTES",
        "GRADQ_MAX_MESSAGE_BYTES",
        "GRADQ_MAX_OPEN_ROUNDS",
        "GRADQ_MAX_STEPS_AHEAD",
        "GRADQ_MAX_STREAMS_PER_PEER",
        "GRADQ_MAX_WAITING_CALLS",
        "GRADQ_MAX_WAITING_PER_JOB",
        "GRADQ_MAX_WAITING_PER_PEER",
        "GRADQ_MAX_WATCHES",
        "GRADQ_MAX_WORKERS",
        "GRADQ_MAX_WORLD_SIZE",
        "GRADQ_METRICS_PORT",
        "GRADQ_NON_FINITE",
        "GRADQ_PARTIAL_QUORUM",
        "GRADQ_PORT",
        "GRADQ_PORT_FILE",
        "GRADQ_RETAIN_STEPS",
        "GRADQ_RETURN_BITS",
        "GRADQ_RETURN_SCHEME",
        "GRADQ_ROUND_TIMEOUT",
        "GRADQ_SERVER_ERROR_FEEDBACK",
        "GRADQ_SHARDS",
        "GRADQ_SHARD_GROUP",
        "GRADQ_SHARD_PORTS",
        "GRADQ_TLS_CERT",
        "GRADQ_TLS_CLIENT_CA",
        "GRADQ_TLS_KEY",
        "GRADQ_TOKEN_TABLE",
        "GRADQ_WORLD_SIZE",
        # `gradq worker`'s own flags (gradq.client.apps.cluster)
        "GRADQ_EPOCHS",
        "GRADQ_MASTER_PORT",
        "GRADQ_MIN_ACCURACY",
        "GRADQ_PEERS",
        "GRADQ_PEER_SETTLE",
        "GRADQ_PEER_TIMEOUT",
        # the Compose files, the Slurm script, the benchmarks and the test suite
        "GRADQ_BASE_IMAGE",
        "GRADQ_MAX_RESTARTS",
        "GRADQ_NETNS_RUN",
        "GRADQ_METRICS_HOST_PORT",
        "GRADQ_METRICS_HOST_PORT_2",
        "GRADQ_NPROC_PER_NODE",
        "GRADQ_PIP_OPTIONS",
        "GRADQ_PROMETHEUS_HOST_PORT",
        "GRADQ_PROMETHEUS_IMAGE",
        "GRADQ_REPO",
        "GRADQ_SERVE_TIMEOUT",
        "GRADQ_SLURM_WAIT",
        "GRADQ_STATUS_SCREENSHOT",
        "GRADQ_TRAIN_SCRIPT",
        "GRADQ_VENV",
        "GRADQ_WORKERS",
    }
)
# Names already warned of: a process hears of each once, however often its configuration is read.
_warned: set[str] = set()


def unknown_variables(environ: Mapping[str, str] | None, worker_names: Iterable[str]) -> dict[str, str | None]:
    """The GRADQ_* names set that no part of gradq reads, each with the closest one that is (None: none close).

    Args:
        environ: the variables (None: ``os.environ``).
        worker_names: the worker's own variables (gradq.client.env.HOOK_ENVIRONMENT).
    """
    known = set(worker_names) | OTHER_VARIABLES
    # Compared without the prefix every name shares (with it, any two names look alike), and in capitals: a
    # variable's name is case-sensitive, so gradq_bits is as unknown as GRADQ_BIT.
    suffixes = {name.removeprefix("GRADQ_"): name for name in known}
    unknown = {}
    for name in sorted(os.environ if environ is None else environ):
        if name.upper().startswith("GRADQ_") and name not in known:
            closest = difflib.get_close_matches(name.upper().removeprefix("GRADQ_"), suffixes, n=1)
            unknown[name] = suffixes[closest[0]] if closest else None
    return unknown


def warn_unknown_variables(environ: Mapping[str, str] | None, worker_names: Iterable[str]) -> None:
    """Log a warning, once per process and name, for each GRADQ_* variable set that gradq does not read.

    ``GRADQ_BIT is not a gradq variable (it is ignored); did you mean GRADQ_BITS?``

    Args:
        environ: the variables (None: ``os.environ``).
        worker_names: the worker's own variables, named when no known one is close.
    """
    worker_names = list(worker_names)
    for name, closest in unknown_variables(environ, worker_names).items():
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"did you mean {closest}?" if closest else f"a worker reads {', '.join(worker_names)}"
        log.warning("%s is not a gradq variable (it is ignored); %s", name, hint)
