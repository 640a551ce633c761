"""A KV server's mutual-TLS credentials: refused handshakes counted, certificates rotated live.

gRPC gives a server no hook for a failed TLS handshake, but its dynamic credentials call a
fetcher before every handshake starts (so that a server can change its certificate). That
fetcher counts each connection a peer opens; the servicer counts each connection that
reaches a call (by its peer address, at its first call). The difference is the connections
the handshake refused (no certificate, a foreign CA's, an expired one), or that closed
before their first call, which pdserve's own clients never do::

    peer connects ─▶ fetcher: num_tls_connections += 1 ─▶ handshake ─┬─ refused: nothing read
                                                                       └─ a call: served += 1
    num_tls_connections_refused = num_tls_connections - served

The fetcher also re-reads the files when one changed on disk (a rotated Secret): new
connections get the new certificate and trust the new CA bundle; open ones keep theirs. A
rotation that cannot be read (a file half-written) keeps the previous files in force.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from pdserve.kvconnector.transfer_stats import TransferStats
from pdserve.messages.kv_plane_tls import KVPlaneTLS

logger = logging.getLogger(__name__)


class TLSServerCredentials:
    """``credentials`` for ``add_secure_port``: a client certificate of the CA required."""

    def __init__(self, tls: KVPlaneTLS, stats: TransferStats) -> None:
        self._tls = tls
        self._stats = stats
        self._mtimes = self._file_mtimes()
        # gRPC documents None from the fetcher as "no change"; its stubs say otherwise.
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._configuration(),
            self._fetch,  # type: ignore[arg-type]
            require_client_authentication=True,
        )

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        ca, cert, key = self._tls.read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def _file_mtimes(self) -> tuple[int, ...]:
        paths = (self._tls.ca_file, self._tls.cert_file, self._tls.key_file)
        try:
            return tuple(Path(path).stat().st_mtime_ns for path in paths)
        except OSError:
            return ()

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: count it; the new files if they changed."""
        self._stats.record_tls_connection()
        mtimes = self._file_mtimes()
        if mtimes == self._mtimes or not mtimes:
            return None
        try:
            configuration = self._configuration()
        except ValueError as error:
            logger.warning(
                "KV plane TLS files changed but cannot be read (%s): kept the old", error
            )
            return None
        self._mtimes = mtimes
        logger.info("KV plane TLS files changed: new connections use them")
        return configuration
