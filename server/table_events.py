"""What the round table tells whoever serves it (the servicer), and the silence of a table nobody serves."""

from __future__ import annotations

from typing import Protocol

from gradq.server.job import Job

__all__ = ["TableEvents", "Unserved"]


class TableEvents(Protocol):
    """The round table's news for the serving layer, which listens once (``RoundTable.listen``) before it serves."""

    def membership_changed(self, job: Job, event: str) -> None:
        """An elastic job's members changed; ``event`` says how (e.g. "joined", "rank_lost").

        From any thread, outside every lock: the Watch streams send it on.
        """

    def outer_boundary(self, job: Job, step: int) -> None:
        """A DiLoCo job's global state on the aggregator is whole before outer round ``step``.

        Under a round's lock, so it must not block: the joiners waiting for
        the state receive it (gradq.server.outer_service).
        """

    def model_vote_changed(self, job_id: str) -> None:
        """The start quorum's model vote of ``job_id`` may have changed: the Joins waiting for it look again.

        Told (outside every lock) on a Join, a Leave, a loss, a waiting Join
        given up and a run retired.
        """


class Unserved:
    """The events of a table no servicer listens to (a table driven directly, as tests do): nobody is told."""

    def membership_changed(self, job: Job, event: str) -> None:
        pass

    def outer_boundary(self, job: Job, step: int) -> None:
        pass

    def model_vote_changed(self, job_id: str) -> None:
        pass
