"""Ports and addresses of an msrun run: which port the scheduler gets, and node 0's address.

- :func:`choose_port`: on one machine a port that was free a moment ago
  (:func:`free_port`), across machines the one given or msrun's own default
  (:data:`MSRUN_DEFAULT_PORT`), which node 0 refuses when a socket listens on it
  (:func:`check_port_free`, ``port-in-use``);
- :func:`check_master_addr`: on node 0 of several machines, the master address must be one
  of this machine's own (:func:`local_addresses`, for the message), since node 0 runs msrun's
  scheduler there (``bad-master-addr``).

>>> choose_port(8200, nodes=2, emulated=False, node_rank=1, master_addr="10.0.0.1")  # node 1 takes it as given
8200
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from pathlib import Path

from layout_prop.core.errors import ExecutionError, cut, one_line

__all__ = ["MSRUN_DEFAULT_PORT", "choose_port", "free_port", "check_port_free", "local_addresses",
           "check_master_addr"]

MSRUN_DEFAULT_PORT = 8118
"""msrun's own default ``--master_port``, used on real clusters when none is given."""


def choose_port(master_port: int | None, nodes: int, emulated: bool, node_rank: int, master_addr: str) -> int:
    """The scheduler's port; node 0 refuses one that a socket listens on (:func:`check_port_free`).

    Parameters
    ----------
    master_port : int or None
        The port asked for (``--master-port``), or None.
    nodes, node_rank : int
        The machines of the run and this one's number.
    emulated : bool
        Every node runs on this machine (``--emulate-nodes``): a free port, as on one machine.
    master_addr : str
        The scheduler's host, where node 0 checks the port.
    """
    if master_port is None and (nodes == 1 or emulated):
        return free_port()
    port = master_port if master_port is not None else MSRUN_DEFAULT_PORT
    if node_rank != 0:
        return port  # node 0's scheduler may hold it already
    check_port_free(master_addr, port)
    return port


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Refuse a TCP port of this machine's address ``host`` that a socket listens on (``port-in-use``).

    The probe binds with ``SO_REUSEADDR``, as MindSpore's own bind does, so a port held only
    by TIME-WAIT sockets of an earlier run (the minute after it) is accepted, and one with a
    listener is still refused.  An address that is not this machine's, or cannot be resolved,
    is left to msrun (the scheduler runs elsewhere).

    Raises
    ------
    ExecutionError
        ``port-in-use`` naming the port and the address.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ExecutionError("port-in-use", f"port {port} of {host} is already in use",
                                     hint="choose another --master-port (the same on every node)") from None


def _is_local(family: int, address: tuple) -> bool:
    """Whether this machine can bind ``address`` (its own interface address), by binding a UDP socket to it."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((address[0], 0) + tuple(address[2:]))
        return True
    except OSError:
        return False


def local_addresses() -> list[str]:
    """This machine's own addresses, for messages: 127.0.0.0/8, then the IPv4 addresses of its
    interfaces (``/proc/net/fib_trie``), its IPv6 ones but link-local (``/proc/net/if_inet6``) and
    what its host name resolves to.  Never raises (an address found no way is simply not listed)."""
    found = ["127.0.0.0/8"]

    def add(text: str) -> None:
        if text not in found and not text.startswith("127.") and not text.lower().startswith("fe80"):
            found.append(text)

    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
        for above, line in zip(lines, lines[1:]):
            if line.strip() == "/32 host LOCAL" and above.strip().startswith("|-- "):
                add(above.strip()[4:])
    except OSError:
        pass
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            digits = line.split()[0] if line.split() else ""
            if len(digits) == 32:
                add(str(ipaddress.IPv6Address(bytes.fromhex(digits))))
    except (OSError, ValueError):
        pass
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM):
            add(str(info[4][0]))
    except (OSError, UnicodeError):
        pass
    return found


def check_master_addr(host: str) -> None:
    """On node 0 of several machines: ``host`` must be an address of this machine, since node 0
    runs msrun's scheduler (and the launchers' link) on it.  Checked by binding a UDP socket to
    each address ``host`` resolves to, before anything starts.

    Raises
    ------
    ExecutionError
        ``bad-master-addr`` naming the address (or the resolver's answer) and this machine's addresses.

    >>> check_master_addr("127.0.0.1")
    >>> check_master_addr("203.0.113.7")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    layout_prop.core.errors.ExecutionError: bad-master-addr: --master-addr 203.0.113.7 is not an address of ...
    """
    shown = cut(host)[1:-1] if isinstance(host, str) else cut(host)
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ExecutionError("bad-master-addr", f"--master-addr {shown} cannot be resolved on node 0 "
                             f"({one_line(getattr(exc, 'strerror', None) or exc)}); this machine's addresses: "
                             f"{', '.join(local_addresses())}",
                             hint="on node 0, give one of its own addresses (the same --master-addr on every "
                             "node)") from None
    if any(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_unspecified for info in infos):
        raise ExecutionError("bad-master-addr", f"--master-addr {shown} is the wildcard address: the other nodes "
                             f"cannot connect to it; this machine's addresses: {', '.join(local_addresses())}",
                             hint="give node 0's address on the network the nodes share (the same on every node)")
    if any(_is_local(family, address) for family, _, _, _, address in infos):
        return
    resolved = sorted({str(info[4][0]) for info in infos} - {host})
    also = f" (it resolves to {', '.join(resolved)})" if resolved else ""
    raise ExecutionError("bad-master-addr", f"--master-addr {shown}{also} is not an address of this machine, "
                         f"which runs msrun's scheduler as node 0; this machine's addresses: "
                         f"{', '.join(local_addresses())}",
                         hint="on node 0, give one of its own addresses as --master-addr (the same on every node), "
                         "or run --node-rank 0 on the machine that has this address")
