"""The session: one training loop's connection to a gradq job (torch); every adapter drives one.

See gradq.client.session.session. Importing this package loads torch.
"""

from gradq.client.serde import JobSpec
from gradq.client.session.session import GradqSession

__all__ = ["GradqSession", "JobSpec"]
