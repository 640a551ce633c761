"""Mutual TLS on the KV plane: the files a worker presents and trusts.

Every KV gRPC server (a prefill worker's transfer service, NIXL's control plane) asks each
client for a certificate and checks it against the deployment's CA before any message is
read; every client checks the server the same way. A peer's address is a node's, not known
when the certificates are made (``pdserve certs``), so both check the name ``KV_PEER_NAME``
in the certificate instead of the address (``grpc.ssl_target_name_override``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KV_PEER_NAME = "pdserve-kv"


@dataclass(frozen=True, slots=True)
class KVPlaneTLS:
    """PEM files on the worker's node (a mounted Secret in Kubernetes)."""

    ca_file: str
    cert_file: str
    key_file: str

    @classmethod
    def in_directory(cls, directory: str | Path) -> KVPlaneTLS:
        """``ca.crt``, ``worker.crt`` and ``worker.key`` of ``pdserve certs --out directory``."""
        root = Path(directory)
        return cls(str(root / "ca.crt"), str(root / "worker.crt"), str(root / "worker.key"))

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(CA, certificate chain, private key), read now: a missing file fails clearly."""
        try:
            return tuple(
                Path(p).read_bytes() for p in (self.ca_file, self.cert_file, self.key_file)
            )  # type: ignore[return-value]
        except OSError as error:
            raise ValueError(f"cannot read the KV plane's TLS files: {error}") from None
