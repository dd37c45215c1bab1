"""DiLoCo through gradq: hosts average pseudo-gradients every ``sync_every`` local steps, not every step.

``from gradq.client.diloco import DiLoCo`` (see gradq.client.diloco.outer).
Importing this package loads torch.
"""

from gradq.client.diloco.outer import DEFAULT_BUCKET_ELEMENTS, OUTER_STEP_PLACES, DiLoCo, default_outer_optimizer

__all__ = ["DEFAULT_BUCKET_ELEMENTS", "OUTER_STEP_PLACES", "DiLoCo", "default_outer_optimizer"]
