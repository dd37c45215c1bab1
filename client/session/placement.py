"""Where a session quantizes a tensor: on its device (the torch codec) or on the host (numpy).

The arithmetic lives in ``gradq.qcore.torch_codec`` (the codecs' torch twins,
byte-identical to numpy); here the configured codec becomes the tensor pushed,
the buffer its mean is decoded into, and the stream the sender thread works on.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["bucket_and_output", "on_callers_stream", "quantizes_on_device"]


def quantizes_on_device(device: torch.device, codec: str) -> bool:
    """Whether a bucket on ``device`` goes through the torch codec (else numpy, on the host)."""
    return codec == "torch" or (codec == "auto" and device.type != "cpu")


def bucket_and_output(buffer: torch.Tensor, codec: str) -> tuple[Any, Any]:
    """(what to push, where its mean lands) for a flat tensor (a DDP bucket's buffer).

    The torch codec pushes the buffer itself and decodes into it when it is
    fp32, else into a fresh fp32 tensor on the same device; numpy pushes an fp32
    host copy (the buffer itself for a CPU fp32 bucket) and decodes into it.

    Args:
        buffer: DDP's flat gradient bucket.
        codec: one of gradq.client.env.CODECS.
    """
    flat = buffer.detach().reshape(-1)
    if quantizes_on_device(flat.device, codec):
        out = (
            flat if flat.dtype == torch.float32 else torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
        )
        return flat, out
    host = flat.float().cpu().numpy()
    return host, host


def on_callers_stream(buffer: torch.Tensor) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Make a function that runs on another thread issue its device work on the caller's CUDA stream.

    Work queued there starts after the kernels that computed ``buffer``; on the
    CPU there is no stream and the function runs as it is.
    """
    stream = torch.cuda.current_stream(buffer.device) if buffer.is_cuda else None

    def wrap(function: Callable[[], None]) -> Callable[[], None]:
        @functools.wraps(function)
        def on_stream() -> None:
            with _stream(stream):
                function()

        return on_stream

    return wrap


@contextlib.contextmanager
def _stream(stream: Any) -> Iterator[None]:
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield
