"""The launchers' link: how the msrun launchers of several machines watch each other.

No file is shared between machines, and MindSpore's scheduler knows a node only once its
workers joined, so node 0's launcher listens on the master address at ``master_port +``
:data:`LINK_PORT_OFFSET` and every other launcher connects to it (:class:`NodeLink`): a line
a second each way, and a last word, ``done`` or ``fail`` with the one-line error.  A launcher
killed, a node's run failing, or a node silent for 6 s is a :class:`LinkProblem` that the
engine's poll turns into ``node-lost`` naming the node.
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from layout_prop.core.errors import ExecutionError, one_line, printable

__all__ = ["LINK_PORT_OFFSET", "LinkProblem", "NodeLink"]

LINK_PORT_OFFSET = 1
"""The launchers of several machines watch each other over one TCP connection per node to node 0's
launcher, on the master address at ``master_port + LINK_PORT_OFFSET`` (8119 by default)."""

_LINK_BEAT_SECONDS = 1.0
#: a peer silent this long (its machine stopped, or the network between the nodes failed) is lost
_LINK_SILENCE_SECONDS = 6.0
#: a connection that has not said which node it is within this long is dropped
_LINK_HELLO_SECONDS = 10.0
_LINK_MAX_LINE = 4096
_LINK_MAX_STRANGERS = 32


@dataclass
class LinkProblem:
    """What the link learnt: ``{what} {seconds} s after the launch: {why}``."""

    code: str  # node-lost, bad-nodes, bad-node-rank
    what: str  # node 1 (ranks 2-3) was lost
    why: str
    hint: str
    when: float  # time.monotonic()


@dataclass
class _Peer:
    """One connection of the link: another node's launcher (``node`` once known)."""

    sock: socket.socket
    address: str
    opened: float
    node: int | None = None
    heard: float = 0.0
    buffer: bytes = b""
    last_word: str | None = None  # "done" or "fail", once said


class NodeLink:
    """The launchers' heartbeat across machines (no file is shared, and MindSpore's scheduler
    knows a node only once its workers joined).

    Node 0's launcher listens on the master address at ``port`` (``master_port + 1``) from
    before anything starts; every other launcher connects to it (again every half second until
    it is there) and says ``hello NODE NODES RANKS``.  Both ends then send ``beat`` every second
    and, when their run ends, a last word: ``done``, or ``fail`` and their one-line error.  A
    connection that closes without a last word (its ``layout-prop`` killed: the kernel closes its
    socket) or stays silent for :data:`_LINK_SILENCE_SECONDS` (a stopped machine, a cut network)
    is a lost node; a last word ``fail`` is a failed node.  Either is :meth:`problem`, which the
    launcher's poll turns into ``node-lost`` naming the node.  Node 0 also refuses a launcher that
    runs another number of nodes or ranks, or a node rank already connected (``refuse``).  A
    launcher that cannot reach the port is not watched (the run goes on, as before the link).
    Everything runs in one daemon thread; the protocol has no authentication, like msrun's own.
    """

    def __init__(self, node_rank: int, nodes: int, ranks: int, host: str, port: int,
                 describe: Callable[[int], str]) -> None:
        self.node_rank, self.nodes, self.ranks = node_rank, nodes, ranks
        self.host, self.port = host, port
        self.describe = describe
        self.peers: list[_Peer] = []
        self.joined: set[int] = set()
        self._problem: LinkProblem | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the launcher's side
    def open(self) -> None:
        """Node 0: listen now (``port-in-use`` if taken); every node: start the link's thread."""
        if self.node_rank == 0:
            family, _, _, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
                sock.listen(16)
            except OSError as exc:
                sock.close()
                if exc.errno == errno.EADDRINUSE:
                    raise ExecutionError("port-in-use", f"port {self.port} of {self.host} (the launchers' link, "
                                         f"--master-port + {LINK_PORT_OFFSET}) is already in use",
                                         hint="choose another --master-port (the same on every node)") from None
                raise ExecutionError("port-in-use", f"cannot listen on port {self.port} of {self.host} (the "
                                     f"launchers' link): {exc.strerror or exc}",
                                     hint="choose another --master-port (the same on every node)") from None
            sock.setblocking(False)
            self._listener = sock
            self._selector.register(sock, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="layout-prop-node-link", daemon=True)
        self._thread.start()

    def problem(self) -> LinkProblem | None:
        with self._lock:
            return self._problem

    def finish(self, failure: str | None) -> None:
        """Tell every connected node how this run ended (``done`` or ``fail LINE``), then close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        word = "done" if failure is None else "fail " + one_line(failure)[:1500]
        peers = [p for p in self.peers if p.node is not None and p.last_word is None]
        for peer in peers:
            try:
                peer.sock.setblocking(True)
                peer.sock.settimeout(1.0)
                peer.sock.sendall(word.encode("utf-8", "replace") + b"\n")
                peer.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        deadline = time.monotonic() + 1.0  # read until they close: closing with unread data would reset
        for peer in peers:  # the connection, and the peer could lose the last word
            try:
                while time.monotonic() < deadline:
                    peer.sock.settimeout(max(deadline - time.monotonic(), 0.01))
                    if not peer.sock.recv(4096):
                        break
            except OSError:
                pass
        for peer in self.peers:
            peer.sock.close()
        self.peers = []
        if self._listener is not None:
            self._listener.close()
        self._selector.close()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        next_beat = next_connect = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self.node_rank != 0 and not self.peers and 0 not in self.joined and now >= next_connect:
                next_connect = now + 0.5
                self._connect()
            try:
                events = self._selector.select(timeout=0.2)
            except OSError:
                events = []
            for key, _ in events:
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + _LINK_BEAT_SECONDS
                for peer in list(self.peers):
                    if peer.node is not None:
                        self._send(peer, "beat")
            for peer in list(self.peers):
                if peer.node is None and now - peer.opened > _LINK_HELLO_SECONDS:
                    self._drop(peer)
                elif peer.node is not None and now - peer.heard > _LINK_SILENCE_SECONDS:
                    self._lost(peer, f"its launcher sent no heartbeat for {_LINK_SILENCE_SECONDS:g} s (its machine "
                               "stopped, or the network between the nodes failed)")

    def _connect(self) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=1.0)
        except (OSError, UnicodeError):
            return  # node 0's launcher is not listening yet: try again
        sock.setblocking(False)
        now = time.monotonic()
        peer = _Peer(sock, f"{self.host}:{self.port}", now)  # node 0 once it answers hello
        self.peers.append(peer)
        self._selector.register(sock, selectors.EVENT_READ, peer)
        self._send(peer, f"hello {self.node_rank} {self.nodes} {self.ranks}")

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except OSError:
            return
        if sum(p.node is None for p in self.peers) >= _LINK_MAX_STRANGERS:
            sock.close()
            return
        sock.setblocking(False)
        peer = _Peer(sock, f"{address[0]}:{address[1]}", time.monotonic())
        self.peers.append(peer)
        self._selector.register(sock, selectors.EVENT_READ, peer)

    def _read(self, peer: _Peer) -> None:
        if peer not in self.peers:
            return
        try:
            data = peer.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""  # reset: closed without a word
        if not data:
            self._closed(peer)
            return
        peer.heard = time.monotonic()
        peer.buffer += data
        while b"\n" in peer.buffer and peer in self.peers:
            line, peer.buffer = peer.buffer.split(b"\n", 1)
            self._line(peer, printable(line.decode("utf-8", "replace")).strip())
        if len(peer.buffer) > _LINK_MAX_LINE and peer in self.peers:
            self._closed(peer)

    def _line(self, peer: _Peer, line: str) -> None:
        word, _, rest = line.partition(" ")
        if peer.node is None:  # nothing but hello (and node 0's refusal) is read before hello
            if word == "hello" and self.node_rank == 0:
                self._hello(peer, rest.split())
            elif word == "hello" and rest.split()[:1] == ["0"]:  # node 0's launcher answered
                peer.node = 0
                self.joined.add(0)
            elif word == "refuse" and self.node_rank != 0:
                self._set(LinkProblem("bad-nodes", f"node 0's launcher ({self.host}) refused this one",
                                       rest[:500], "run the same spec and flags on every node, each with "
                                       "its own --node-rank", time.monotonic()))
                self._drop(peer)
            return
        if word == "fail":
            peer.last_word = "fail"
            self._set(LinkProblem("node-lost", f"{self.describe(peer.node)} failed", rest[:1500],
                                   f"read node {peer.node}'s own error line (and its run folder's logs/), then run "
                                   "again on every node", time.monotonic()))
            self._drop(peer)
        elif word == "done":
            peer.last_word = "done"
            self._drop(peer)

    def _hello(self, peer: _Peer, numbers: list[str]) -> None:
        """Node 0: a launcher says which node it is."""
        if len(numbers) != 3 or not all(n.isdigit() and len(n) < 10 for n in numbers):
            self._drop(peer)  # not a launcher of ours: ignored
            return
        node, nodes, ranks = (int(n) for n in numbers)
        refusal = code = None
        if nodes != self.nodes or ranks != self.ranks:
            code = "bad-nodes"
            refusal = f"it runs {nodes} nodes of {ranks} ranks, node 0 {self.nodes} nodes of {self.ranks} ranks"
        elif not 1 <= node < self.nodes:
            code = "bad-node-rank"
            refusal = f"it says it is node {node}, not one of the nodes 1 to {self.nodes - 1}"
        elif node in self.joined:
            code = "bad-node-rank"
            refusal = f"it says it is node {node}, as another launcher did before"
        if refusal is not None:
            self._send(peer, f"refuse {refusal}")
            self._set(LinkProblem(code, f"node 0 refused the launcher at {peer.address}", refusal,
                                   "run the same spec and flags on every node, each with its own --node-rank",
                                   time.monotonic()))
            self._drop(peer)
            return
        peer.node = node
        self.joined.add(node)
        self._send(peer, f"hello 0 {self.nodes} {self.ranks}")

    def _send(self, peer: _Peer, line: str) -> None:
        try:
            peer.sock.send(line.encode("utf-8", "replace") + b"\n")
        except BlockingIOError:
            pass  # a peer that does not read: its silence is judged on its side
        except OSError:
            self._closed(peer)

    def _closed(self, peer: _Peer) -> None:
        """The peer's connection ended: a lost node unless it said its last word."""
        if peer.node is not None and peer.last_word is None:
            self._lost(peer, "its launcher's connection closed without a last word (its layout-prop was killed, "
                       "or its machine ended it)")
        else:
            self._drop(peer)

    def _lost(self, peer: _Peer, why: str) -> None:
        self._set(LinkProblem("node-lost", f"{self.describe(peer.node)} was lost", why,
                               f"see what happened on node {peer.node} (its error line, or its run folder's logs/), "
                               "then run again on every node", time.monotonic()))
        self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        if peer in self.peers:
            self.peers.remove(peer)
            try:
                self._selector.unregister(peer.sock)
            except (KeyError, ValueError):
                pass
            peer.sock.close()

    def _set(self, problem: LinkProblem) -> None:
        with self._lock:
            if self._problem is None:
                self._problem = problem
