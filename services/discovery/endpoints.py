"""Whether an ingester can connect to a ZMQ endpoint that discovery is about to register.

vLLM's own settings hold the *bind* side of its sockets (``tcp://*:5557``), and copying
them into a static list is an easy mistake: libzmq refuses to connect to a wildcard host or
to a tcp endpoint without a port (EINVAL), so an ingester could never subscribe to, or
replay from, such an entry. ``0.0.0.0`` and ``::`` are wildcards too (connecting to them
reaches the ingester's own host). ``inproc://`` lives inside one process, so another
process cannot reach it.
"""

from __future__ import annotations

_WILDCARDS = frozenset({"*", "0.0.0.0", "::"})


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be connected to from another host, or None if it can."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or not rest:
        return "is not like tcp://host:port"
    if scheme == "ipc":
        return None
    if scheme != "tcp":
        return f"uses transport {scheme!r}; an ingester connects over tcp or ipc"
    host, colon, port = rest.rpartition(":")
    if not colon or not port:
        return "has no port"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"has an invalid port {port!r}"
    host = host.rpartition(";")[2]  # libzmq allows tcp://source;host:port
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        return "has no host"
    if host in _WILDCARDS:
        return f"has the wildcard host {host!r}: a bind address, not one to connect to"
    return None
