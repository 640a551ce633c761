"""Moving leased pages between workers: gRPC (server, client), NIXL, the handshake's layout."""
