"""TCP connections between an engine's process and its Ray-placed ranks, opened with a token.

The connecting side sends a random token first; the accepting side serves only a connection that
sent it (others are closed), so a stray connection to a rank's or the engine's port is never
taken for the group's. Both ends are plain blocking sockets afterwards.
"""

from __future__ import annotations

import hmac
import socket

TOKEN_TIMEOUT_S = 30.0  # to connect, and for a connecting peer to send the token


def connect_with_token(address: tuple[str, int], token: bytes) -> socket.socket:
    """A blocking socket to ``address`` that has sent ``token``."""
    sock = socket.create_connection(address, timeout=TOKEN_TIMEOUT_S)
    sock.sendall(token)
    sock.settimeout(None)  # blocking again (a ``Connection`` reads the descriptor directly)
    return sock


def accept_with_token(listener: socket.socket, token: bytes) -> socket.socket:
    """The next connection to ``listener`` that sends ``token`` (blocking)."""
    while True:
        sock, _ = listener.accept()
        sock.settimeout(TOKEN_TIMEOUT_S)
        try:
            got = _read_exactly(sock, len(token))
        except OSError:
            got = b""
        if hmac.compare_digest(got, token):
            sock.settimeout(None)
            return sock
        sock.close()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data
