"""qcore for torch tensors on any device: encode there, cross to the host packed, decode there.

The codecs' torch twins do the arithmetic (byte-identical to numpy); this module
moves their output across the host-device boundary in one copy each way and
keeps error-feedback residuals on the device. Importing it imports torch, so
``gradq.qcore`` never does; the DDP adapter and ``WorkerClient`` load it when
they are handed a tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator

import numpy as np
import torch

from gradq.qcore.codecs import DeviceEncoding, codec_for
from gradq.qcore.error_feedback import check_decay
from gradq.qcore.quantized import QuantizedArray
from gradq.qcore.scheme import QuantConfig, Scheme

__all__ = [
    "Crossings",
    "TorchArrays",
    "crossings",
    "TorchErrorFeedback",
    "decode_tensor",
    "dtype_name",
    "encode_on_device",
    "encode_tensor",
    "refuse_out_of_range",
    "to_device",
    "to_host",
    "view_bytes",
]


class Crossings:
    """Bytes this module copied between host and device memory (a CPU tensor's "copies" are no-ops, counted alike)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.to_host_bytes = self.to_device_bytes = self.copies = 0

    def add(self, to_host: int, to_device: int) -> None:
        """Record one copy."""
        with self._lock:
            self.to_host_bytes += to_host
            self.to_device_bytes += to_device
            self.copies += 1

    def snapshot(self) -> tuple[int, int, int]:
        """(bytes to the host, bytes to the device, copies) so far."""
        with self._lock:
            return self.to_host_bytes, self.to_device_bytes, self.copies


# What crossed in this process: bench/cuda_check.py prints it per step.
crossings = Crossings()


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch float dtype ("float32", "float16", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def refuse_out_of_range(flat: torch.Tensor, limit: float, what: str) -> None:
    """Raise for the first element with ``not |x| < limit``, with numpy's message (``x[i]=v cannot be encoded``)."""
    bad = torch.nonzero(~(flat.abs() < limit))
    if bad.numel():
        index = int(bad[0])
        raise ValueError(f"x[{index}]={float(flat[index])} cannot be encoded; expected {what}")


def encode_on_device(x: torch.Tensor, config: QuantConfig, rng: np.random.Generator | None = None) -> DeviceEncoding:
    """Encode ``x`` (flattened, computed in float32) where it lives; nothing crosses to the host.

    Raises:
        ValueError: a value the scheme refuses (NaN, Inf, ``|x| >= 2**126``), naming its index.
    """
    flat = x.detach().reshape(-1).float()
    if flat.numel() == 0:  # an empty tensor made from numpy has stride 0, which byte views refuse
        flat = flat.new_empty(0)
    return codec_for(config.scheme).torch().encode(flat, config, rng)


def to_host(encoding: DeviceEncoding, scheme: Scheme, numel: int, dtype: str) -> QuantizedArray:
    """The wire form of a device encoding: scale, zero point and payload cross in one copy."""
    parts = [view_bytes(encoding.scale, torch.uint8), view_bytes(encoding.zero_point, torch.uint8), encoding.payload]
    host = torch.cat(parts).cpu().numpy()
    crossings.add(host.nbytes, 0)
    # Scales first: the float32 and int32 views then start on 4-byte boundaries.
    scale_end = encoding.scale.numel() * 4
    zero_point_end = scale_end + encoding.zero_point.numel() * 4
    return QuantizedArray(
        scheme,
        encoding.bits,
        numel,
        encoding.channel_size,
        host[:scale_end].view(np.float32),
        host[scale_end:zero_point_end].view(np.int32),
        host[zero_point_end:],
        dtype,
        encoding.topk,
    )


def view_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data.view(dtype)``, also for an empty tensor."""
    # Empty tensors made from numpy have stride 0, which dtype views refuse.
    return data.view(dtype) if data.numel() else torch.empty(0, dtype=dtype, device=data.device)


def to_device(q: QuantizedArray, device: torch.device) -> DeviceEncoding:
    """A received encoding on ``device``: scale, zero point and payload cross in one copy."""
    host = np.concatenate([q.scale.view(np.uint8), q.zero_point.view(np.uint8), q.payload.reshape(-1)])
    moved = torch.from_numpy(host).to(device)
    crossings.add(0, host.nbytes)
    scale_end = 4 * q.scale.size
    zero_point_end = scale_end + 4 * q.zero_point.size
    return DeviceEncoding(
        q.bits,
        q.channel_size,
        view_bytes(moved[:scale_end], torch.float32),
        view_bytes(moved[scale_end:zero_point_end], torch.int32),
        moved[zero_point_end:],
        q.topk,
    )


def encode_tensor(
    x: torch.Tensor, config: QuantConfig, *, rng: np.random.Generator | None = None, dtype: str | None = None
) -> QuantizedArray:
    """``gradq.qcore.encode`` for a tensor: quantized on its device, only the packed form crosses.

    Args:
        x: any float tensor on any device (flattened, computed in float32).
        config: the wire scheme.
        rng: generator for stochastic rounding (the same draw numpy's encode makes).
        dtype: element type to record for the receiver; defaults to ``x``'s.

    Returns:
        The QuantizedArray, byte-identical to ``encode(x.numpy(), config, rng=...)``.

    Raises:
        ValueError: a value the scheme refuses, naming its index.
    """
    encoding = encode_on_device(x, config, rng)
    return to_host(encoding, config.scheme, x.numel(), dtype or dtype_name(x.dtype))


def decode_tensor(q: QuantizedArray, out: torch.Tensor) -> torch.Tensor:
    """``gradq.qcore.decode`` into a tensor: the packed form crosses, the values are computed on ``out``'s device.

    Args:
        q: the encoded array (host).
        out: contiguous float32 tensor of ``q.numel`` elements, on any device.

    Returns:
        ``out``, holding the decoded values.

    Raises:
        ValueError: ``out`` is not a contiguous float32 tensor of ``q.numel`` elements.
    """
    if out.dtype != torch.float32 or out.numel() != q.numel or not out.is_contiguous():
        raise ValueError(
            f"out has dtype={dtype_name(out.dtype)}, numel={out.numel()}, contiguous={out.is_contiguous()}; "
            f"expected a contiguous float32 tensor of {q.numel} elements"
        )
    codec_for(q.scheme).torch().decode(to_device(q, out.device), q.numel, out.view(-1))
    return out


class TorchErrorFeedback:
    """``gradq.qcore.ErrorFeedback`` for tensors: the residuals stay on the tensors' device.

    Same arithmetic in the same order as the numpy one, so both carry the same
    residuals for the same inputs.
    """

    __slots__ = ("_residuals", "decay")

    def __init__(self, decay: float = 1.0) -> None:
        self.decay = check_decay(decay)
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def encode(
        self, key: Hashable, x: torch.Tensor, config: QuantConfig, *, rng: np.random.Generator | None = None
    ) -> QuantizedArray:
        """Compensate ``x`` with the residual of ``key``, encode it, and remember the new residual.

        Args:
            key: identifies the stream (bucket) whose errors are carried.
            x: the values to send (flattened, float32), on any device.
            config: the wire scheme.
            rng: generator for stochastic rounding.

        Returns:
            The encoded compensated values (host).
        """
        compensated = x.detach().reshape(-1).to(torch.float32, copy=True)
        # Popped until the encode succeeds: a NaN/Inf bucket leaves no residual, as in the numpy one.
        residual = self._residuals.pop(key, None)
        if residual is not None and residual.numel() == compensated.numel():
            if self.decay != 1.0:  # two roundings, as numpy's multiply then add
                residual.mul_(np.float32(self.decay).item())
            compensated += residual
        else:
            residual = torch.empty_like(compensated)
        encoding = encode_on_device(compensated, config, rng)
        codec_for(config.scheme).torch().decode(encoding, compensated.numel(), residual)
        torch.sub(compensated, residual, out=residual)
        self._residuals[key] = residual
        return to_host(encoding, config.scheme, compensated.numel(), dtype_name(x.dtype))

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The residual currently held for ``key`` (None if there is none)."""
        return self._residuals.get(key)

    def set_residual(self, key: Hashable, residual: torch.Tensor) -> None:
        """Hold ``residual`` (flat float32) for ``key``, e.g. restored from a checkpoint."""
        self._residuals[key] = residual

    def keys(self) -> Iterator[Hashable]:
        """The keys that hold a residual."""
        return iter(list(self._residuals))

    def reset(self, key: Hashable | None = None) -> None:
        """Forget one key's residual, or all of them."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def __len__(self) -> int:
        return len(self._residuals)


class TorchArrays:
    """``gradq.qcore.arrays.ArrayCodec`` for tensors on any device (see ``NumpyArrays``).

    Args:
        config: the wire grid.
        error_feedback: keep a residual per key, on the device.
        decay: the residuals' decay (see ``gradq.qcore.ErrorFeedback``).
    """

    library = "torch"

    def __init__(self, config: QuantConfig, error_feedback: bool, decay: float = 1.0) -> None:
        self.config = config
        self.error_feedback = TorchErrorFeedback(decay) if error_feedback else None

    def flatten(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as a flat view."""
        return values.detach().reshape(-1)

    def output(self, out: torch.Tensor | None, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A new flat float32 tensor on ``like``'s device, or ``out`` checked.

        Raises:
            ValueError: ``out`` is not a contiguous float32 tensor of ``numel`` elements.
        """
        if out is None:
            return torch.empty(numel, dtype=torch.float32, device=like.device)
        if out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous():
            raise ValueError(
                f"out has dtype={dtype_name(out.dtype)}, numel={out.numel()}, contiguous={out.is_contiguous()}; "
                f"expected a writeable contiguous float32 tensor of {numel} elements"
            )
        return out.view(-1)

    def encode(
        self, key: int, values: torch.Tensor, rng: np.random.Generator, config: QuantConfig | None = None
    ) -> QuantizedArray:
        """``encode_tensor`` or, with error feedback, ``TorchErrorFeedback.encode``, on ``config`` (None: its own).

        Copying the packed form to the host waits for the device, so the caller's
        clock around this is honest.
        """
        config = config or self.config
        if self.error_feedback is not None:
            return self.error_feedback.encode(key, values, config, rng=rng)
        return encode_tensor(values, config, rng=rng)

    def decode(self, mean: QuantizedArray, out: torch.Tensor) -> None:
        """``decode_tensor``, waiting for the device so the mean is there (and the time honest)."""
        decode_tensor(mean, out)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)

    def relative_error(self, key: int, values: torch.Tensor, encoded: QuantizedArray) -> float | None:
        """The residual's norm under error feedback, else the decoded push's error."""
        flat = values.detach().reshape(-1).float()
        norm = float(torch.linalg.vector_norm(flat))
        if norm == 0.0:
            return None
        if self.error_feedback is not None:
            residual = self.error_feedback.residual(key)
            return float(torch.linalg.vector_norm(residual)) / norm if residual is not None else None
        decoded = decode_tensor(encoded, torch.empty_like(flat))
        return float(torch.linalg.vector_norm(decoded - flat)) / norm
