"""The codec registry: one codec per wire scheme, keyed by the scheme (which mirrors the wire enum).

A compressor is one module here with its ``CODECS`` tuple (and a torch twin
beside it, imported lazily). Every layer asks ``codec_for(scheme)``; none
branches on the scheme. tests/proto checks that the wire enum and this registry
name the same schemes.
"""

from __future__ import annotations

from gradq.qcore.codecs import floating, sign, sparse, uniform
from gradq.qcore.codecs.base import Codec, DeviceEncoding, TorchTwin, noise_key
from gradq.qcore.scheme import Scheme

__all__ = ["Codec", "DeviceEncoding", "TorchTwin", "codec_for", "noise_key", "registered_schemes"]

# Keyed by the enum's integer value, which is what arrives off the wire.
_REGISTRY: dict[int, Codec] = {
    int(codec.scheme): codec for module in (floating, uniform, sign, sparse) for codec in module.CODECS
}


def codec_for(scheme: Scheme | int) -> Codec:
    """The codec of a wire scheme.

    Args:
        scheme: a ``Scheme`` (or its integer value).

    Returns:
        The registered codec.

    Raises:
        ValueError: naming the value and the registered schemes.
    """
    codec = _REGISTRY.get(int(scheme))
    if codec is None:
        names = ", ".join(f"{c.scheme.value} ({c.scheme.name})" for c in _REGISTRY.values())
        raise ValueError(f"scheme={scheme!r} has no codec; expected one of {names}")
    return codec


def registered_schemes() -> frozenset[Scheme]:
    """Every scheme that has a codec."""
    return frozenset(codec.scheme for codec in _REGISTRY.values())
