"""One bucket layout on every elastic DDP host, starter or joiner, from its first step on."""

from collections.abc import Sequence
from typing import Any

from torch.nn.parallel import DistributedDataParallel

__all__ = ["fix_bucket_layout"]


def fix_bucket_layout(shared: Sequence[Any]) -> None:
    """Give the shared DDP model the bucket layout every elastic host has, before its first forward.

    DDP rebuilds its buckets once, after the first backward, in the order the
    gradients became ready; a joiner's first step would then use the initial
    layout while the others use the rebuilt one, and a round would mix
    different parameters. Rebuilding now from the parameters' own order (what
    DDP's Join does) gives every host, starter or joiner, the same layout from
    its first step on. The price: buckets follow the model's order, so a
    bucket is sent only once backward has reached the model's first layers.

    Raises:
        ValueError: nothing is shared, or no shared object is the DistributedDataParallel model.
    """
    ddp = next((item for item in shared if isinstance(item, DistributedDataParallel)), None)
    if ddp is None:
        raise ValueError(
            "an elastic host shares its training state, the DDP model among it: call "
            "state.share(ddp_model, optimizer) with the DistributedDataParallel the hook is registered on first"
        )
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()
