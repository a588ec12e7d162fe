"""Multi-node msrun runs (issue 19), played as several nodes on this one machine.

``--emulate-nodes N`` starts N msruns here (master 127.0.0.1, a free port), each node with
its own private run folder and no file shared: the results reach every node over the
collective backend.  Two separate ``layout-prop`` launchers with ``--nodes 2 --node-rank K
--master-addr 127.0.0.1`` play two machines exactly as a cluster would run them.

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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def test_a_dead_worker_on_another_machine_ends_both_launchers(tmp_path):
    """Node 1's launcher names the killed rank at once; node 0's workers wait in a collective until
    MindSpore's scheduler misses the dead worker's heartbeats (about 30 s) and ends them: node 0 says
    which node it lost (or, on a machine too loaded for that within the timeout, which node it waited for)."""
    tag = new_tag()
    env = dict(os.environ, TMPDIR=str(tmp_path), **{TAG_ENV: tag, "LAYOUT_PROP_PAUSE_AFTER_INIT": "20"})
    command = [sys.executable, "-m", "layout_prop.cli", "run", str(EXAMPLES / "dp_tp.yaml"), "--engine", "mindspore",
               "--nodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--timeout", "90"]
    nodes = [subprocess.Popen(command + ["--node-rank", str(k)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    killer = WorkerKiller(tag, rank=3, ready=lambda: len(list(tmp_path.glob("*/rank*.paused"))) == 4)
    killer.run()  # in this thread: waits until every rank joined and paused, then kills rank 3
    assert killer.killed_at is not None
    (_, err0), (_, err1) = (node.communicate(timeout=120) for node in nodes)
    assert [node.returncode for node in nodes] == [2, 2]
    assert err1.startswith(f"layout-prop: error: worker-failed: rank 3 (pid {killer.pid}) was killed by SIGKILL")
    lost = re.match(r"layout-prop: error: node-lost: msrun's scheduler lost a worker of another node \(The node: "
                    r"\S+ is timed out.*\): node 1 \(ranks 2-3\) died or stalled \(its launcher names the rank\); "
                    r"MindSpore then ended this node's workers \(", err0)
    waited = err0.startswith("layout-prop: error: engine-timeout: msrun did not finish within the timeout of 90 s; "
                             "ranks [0, 1] (node 0) did not finish; they waited for the other nodes: node 1 (ranks "
                             "2-3) died or stalled")
    assert lost or waited, err0
    assert len(err0.strip().splitlines()) == len(err1.strip().splitlines()) == 1
    assert wait_until_none_left(tag) == []
