"""Ports for the reference tools' rendezvous: one the kernel has just handed out and nothing listens on, so tests that
ctest runs side by side never share a MASTER_PORT (a fixed number did: two tests' megatron-core gloo stores raced)."""
import socket


def free_port(low=None, high=None):
    """An unused TCP port on 127.0.0.1: any the kernel picks (low=None), or the first free one in [low, high)."""
    for port in ([0] if low is None else range(low, high)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in [{low}, {high})")
