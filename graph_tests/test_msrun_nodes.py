"""Multi-node msrun runs (issue 19), played as several nodes on this one machine.

``--emulate-nodes N`` starts N msruns here (master 127.0.0.1, a free port), each node with
its own private run folder and no file shared: the results reach every node over the
collective backend.  Two separate ``layout-prop`` launchers with ``--nodes 2 --node-rank K
--master-addr 127.0.0.1`` play two machines exactly as a cluster would run them; they watch each
other over their link (node 0's launcher, master port + 1), so a launcher killed or a node's run
failing ends the other within a second.

msrun runs are slow on 2 cores (RPE 2 x 2 about 25 s, the Llama block 2 x 4 about 45 s);
the refusals before launch take a second each.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

mindspore = pytest.importorskip("mindspore")

from layout_prop.core.errors import ExecutionError  # noqa: E402
from layout_prop.engines.msrun_engine import format_node_map, node_map  # noqa: E402
from layout_prop.io.loader import load_spec  # noqa: E402
from layout_prop.core.mesh import DeviceMesh  # noqa: E402
from layout_prop.frontends.generate import llama_spec  # noqa: E402
from layout_prop.runner import run_graph  # noqa: E402

from .msrun_support import TAG_ENV, WorkerKiller, new_tag, wait_until_none_left  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "rpe"


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layout_prop.cli", *args], capture_output=True, text=True,
                          timeout=200, env=env)


def free_port() -> int:
    """A free port P whose P + 1 (the launchers' link of a master port P) is free too."""
    while True:
        with socket.socket() as sock, socket.socket() as link:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            try:
                link.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def tcp_ports(state: str) -> set[int]:
    """The local ports of this machine's IPv4 TCP sockets in ``state`` (``/proc/net/tcp``: 01 established, 06
    TIME-WAIT, 0A listening)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return {int(row[1].split(":")[1], 16) for row in rows if row[3] == state}


# --------------------------------------------------------------------------- the mapping, without msrun
def test_innermost_mesh_axes_stay_inside_a_node():
    mesh = DeviceMesh((2, 2, 2), ("dp", "sp", "tp"))
    entries = node_map(mesh, 4, 2)
    assert [e["ranks"] for e in entries] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(e["coords"]["tp"] == [0, 1] for e in entries)  # every tp group is inside one node
    assert [(e["coords"]["dp"], e["coords"]["sp"]) for e in entries] == [([0], [0]), ([0], [1]), ([1], [0]),
                                                                         ([1], [1])]
    assert format_node_map(entries)[3] == "node 3: ranks 6-7 (dp=1, sp=1, tp=0..1)"


@pytest.mark.parametrize("flags, code", [
    (["--emulate-nodes", "3"], "bad-nodes: 3 node(s) x 1 worker(s) = 3 ranks, but the mesh has 4"),
    (["--nodes", "2", "--local-workers", "4", "--master-addr", "127.0.0.1"],
     "bad-nodes: 2 node(s) x 4 worker(s) = 8 ranks, but the mesh has 4"),
    (["--nodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"],
     "bad-node-rank: --node-rank 2 is not a node of 2 (0 to 1)"),
    (["--nodes", "2"], "bad-nodes: 2 nodes need --master-addr"),
    (["--emulate-nodes", "2", "--node-rank", "1"], "bad-nodes: --emulate-nodes runs every node here"),
    (["--nodes", "2", "--master-addr", "127.0.0.1", "--master-port", "80"], "bad-port: --master-port 80 is not"),
])
def test_unusable_node_flags_exit_2_with_one_line(flags, code):
    done = cli("run", str(EXAMPLES / "dp_tp.yaml"), "--engine", "mindspore", *flags)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith(f"layout-prop: error: {code}")
    assert done.stdout == ""


@pytest.mark.parametrize("flags", [["--emulate-nodes", "2"], ["--master-port", "99999"], ["--node-rank", "5"],
                                   ["--local-workers", "2"], ["--timeout", "5"], ["--keep-logs"]],
                         ids=["emulate", "port", "node-rank", "workers", "timeout", "keep-logs"])
def test_engine_flags_need_the_mindspore_engine(flags):
    # all but the first ran on the simulator as if they were not there (found by new-user audits)
    done = cli("run", str(EXAMPLES / "dp_tp.yaml"), *flags)
    assert done.returncode == 2
    assert done.stderr.strip() == ("layout-prop: error: bad-usage: --timeout, --keep-logs, --nodes, --emulate-nodes, "
                                   "--master-addr, --master-port, --node-rank and --local-workers need --engine "
                                   "mindspore (the simulator runs in this process) (hint: add --engine mindspore, or "
                                   "drop them)")


def test_the_port_probe_accepts_a_port_in_time_wait_and_refuses_a_listener():
    """Right after a run, the master port is held by TIME-WAIT sockets only: MindSpore binds it (SO_REUSEADDR),
    so the probe must too (it said port-in-use); a listener on it is still refused."""
    from layout_prop.engines.msrun_engine import check_port_free

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as MindSpore's scheduler: Linux lets a
        listener.bind(("127.0.0.1", 0))  # bind pass a TIME-WAIT socket only if both set it
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        server, _ = listener.accept()
        server.close()  # this side closes first: its socket, on the port, waits in TIME-WAIT
        time.sleep(0.05)
        client.close()
    deadline = time.monotonic() + 5
    while port not in tcp_ports("06") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert port in tcp_ports("06") and port not in tcp_ports("0A")
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # the probe without SO_REUSEADDR: EADDRINUSE
    check_port_free("127.0.0.1", port)  # accepted
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        with pytest.raises(ExecutionError) as info:
            check_port_free("127.0.0.1", port)
    assert str(info.value) == (f"port-in-use: port {port} of 127.0.0.1 is already in use (hint: choose another "
                               f"--master-port (the same on every node))")


def test_a_master_addr_that_is_not_node_0s_is_refused_before_anything_starts(tmp_path):
    done = cli("run", str(EXAMPLES / "dp_tp.yaml"), "--engine", "mindspore", "--nodes", "2", "--node-rank", "0",
               "--master-addr", "203.0.113.7", env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("layout-prop: error: bad-master-addr: --master-addr 203.0.113.7 is not an address of "
                               "this machine, which runs msrun's scheduler as node 0; this machine's addresses: "
                               "127.0.0.0/8")
    assert lines[0].endswith("(hint: on node 0, give one of its own addresses as --master-addr (the same on every "
                             "node), or run --node-rank 0 on the machine that has this address)")
    assert list(tmp_path.iterdir()) == []  # refused before any run folder


def test_a_port_in_use_on_the_master_exits_2(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = cli("run", str(EXAMPLES / "dp_tp.yaml"), "--engine", "mindspore", "--nodes", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(port), env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"layout-prop: error: port-in-use: port {port} of 127.0.0.1 is "
                                                f"already in use (hint: choose another --master-port (the same on "
                                                f"every node))"]
    assert list(tmp_path.iterdir()) == []  # refused before any run folder


# --------------------------------------------------------------------------- msrun runs
def test_rpe_dp_tp_on_2_emulated_nodes_of_2_workers(tmp_path, monkeypatch):
    tag = new_tag()
    monkeypatch.setenv(TAG_ENV, tag)
    report = run_graph(load_spec(EXAMPLES / "dp_tp.yaml"), engine="mindspore", backward=True, timeout=200,
                       run_dir=tmp_path, emulate_nodes=2)
    assert report.ok, report.mismatches
    assert report.ranks == 4 and sorted(report.grads) == ["cos", "sin", "x"]
    assert report.extra["node_map"] == ["node 0: ranks 0-1 (dp=0, tp=0..1)", "node 1: ranks 2-3 (dp=1, tp=0..1)"]
    assert len(report.extra["per_rank_seconds"]) == 4  # node 1's timings came over the collective too
    assert report.extra["run_dir"] is None and list(tmp_path.iterdir()) == []  # both nodes' folders removed
    assert wait_until_none_left(tag) == []


def test_llama_block_forward_and_backward_on_2_emulated_nodes_of_4(tmp_path):
    spec = llama_spec(1, mesh=(("dp", 2), ("sp", 2), ("tp", 2)))
    report = run_graph(load_spec(spec), engine="mindspore", backward=True, timeout=300, run_dir=tmp_path,
                       emulate_nodes=2)
    assert report.ok, report.mismatches
    assert report.ranks == 8 and len(report.grads) == 10
    assert report.extra["node_map"][1] == "node 1: ranks 4-7 (dp=1, sp=0..1, tp=0..1)"
    assert list(tmp_path.iterdir()) == []


def test_worker_killed_on_node_1_ends_both_nodes_naming_it(tmp_path, monkeypatch):
    tag = new_tag()
    monkeypatch.setenv(TAG_ENV, tag)
    killer = WorkerKiller(tag, rank=3, delay=2.0)
    killer.start()
    with pytest.raises(ExecutionError) as info:
        run_graph(load_spec(EXAMPLES / "dp_tp.yaml"), engine="mindspore", timeout=200, run_dir=tmp_path,
                  emulate_nodes=2)
    noticed = time.monotonic()
    killer.join(5)
    assert killer.killed_at is not None and noticed - killer.killed_at < 30
    err = info.value
    assert err.code == "worker-failed" and "\n" not in str(err)
    assert err.message.startswith(f"node 1: rank 3 (pid {killer.pid}) was killed by SIGKILL (signal 9) ")
    folders = sorted(tmp_path.iterdir())
    assert len(folders) == 2 and all(str(folder) in err.message for folder in folders)  # kept, named
    assert wait_until_none_left(tag) == []


def test_two_launchers_play_two_machines(tmp_path):
    """The same command on both "machines": node 0 prints the report, node 1 one line; both exit 0."""
    tag = new_tag()
    env = dict(os.environ, TMPDIR=str(tmp_path), **{TAG_ENV: tag})
    command = [sys.executable, "-m", "layout_prop.cli", "run", str(EXAMPLES / "dp_tp.yaml"), "--engine", "mindspore",
               "--backward", "--nodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    nodes = [subprocess.Popen(command + ["--node-rank", str(k)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (1, 0)]
    (out1, err1), (out0, err0) = (node.communicate(timeout=300) for node in nodes)
    assert [node.returncode for node in nodes] == [0, 0], (err0, err1)
    assert out1 == "node 1 of 2: matches one device (the report is printed on node 0)\n"
    lines = out0.splitlines()
    assert lines[:3] == ["engine mindspore, 4 ranks", "  node 0: ranks 0-1 (dp=0, tp=0..1)",
                         "  node 1: ranks 2-3 (dp=1, tp=0..1)"]
    assert "  grad x: max abs err 0, max rel err 0" in lines and lines[-1] == "matches one device"
    assert err0 == err1 == ""
    assert list(tmp_path.iterdir()) == []
    assert wait_until_none_left(tag) == []


def test_sigterm_to_an_emulated_multi_node_run_ends_every_node(tmp_path):
    from .msrun_support import environ, tagged_processes

    tag = new_tag()
    env = dict(os.environ, TMPDIR=str(tmp_path), **{TAG_ENV: tag})
    process = subprocess.Popen([sys.executable, "-m", "layout_prop.cli", "run", str(EXAMPLES / "dp_tp.yaml"),
                                "--engine", "mindspore", "--emulate-nodes", "2"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        workers = [p for p in tagged_processes(tag) if environ(p).get("MS_ROLE") == "MS_WORKER"]
        if len(workers) == 4:
            break
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGTERM
    assert len(stderr.strip().splitlines()) == 1 and "SIGTERM received" in stderr
    assert wait_until_none_left(tag) == []


def test_share_results_gives_every_rank_every_piece_bit_for_bit():
    """Three ranks in threads; the all-reduce is the sum of their buffers (uneven pieces, -0.0, nan, bool)."""
    import threading

    import numpy as np

    from layout_prop.engines.msrun_worker import share_results
    from layout_prop.core.layout import Layout
    from layout_prop.passes.lower import Program
    from layout_prop.core.placement import Replicate, Shard
    from layout_prop.core.spec import TensorSpec

    mesh = DeviceMesh((3,), ("dp",))
    specs = {"y": TensorSpec((4, 2), "float32", Layout(mesh, (Shard(0),), 2)),  # pieces of 2, 2, 0 rows
             "m": TensorSpec((3,), "bool", Layout(mesh, (Replicate(),), 1))}
    program = Program(mesh, specs=specs, outputs={"y": "y", "m": "m"})
    y = np.array([[1.5, -0.0], [np.nan, 2.0], [3.0, 4.0], [5.0, -6.0]], np.float32)
    pieces = {0: [y[0:2], np.array([True, False, True])], 1: [y[2:4], np.array([True, False, True])],
              2: [y[4:4], np.array([True, False, True])]}
    buffers, barrier, out = {}, threading.Barrier(3, timeout=20), {}

    def run(rank):
        def world_sum(buffer):
            buffers[rank] = buffer
            barrier.wait()
            total = sum(buffers[r] for r in range(3))
            barrier.wait()
            return total

        out[rank] = share_results(program, rank, ["y", "m"], pieces[rank], {"rank": rank, "s": [0.5]}, world_sum)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(out) == [0, 1, 2]
    for rank in range(3):
        got, infos = out[rank]
        assert infos == [{"rank": r, "s": [0.5]} for r in range(3)]
        for k in range(2):
            for r in range(3):
                want = pieces[r][k]
                assert got[k][r].dtype == want.dtype and got[k][r].shape == want.shape
                assert got[k][r].tobytes() == want.tobytes()


def test_a_node_that_never_joins_is_named_at_the_timeout(tmp_path):
    tag = new_tag()
    env = dict(os.environ, TMPDIR=str(tmp_path), **{TAG_ENV: tag})
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "layout_prop.cli", "run", str(EXAMPLES / "dp_tp.yaml"), "--engine",
                           "mindspore", "--nodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                           "--master-port", str(free_port()), "--timeout", "15"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert time.monotonic() - start < 15 + 30  # start-up (slow on a loaded machine), the timeout, the kill
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("layout-prop: error: engine-timeout: msrun did not finish within the timeout of 15 s; "
                               "ranks [0, 1] (node 0) did not finish; the cluster never formed: node 1 (ranks 2-3) "
                               "never joined 127.0.0.1 (killed); run folder ")
    assert wait_until_none_left(tag) == []


def test_a_killed_launcher_on_another_machine_is_named_within_seconds(tmp_path):
    """Node 1's layout-prop SIGKILLed while the run goes: node 0's launcher sees its link close and names node 1
    at once (it used to wait for its --timeout, 300 s by default, and then say node 1 "never joined")."""
    tag = new_tag()
    env = dict(os.environ, TMPDIR=str(tmp_path), **{TAG_ENV: tag})
    port = free_port()
    command = [sys.executable, "-m", "layout_prop.cli", "run", str(EXAMPLES / "dp_b.yaml"), "--engine", "mindspore",
               "--nodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout", "60"]
    nodes = [subprocess.Popen(command + ["--node-rank", str(k)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    deadline = time.monotonic() + 60
    while not (port + 1 in tcp_ports("01") and list(tmp_path.glob("*/rank1.joined"))) and time.monotonic() < deadline:
        time.sleep(0.05)  # node 1's launcher is linked to node 0's, and its worker joined MindSpore's cluster
    assert nodes[0].poll() is None and nodes[1].poll() is None
    nodes[1].kill()
    killed = time.monotonic()
    _, err0 = nodes[0].communicate(timeout=60)
    noticed = time.monotonic() - killed
    nodes[1].communicate(timeout=10)
    assert nodes[0].returncode == 2 and noticed < 5, (noticed, err0)
    assert len(err0.strip().splitlines()) == 1
    assert re.fullmatch(r"layout-prop: error: node-lost: node 1 \(rank 1\) was lost [0-9.]+ s after the launch: its "
                        r"launcher's connection closed without a last word \(its layout-prop was killed, or its "
                        r"machine ended it\); every process of this node's run was killed; run folder \S+ \(hint: "
                        r"see what happened on node 1 \(its error line, or its run folder's logs/\), then run "
                        r"again on every node\)", err0.strip()), err0
    assert wait_until_none_left(tag) == []


def test_the_launchers_link_without_msrun(monkeypatch):
    """The link's own cases, in one process: a last word "done" is no loss, a silent launcher is lost, a launcher
    of another run shape is refused on both sides."""
    from layout_prop.engines import msrun_link

    monkeypatch.setattr(msrun_link, "_LINK_SILENCE_SECONDS", 1.5)
    port = free_port()

    def link(node, nodes=2):
        made = msrun_link.NodeLink(node, nodes, 4, "127.0.0.1", port, lambda k: f"node {k}")
        made.open()
        return made

    def wait(until):
        deadline = time.monotonic() + 10
        while not until() and time.monotonic() < deadline:
            time.sleep(0.02)

    hub, spoke = link(0), link(1)
    wait(lambda: hub.joined and spoke.joined)
    spoke.finish(None)
    time.sleep(0.3)
    assert hub.joined == {1} and hub.problem() is None
    hub.finish(None)

    hub, spoke = link(0), link(1)
    wait(lambda: hub.joined)
    spoke._stop.set()  # its thread stops beating, its connection stays open
    spoke._thread.join()
    wait(hub.problem)
    assert (hub.problem().what, hub.problem().why) == ("node 1 was lost", "its launcher sent no heartbeat for 1.5 s "
                                                       "(its machine stopped, or the network between the nodes failed)")
    hub.finish("done with it")
    spoke.finish(None)

    hub, spoke = link(0), link(1, nodes=3)
    wait(lambda: hub.problem() and spoke.problem())
    assert hub.problem().code == spoke.problem().code == "bad-nodes"
    assert spoke.problem().why == hub.problem().why == "it runs 3 nodes of 4 ranks, node 0 2 nodes of 4 ranks"
    hub.finish("refused")
    spoke.finish("refused")


def test_a_dead_worker_on_another_machine_ends_both_launchers(tmp_path):
    """Node 1's launcher names the killed rank at once and tells node 0's over their link; node 0 names node 1
    and its error within seconds (its workers, waiting in a collective, used to wait until MindSpore's scheduler
    missed the dead worker's heartbeats, about 30 s)."""
    tag = new_tag()
    env = dict(os.environ, TMPDIR=str(tmp_path), **{TAG_ENV: tag, "LAYOUT_PROP_PAUSE_AFTER_INIT": "20"})
    command = [sys.executable, "-m", "layout_prop.cli", "run", str(EXAMPLES / "dp_b.yaml"), "--engine", "mindspore",
               "--nodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--timeout", "60"]
    nodes = [subprocess.Popen(command + ["--node-rank", str(k)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    killer = WorkerKiller(tag, rank=1, ready=lambda: len(list(tmp_path.glob("*/rank*.paused"))) == 2)
    killer.run()  # in this thread: waits until every rank joined and paused, then kills rank 1
    assert killer.killed_at is not None
    (_, err0), (_, err1) = (node.communicate(timeout=60) for node in nodes)
    noticed = time.monotonic() - killer.killed_at
    assert [node.returncode for node in nodes] == [2, 2]
    assert noticed < 10, (noticed, err0)
    died = f"worker-failed: rank 1 (pid {killer.pid}) was killed by SIGKILL (signal 9) "
    assert err1.startswith(f"layout-prop: error: {died}")
    assert re.match(r"layout-prop: error: node-lost: node 1 \(rank 1\) failed [0-9.]+ s after the launch: "
                    + re.escape(died), err0), err0
    assert "every process of this node's run was killed; run folder " in err0
    assert len(err0.strip().splitlines()) == len(err1.strip().splitlines()) == 1
    assert wait_until_none_left(tag) == []
