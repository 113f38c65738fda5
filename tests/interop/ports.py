"""Ports for the reference tools' rendezvous, chosen below the kernel's ephemeral range (32768 and up by default),
where it hands out the local ports of outgoing connections: a port found free there could be taken by any process's
connection before the job it is for binds it (a gloo rank then reached a stranger's socket, was reset, and retried for
its 30-minute timeout). A random pick, so tests that ctest runs side by side do not probe the same one first."""
import random
import socket

_pick = random.SystemRandom()  # (tests seed the `random` module's own generator)


def free_port(low=None, high=None):
    """An unused TCP port on 127.0.0.1: a random one in [26000, 32000) (low=None), or the first free one in
    [low, high)."""
    candidates = _pick.sample(range(26000, 32000), 500) if low is None else range(low, high)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in [{low or 26000}, {high or 32000})")
