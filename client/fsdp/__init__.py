"""The FSDP2 adapter: gradq as the cross-host reduction of a model sharded inside each host (HSDP).

``from gradq.client.fsdp import use_gradq`` (see gradq.client.fsdp.adapter).
Importing this package loads torch.
"""

from gradq.client.fsdp.adapter import GradqFSDP, use_gradq

__all__ = ["GradqFSDP", "use_gradq"]
