"""Where a worker's KV plane lives on the network: the Ray node's address, and the interface
that carries it.

On a multi-node cluster only the worker knows which node it landed on, so the address its KV
service binds and advertises is resolved inside the worker (``on_node_address``), as Ray
reports it (``ray.util.get_node_ip_address()``): 127.0.0.2 for a raylet started with
``--node-ip-address 127.0.0.2``, the node's own IP on a real cluster.

NIXL moves the bytes over UCX, which picks its own addresses from network interfaces, not from
our advertised one: with TCP it may use any interface (here eth0 as well as lo). ``pin_ucx_to``
points ``UCX_NET_DEVICES`` at the interface whose subnet holds the advertised address, so the
data path follows the control path; it runs before the NIXL agent exists (UCX reads its
environment when its context is made) and leaves a ``UCX_NET_DEVICES`` the operator set alone.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import struct

from pdserve.messages.connector_config import KVConnectorConfig

_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B  # Linux ioctls: an interface's IPv4 address, mask


def on_node_address(config: KVConnectorConfig) -> KVConnectorConfig:
    """``config`` with ``host`` set to the address of the Ray node this process runs on."""
    import ray

    return dataclasses.replace(config, host=ray.util.get_node_ip_address())


def interface_of(address: str) -> str | None:
    """The name of the interface whose IPv4 subnet contains ``address`` (None: none found,
    not IPv4, or not Linux)."""
    try:
        wanted = ipaddress.IPv4Address(address)
        import fcntl
    except (ValueError, ImportError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                own = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24]
                mask = fcntl.ioctl(probe.fileno(), _SIOCGIFNETMASK, request)[20:24]
            except OSError:  # no IPv4 address on this interface
                continue
            network = ipaddress.IPv4Network(
                f"{socket.inet_ntoa(own)}/{socket.inet_ntoa(mask)}", strict=False
            )
            if wanted in network:
                return name
    return None


def pin_ucx_to(address: str) -> None:
    """Sets ``UCX_NET_DEVICES`` to the interface carrying ``address`` unless already set."""
    if "UCX_NET_DEVICES" in os.environ:
        return
    interface = interface_of(address)
    if interface is not None:
        os.environ["UCX_NET_DEVICES"] = interface
