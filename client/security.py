"""How a worker reaches an aggregator: plaintext, TLS, mutual TLS, and/or a bearer token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = ["ChannelSecurity"]


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """Credentials for every channel and call of a WorkerClient (picklable: plain bytes).

    Args:
        root_certificates: PEM CA bundle that signed the aggregator's certificate;
            None talks plaintext.
        certificate_chain: this worker's PEM certificate, for mutual TLS.
        private_key: its PEM key.
        token: sent as ``authorization: Bearer <token>`` on every call.
        server_name: host name to check the aggregator's certificate against,
            when it differs from the address dialled.
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("certificate_chain and private_key: expected both (mutual TLS) or neither")
        if self.certificate_chain is not None and self.root_certificates is None:
            raise ValueError("a client certificate needs root_certificates: mutual TLS is TLS first")

    @classmethod
    def from_files(
        cls,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        token: str | None = None,
        server_name: str | None = None,
    ) -> ChannelSecurity:
        """Read the PEM files named (any may be None)."""
        return cls(
            ca.read_bytes() if ca else None,
            cert.read_bytes() if cert else None,
            key.read_bytes() if key else None,
            token,
            server_name,
        )

    def channel(self, address: str, options: Sequence[tuple[str, object]]) -> grpc.Channel:
        """A channel to ``address`` with these credentials."""
        if self.root_certificates is None:
            return grpc.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(address, credentials, options=options)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Per-call metadata (the bearer token, if any)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()
