"""The msrun engine against a hostile local user, bad flags, a full disk, killed workers and signals.

Issue 14: the engine used to keep its runs under a fixed ``<tmp>/layout-prop-runs``, where
another local user could plant the pickled job its workers load; a worker killed early
made it wait for the whole timeout, a late one was blamed on the wrong rank, and SIGTERM
left msrun, its scheduler, the workers and a ``tail -f`` per worker running.

Fast tests (no msrun) first: the run folder checks (the folders above it too), the job's
HMAC, the ``--timeout`` values, the worker limit, a disk that refuses the job, the removal
of stale run folders.  Then the msrun runs (2 or 8 ranks, each a few seconds to half a
minute on 2 cores): planted run folders and jobs left unused, a worker killed
early and one killed late (named with rank and signal within 30 s), SIGTERM, SIGKILL of
msrun and of ``layout-prop``.  Every msrun test lists the run's processes by an
environment tag (see :mod:`graph_tests.msrun_support`) and requires none left.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

mindspore = pytest.importorskip("mindspore")

from layout_prop.api import analyze  # noqa: E402
from layout_prop.core.errors import ExecutionError  # noqa: E402
from layout_prop.engines import msrun_worker  # noqa: E402
from layout_prop.engines.msrun_engine import (  # noqa: E402
    LAUNCHER_FILE,
    RUN_PREFIX,
    MsrunEngine,
    check_runs_root,
    remove_stale_runs,
)
from layout_prop.engines.msrun_worker import PAUSE_ENV, check_private_folder, read_job, write_job  # noqa: E402
from layout_prop.io.loader import load_spec  # noqa: E402
from layout_prop.passes.lower import Lower  # noqa: E402
from layout_prop.runner import random_inputs, run_graph  # noqa: E402

from .msrun_support import TAG_ENV, WorkerKiller, new_tag, tagged_processes, wait_until_none_left  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "rpe"
OTHER_UID = 12345
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


class Planted:
    """What an attacker's pickle does when it is loaded: create a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def dp_b_program():
    graph = analyze(load_spec(EXAMPLES / "dp_b.yaml")).graph
    return graph, Lower().run(graph).program


def cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layout_prop.cli", *args], capture_output=True, text=True,
                          timeout=200, env=env, **kwargs)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


# --------------------------------------------------------------------------- run folders, without msrun
@as_root
def test_run_dir_of_another_user_is_refused_before_anything_is_written(tmp_path):
    planted = tmp_path / "shared"
    planted.mkdir()
    os.chown(planted, OTHER_UID, OTHER_UID)
    graph, program = dp_b_program()
    with pytest.raises(ExecutionError) as info:
        MsrunEngine(run_dir=planted).execute(program, random_inputs(graph, 0))
    assert info.value.code == "unsafe-run-dir"
    assert f"is owned by uid {OTHER_UID}, not by this user (uid 0)" in info.value.message
    assert list(planted.iterdir()) == []


def test_run_dir_writable_by_others_or_a_symlink_is_refused(tmp_path):
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(ExecutionError) as info:
        check_runs_root(open_folder)
    assert info.value.code == "unsafe-run-dir"
    assert "has mode 777: group or others can write to it" in info.value.message
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ExecutionError) as info:
        check_runs_root(link)
    assert "it is a symbolic link" in info.value.message
    check_runs_root(tmp_path)  # pytest's own tmp_path: ours, mode 700


def test_sticky_world_writable_temp_folder_is_accepted_only_as_the_system_default(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    check_runs_root(sticky, user_given=False)  # as /tmp: mkdtemp makes a private folder in it
    with pytest.raises(ExecutionError):
        check_runs_root(sticky, user_given=True)


@pytest.mark.parametrize("user_given", [True, False], ids=["run_dir", "TMPDIR"])
def test_a_folder_above_the_runs_root_that_others_can_write_is_refused(tmp_path, user_given):
    # review of issue 14: only the last component was checked; whoever can write to a folder
    # above it (without the sticky bit) can rename the runs root away and put theirs there
    open_folder = tmp_path / "open"
    runs = open_folder / "mine" / "runs"
    runs.mkdir(parents=True, mode=0o700)
    (open_folder / "mine").chmod(0o700)
    open_folder.chmod(0o777)
    with pytest.raises(ExecutionError) as info:
        check_runs_root(runs, user_given=user_given)
    assert info.value.code == "unsafe-run-dir"
    assert (f"the folder '{open_folder}' above it has mode 777: others can write to it (no sticky bit), so others "
            "could move it") in info.value.message
    open_folder.chmod(0o1777)  # sticky, as /tmp: nobody can move our folder out of it
    check_runs_root(runs, user_given=user_given)
    open_folder.chmod(0o775)
    os.chown(open_folder, -1, os.getegid() + 1)  # writable by a group that is not ours
    with pytest.raises(ExecutionError) as info:
        check_runs_root(runs, user_given=user_given)
    assert f"group {os.getegid() + 1} can write to it" in info.value.message
    os.chown(open_folder, -1, os.getegid())
    check_runs_root(runs, user_given=user_given)  # our own group (a user private group)


@as_root
def test_a_folder_or_link_above_the_runs_root_owned_by_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    runs = theirs / "runs"
    runs.mkdir(parents=True, mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(ExecutionError) as info:
        check_runs_root(runs)
    assert f"the folder '{theirs}' above it belongs to uid {OTHER_UID}" in info.value.message
    os.chown(theirs, 0, 0)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    link = shared / "tmp"  # a link planted in a sticky folder, leading to a folder that looks fine
    link.symlink_to(theirs)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(ExecutionError) as info:
        check_runs_root(link / "runs")
    assert f"the symbolic link '{link}' above it belongs to uid {OTHER_UID}" in info.value.message


def _run_folder(root: Path, launcher: dict | None) -> Path:
    """A run folder as the launcher makes it, recording ``launcher`` (None: a kept failed run's)."""
    import json

    run = Path(tempfile.mkdtemp(prefix=RUN_PREFIX + "20250101-000000-", dir=root))
    (run / "logs").mkdir()
    (run / "logs" / "worker_0.log").write_text("log\n")
    if launcher is not None:
        (run / LAUNCHER_FILE).write_text(json.dumps(launcher))
    return run


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_later_run_removes_the_folders_of_launchers_killed_by_sigkill_and_nothing_else(tmp_path):
    # review of issue 14: a SIGKILL of layout-prop left its run folder behind for ever
    from layout_prop.engines.procfs import boot_id, start_time

    me = {"pid": os.getpid(), "start": start_time(os.getpid()), "boot": boot_id()}
    stale = _run_folder(tmp_path, {**me, "pid": _dead_pid()})
    rebooted = _run_folder(tmp_path, {**me, "boot": "another-boot"})  # this pid, but before a restart
    reused = _run_folder(tmp_path, {**me, "start": "1"})  # this pid, but another process's start time
    running = _run_folder(tmp_path, me)  # a launcher that still runs (this test)
    failed = _run_folder(tmp_path, None)  # a failed run's folder, kept for its logs
    opened = _run_folder(tmp_path, {**me, "pid": _dead_pid()})
    opened.chmod(0o755)  # not made by mkdtemp: not clearly ours
    other_name = tmp_path / "my-own-folder"
    other_name.mkdir(mode=0o700)
    (other_name / LAUNCHER_FILE).write_text('{"pid": %d}' % _dead_pid())
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    link = tmp_path / (RUN_PREFIX + "link")
    link.symlink_to(outside)
    os.symlink(tmp_path / "nowhere", tmp_path / (RUN_PREFIX + "dangling"))
    linked_marker = _run_folder(tmp_path, None)
    (linked_marker / LAUNCHER_FILE).symlink_to(stale / LAUNCHER_FILE)  # a marker that is a link: not ours
    removed = remove_stale_runs(tmp_path)
    assert sorted(removed) == sorted([stale, rebooted, reused])
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {running.name, failed.name, opened.name, other_name.name, "outside", link.name,
                    RUN_PREFIX + "dangling", linked_marker.name}
    assert (outside / "precious").exists()
    # and the engine does it before it makes its own run folder
    stale = _run_folder(tmp_path, {**me, "pid": _dead_pid()})
    run = MsrunEngine(run_dir=tmp_path)._new_run_folder()
    assert not stale.exists() and run.exists()
    assert json.loads((run / LAUNCHER_FILE).read_text()) == me


@as_root
def test_another_users_stale_run_folder_is_never_removed(tmp_path):
    theirs = _run_folder(tmp_path, {"pid": _dead_pid()})
    os.chown(theirs / LAUNCHER_FILE, OTHER_UID, OTHER_UID)
    mixed = _run_folder(tmp_path, {"pid": _dead_pid()})
    for path in (theirs, mixed):
        os.chown(path, OTHER_UID, OTHER_UID)
    os.chown(mixed / LAUNCHER_FILE, 0, 0)
    ours_with_their_marker = _run_folder(tmp_path, {"pid": _dead_pid()})
    os.chown(ours_with_their_marker / LAUNCHER_FILE, OTHER_UID, OTHER_UID)
    assert remove_stale_runs(tmp_path) == []
    assert theirs.exists() and mixed.exists() and ours_with_their_marker.exists()


def test_job_with_a_wrong_hmac_is_never_unpickled(tmp_path):
    run = Path(tempfile.mkdtemp(dir=tmp_path))
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"program": Planted(marker)})
    (run / msrun_worker.JOB_FILE).write_bytes(b"\0" * 32 + payload)  # the attacker does not know the key
    with pytest.raises(ExecutionError) as info:
        read_job(run, os.urandom(32))
    assert info.value.code == "job-not-verified"
    assert not marker.exists()
    # the launcher's own job, with its key, reads back
    other = Path(tempfile.mkdtemp(dir=tmp_path))
    key = os.urandom(32)
    write_job(other, {"wanted": ["y"]}, key)
    assert read_job(other, key) == {"wanted": ["y"]}


@as_root
def test_worker_refuses_a_run_folder_it_does_not_own(tmp_path):
    run = Path(tempfile.mkdtemp(dir=tmp_path))
    key = os.urandom(32)
    marker = tmp_path / "pwned"
    write_job(run, {"program": Planted(marker)}, key)  # even with the right key
    os.chown(run, OTHER_UID, OTHER_UID)
    with pytest.raises(ExecutionError) as info:
        read_job(run, key)
    assert info.value.code == "unsafe-run-folder"
    assert f"is owned by uid {OTHER_UID}" in info.value.message
    assert not marker.exists()
    os.chown(run, 0, 0)
    run.chmod(0o750)
    with pytest.raises(ExecutionError) as info:
        check_private_folder(run)
    assert "has mode 750, open to group or others" in info.value.message


# --------------------------------------------------------------------------- flags and a full disk, without msrun
@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5", "1e9", "soon"])
def test_bad_timeouts_exit_2_with_one_line(value):
    done = cli("run", str(EXAMPLES / "dp_b.yaml"), "--engine", "mindspore", "--timeout", value)
    assert done.returncode == 2
    line = one_error_line(done)
    assert line.startswith("layout-prop: error: bad-usage: argument --timeout: ")
    assert done.stdout == ""


@pytest.mark.parametrize("mesh,flags,started", [
    ("[256, 256]", [], "65536 msrun worker processes on this machine (65536 workers)"),
    ("[257]", [], "257 msrun worker processes"),
    ("[2, 256]", ["--emulate-nodes", "2"], "512 msrun worker processes on this machine (2 emulated nodes x 256 "
     "workers)"),
], ids=["65536", "257", "emulated-512"])
def test_too_many_workers_are_refused_before_anything_starts(tmp_path, monkeypatch, capsys, mesh, flags, started):
    # review of issue 14: a 65,536-rank mesh would have started 65,536 msrun workers
    from layout_prop.cli import main
    from layout_prop.engines import msrun_engine

    def never(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(msrun_engine.subprocess, "Popen", never)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spec = tmp_path / "big.yaml"
    spec.write_text(f"mesh: {{shape: {mesh}}}\ninputs: {{x: {{shape: [4, 4]}}}}\n"
                    "nodes: [{name: y, op: neg, inputs: [x]}]\noutputs: [y]\n")
    start = time.perf_counter()
    assert main(["run", str(spec), "--engine", "mindspore", *flags]) == 2
    assert time.perf_counter() - start < 5  # before the analysis of the mesh's ranks, too
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and out == ""
    assert lines[0].startswith(f"layout-prop: error: too-many-workers: the run would start {started}")
    assert "over the limit 256 (hint: span machines with --nodes N" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.yaml"]  # no run folder


def test_the_worker_limit_counts_this_machines_workers_only():
    engine = MsrunEngine(nodes=256, node_rank=3, master_addr="10.0.0.1")
    assert engine.check_workers(65536) == 256  # 256 machines of 256 workers: each starts its own
    with pytest.raises(ExecutionError) as info:
        MsrunEngine(nodes=128, node_rank=3, master_addr="10.0.0.1").check_workers(65536)
    assert info.value.code == "too-many-workers"


def _small_files_only():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))


def test_disk_refusing_the_job_exits_2_and_leaves_no_folder(tmp_path):
    """A file-size limit of 2 KiB makes the job's write fail as a full disk would."""
    temp = tmp_path / "tmp"
    temp.mkdir(mode=0o700)
    env = dict(os.environ, TMPDIR=str(temp))
    done = cli("run", str(EXAMPLES / "dp_b.yaml"), "--engine", "mindspore", env=env, preexec_fn=_small_files_only)
    assert done.returncode == 2
    line = one_error_line(done)
    assert line.startswith(f"layout-prop: error: run-folder-failed: cannot write the run folder '{temp}/layout-prop-run-")
    assert "File too large (removed it)" in line
    assert list(temp.iterdir()) == []


# --------------------------------------------------------------------------- msrun runs
def test_planted_run_folders_and_jobs_are_not_used_and_success_leaves_nothing(tmp_path, monkeypatch):
    """What another local user can plant today, in the runs root: run folders named as the
    launcher names them, even the very name it will try first (the timestamp and the random
    part guessed), open to all and holding a forged job, forged inputs, a python shim and a
    launcher record; and the old fixed folder.  The run makes its own new folder beside them
    (mkdtemp never takes an existing name), touches none of them, and leaves nothing."""
    import itertools

    from layout_prop.engines import msrun_engine

    tag = new_tag()
    monkeypatch.setenv(TAG_ENV, tag)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(msrun_engine.time, "strftime", lambda fmt, *when: "20250101-000000")
    names = tempfile._get_candidate_names()
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: itertools.chain(["guessed1"], names))
    marker = tmp_path / "pwned"
    guessed = tmp_path / f"{RUN_PREFIX}20250101-000000-guessed1"  # the launcher's first candidate
    other = tmp_path / f"{RUN_PREFIX}20250101-000000-abcdefgh"
    old = tmp_path / "layout-prop-runs"
    for planted in (guessed, other, old):
        for folder in (planted, planted / "inputs", planted / "logs", planted / f"python-shim-{os.getpid()}"):
            folder.mkdir()
            folder.chmod(0o777)
        (planted / msrun_worker.JOB_FILE).write_bytes(b"\0" * 32 + pickle.dumps(Planted(marker)))  # a forged MAC
        (planted / "inputs" / "rank0.npz").write_bytes(b"forged")
        (planted / LAUNCHER_FILE).write_text('{"pid": %d}' % _dead_pid())  # "stale": yet not ours to remove
        (planted / f"python-shim-{os.getpid()}" / "python").write_text(f"#!/bin/sh\ntouch {marker}\n")
    if os.geteuid() == 0:
        for planted in (guessed, other, old):
            for path in (planted, *planted.rglob("*")):
                os.chown(path, OTHER_UID, OTHER_UID)
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    report = run_graph(load_spec(EXAMPLES / "dp_b.yaml"), engine="mindspore", timeout=120)
    assert report.ok, report.mismatches
    assert report.extra["run_dir"] is None  # its own folder, removed after success
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before  # nothing touched or left
    assert not marker.exists()
    assert wait_until_none_left(tag) == []


def _killed_worker_is_named(tmp_path, monkeypatch, rank: int, late: bool) -> None:
    tag = new_tag()
    monkeypatch.setenv(TAG_ENV, tag)
    if late:  # every worker initialised and connected, then waiting: the kill lands in a running cluster
        monkeypatch.setenv(PAUSE_ENV, "30")
        killer = WorkerKiller(tag, rank, delay=0.5, ready=lambda: len(list(tmp_path.glob("*/rank*.paused"))) == 8)
    else:  # three seconds after the worker started Python (MindSpore is still importing)
        killer = WorkerKiller(tag, rank, delay=3.0)
    killer.start()
    with pytest.raises(ExecutionError) as info:
        run_graph(load_spec(EXAMPLES / "dp_tp_sp.yaml"), engine="mindspore", timeout=300, run_dir=tmp_path)
    noticed = time.monotonic()
    killer.join(5)
    err = info.value
    assert killer.killed_at is not None
    assert noticed - killer.killed_at < 30
    assert err.code == "worker-failed"
    assert "\n" not in str(err)
    assert err.message.startswith(f"rank {rank} (pid {killer.pid}) was killed by SIGKILL (signal 9) ")
    run = next(tmp_path.iterdir())
    assert err.message.endswith(f"every other process of the run was killed; run folder {run}")
    assert wait_until_none_left(tag) == []


def test_worker_killed_early_is_named_at_once(tmp_path, monkeypatch):
    _killed_worker_is_named(tmp_path, monkeypatch, rank=5, late=False)


def test_worker_killed_in_a_running_cluster_is_the_one_named(tmp_path, monkeypatch):
    _killed_worker_is_named(tmp_path, monkeypatch, rank=2, late=True)


def _start_cli_run(tmp_path, tag: str, spec: str = "dp_b.yaml") -> subprocess.Popen:
    env = dict(os.environ, TMPDIR=str(tmp_path), **{TAG_ENV: tag})
    return subprocess.Popen([sys.executable, "-m", "layout_prop.cli", "run", str(EXAMPLES / spec),
                             "--engine", "mindspore"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_workers(tag: str, count: int, process: subprocess.Popen) -> list[int]:
    from .msrun_support import environ

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        pids = tagged_processes(tag)
        if sum(environ(p).get("MS_ROLE") == "MS_WORKER" for p in pids) >= count:
            return pids
        time.sleep(0.1)
    raise AssertionError("the workers did not start")


def test_sigterm_to_layout_prop_ends_every_process_of_the_run(tmp_path):
    tag = new_tag()
    process = _start_cli_run(tmp_path, tag)
    pids = _wait_for_workers(tag, 2, process)
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in pids]
    assert not any(argv[0].endswith(b"tail") for argv in commands)  # msrun starts no tail -f
    assert len(pids) >= 5  # layout-prop, msrun, the scheduler, 2 workers (maybe a helper msrun runs)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGTERM  # it ends by the signal it got, after cleaning up
    run = next(tmp_path.iterdir())
    assert stderr.strip().splitlines() == [f"layout-prop: SIGTERM received: every process of the msrun run was "
                                           f"killed; run folder {run}"]
    assert wait_until_none_left(tag) == []
    assert not (run / LAUNCHER_FILE).exists()  # kept for the user: never taken for a stale run
    assert remove_stale_runs(tmp_path) == [] and run.exists()


def test_sigkill_to_msrun_or_to_layout_prop_leaves_no_process(tmp_path):
    from .msrun_support import environ

    tag = new_tag()
    (tmp_path / "a").mkdir()
    process = _start_cli_run(tmp_path / "a", tag)
    pids = _wait_for_workers(tag, 2, process)
    msrun = [p for p in pids if b"--worker_num=2" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(msrun) == 1
    os.kill(msrun[0], signal.SIGKILL)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 2
    line = stderr.strip()
    assert line.startswith(f"layout-prop: error: worker-failed: msrun (pid {msrun[0]}) was killed by SIGKILL; ")
    assert "\n" not in line
    assert wait_until_none_left(tag) == []
    assert not (next((tmp_path / "a").iterdir()) / LAUNCHER_FILE).exists()  # a failed run's folder: kept
    # SIGKILL to layout-prop itself: nothing can catch it; the parent-death signal ends msrun and its workers
    tag = new_tag()
    (tmp_path / "b").mkdir()
    process = _start_cli_run(tmp_path / "b", tag)
    pids = _wait_for_workers(tag, 2, process)
    assert any(environ(p).get("MS_ROLE") == "MS_SCHED" for p in pids)
    process.kill()
    process.communicate(timeout=30)
    assert wait_until_none_left(tag, limit=5.0) == []
    # its folder is left (nothing ran to remove it); the next run of this user removes it
    run = next((tmp_path / "b").iterdir())
    assert (run / LAUNCHER_FILE).exists()
    assert remove_stale_runs(tmp_path / "b") == [run] and not run.exists()


def test_a_worker_dead_before_it_was_seen_is_named_from_msruns_log(tmp_path):
    """msrun's log names the pid; the one rank never seen running Python is the dead one."""
    from layout_prop.engines.msrun_watch import Child, RunWatch

    watch = RunWatch(msrun_pid=0, run=tmp_path, ranks=[4, 5], launched=time.monotonic())
    me = Path(f"/proc/{os.getpid()}/stat").read_text()
    watch.children[os.getpid()] = Child(os.getpid(), me[me.rfind(")") + 2:].split()[19], "worker", 4)  # alive
    assert watch.failure() is None
    (tmp_path / "msrun.log").write_text("[ERROR] ME(1:1,MainProcess):... Worker process 424242 exit with exception. "
                                        "Error code: -9.\n")
    assert watch.failure().startswith("rank 5 (pid 424242) was killed by SIGKILL (signal 9) ")
