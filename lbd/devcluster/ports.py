"""Free TCP ports on the loopback interface for locally started servers.

The kernel picks each port (bind to port 0), so the ports come from the ephemeral range and do not
collide with well-known services. A port is free when returned, not reserved: another process may
take it before the server binds it, which on a test machine is rare enough to accept.
"""

from __future__ import annotations

import contextlib
import socket

LOOPBACK = "127.0.0.1"


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Return ``count`` distinct TCP ports on ``host`` that nothing listens on right now."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            # All sockets stay open until every port is chosen, so the kernel cannot hand out the
            # same port twice.
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def free_port(host: str = LOOPBACK) -> int:
    """Return one TCP port on ``host`` that nothing listens on right now."""
    return free_ports(1, host)[0]
