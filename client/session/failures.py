"""Raise a failed bucket's own exception (an AggregationError) from DDP's ``backward()``.

DDP's reducer is C++ and reads a comm hook's future as a Tensor. A Python
``Future.set_exception(error)`` stores ``error`` as the future's *value* (only
Python's ``wait()`` unwraps it), so the reducer fails with ``RuntimeError:
Unable to cast <error> to Tensor``; an exception raised inside ``.then()``
becomes a C++ error string, so the reducer raises a plain RuntimeError. Neither
keeps the type, the gRPC code or the address.

What keeps them: the future DDP sees always completes with a tensor (the
bucket as it was, unreduced), the failure is held here, and an autograd final
callback raises it once DDP has finished the backward pass. An exception from a
final callback leaves ``backward()`` as the Python object it was. The callback
is queued in two hops, so it runs after DDP's own final callback
(``finalize_backward``, queued after the last bucket's hook) and DDP's state is
consistent for the next iteration.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["BackwardFailures"]


class BackwardFailures:
    """Collects the bucket failures of each backward pass and raises the first one at its end."""

    __slots__ = ("_errors", "_graph_task", "_lock", "_pending", "absorb")

    def __init__(self, absorb: Callable[[BaseException], bool] | None = None) -> None:
        # Says whether a failure is handled by its adapter instead of raised (an elastic host that was
        # dropped rejoins after the optimizer's step); None: every failure is raised.
        self.absorb = absorb
        self._lock = threading.Lock()  # futures complete on gRPC threads
        self._pending: list[torch.futures.Future[torch.Tensor]] = []  # this pass's futures, as DDP sees them
        self._errors: list[BaseException] = []  # failures of this pass, in completion order
        self._graph_task = -1  # autograd graph task whose final callback is queued

    def guard(
        self, inner: torch.futures.Future[torch.Tensor], buffer: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """The future to hand DDP for ``inner``: a failure is raised typed at the end of ``backward()``.

        Args:
            inner: the bucket's future; it may fail with any exception.
            buffer: the bucket's buffer, what DDP gets back if ``inner`` fails.

        Returns:
            A future that never fails inside a backward pass. Outside one (DDP's
            join hooks, a direct call) ``inner`` itself: Python waiters unwrap
            its exception typed already.
        """
        graph_task = torch._C._current_graph_task_id()
        if graph_task == -1:
            return inner

        def settle(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                return done.wait()
            except Exception as error:  # any failure: DDP must still get a tensor
                with self._lock:
                    self._errors.append(error)
                return buffer

        guarded = inner.then(settle)
        with self._lock:
            self._pending.append(guarded)
            first = graph_task != self._graph_task
            self._graph_task = graph_task
        if first:
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._raise_first))
        return guarded

    def _raise_first(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._graph_task = -1
        for future in pending:
            future.wait()  # DDP waited on them already; this orders the errors list
        with self._lock:
            errors, self._errors = self._errors, []
        absorb = self.absorb
        raised = [error for error in errors if absorb is None or not absorb(error)]
        if raised:
            raise raised[0]
