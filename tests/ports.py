"""Loopback ports for the servers the tests start: reserved, not just found free.

A port found free by binding port 0 and closing the socket is free only for that moment: until the server process
binds it (seconds, on a loaded machine), the kernel may hand it to any connection made meanwhile as its local port,
or to another test worker binding port 0, and the server then exits with "address already in use". So the socket
that found the port stays bound for the rest of the test process (it does not listen: a connection to the port is
refused while no server runs there, as before). It is bound with ``SO_REUSEADDR``, so a server that sets it too
(uvicorn, redis-server) can bind and listen there, also again after a restart, while nothing else can.
"""

from __future__ import annotations

import socket

_held: list[socket.socket] = []  # for as long as the process lives: a server may be started there again


def free_port() -> int:
    """A loopback port that nothing but a server of this test process will bind."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    _held.append(sock)
    return int(sock.getsockname()[1])
