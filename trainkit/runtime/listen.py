"""A listening socket on exactly one address, for torch's TCPStore to serve from.

torch's TCPStore server listens on every interface whatever host name it is given; handed a socket
the caller already bound (`TCPStore(master_listen_fd=...)`), it serves on that socket only. No torch
import here: the launcher binds before it imports torch's rendezvous.
"""

from __future__ import annotations

import socket


def bound_socket(address: str, port: int) -> socket.socket:
    """A listening TCP socket on `address`:`port` (a host name: its first address; port 0: a free one)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # like TCPStore: TIME_WAIT is no conflict
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock
