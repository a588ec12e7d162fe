"""Hostile and careless user files and flags of issue 40: cluster profiles, spec blocks, plans.

Every user file is read by one reader (layout_prop/io/reader.py): the cases the spec loader
already refused are fed to the cluster loader too, and must be refused alike.  Everything runs
in-process through :func:`layout_prop.cli.main`; each case is exit 2 with one line on stderr.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import yaml

from layout_prop.cli import main
from layout_prop.core.errors import SpecError
from layout_prop.frontends.generate import gpt_spec
from layout_prop.perf.clusters import load_cluster


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "internal-error" not in err, err
    assert lines[0].startswith("layout-prop: error: "), err
    return lines[0]


def refused(capsys, argv: list[str], code: str, *fragments: str, seconds: float = 10.0) -> str:
    """``main(argv)`` exits 2 within ``seconds`` with one line naming ``code`` and each fragment."""
    start = time.perf_counter()
    rc = main(argv)
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    line = one_error_line(err)
    assert rc == 2, (rc, out, err)
    assert f"error: {code}" in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert elapsed < seconds, elapsed
    return line


def with_pp(spec: dict, pp: int, block: dict) -> dict:
    """``spec`` with a pipeline axis ``pp`` in front of its mesh and a ``pipeline:`` block."""
    return {**spec, "mesh": {"shape": [pp] + list(spec["mesh"]["shape"]), "names": ["pp"] + list(spec["mesh"]["names"])},
            "inputs": {name: {**entry, "placements": ["R"] + list(entry["placements"])}
                       for name, entry in spec["inputs"].items()},
            "nodes": [{**node, "attrs": {**node["attrs"], "placements": ["R"] + list(node["attrs"]["placements"])}}
                      if "placements" in node.get("attrs", {}) else node for node in spec["nodes"]],
            "pipeline": {"axis": "pp", **block}}


def small_gpt(**kwargs) -> dict:
    return gpt_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=4, dropout=0.0, dtype="float32", **kwargs)


@pytest.fixture
def pipe_spec(tmp_path) -> str:
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(with_pp(small_gpt(), 2, {"micro_batches": 2}), sort_keys=False))
    return str(path)


@pytest.fixture
def plain_spec(tmp_path) -> str:
    path = tmp_path / "gpt.yaml"
    path.write_text(yaml.safe_dump(small_gpt(), sort_keys=False))
    return str(path)


def write(tmp_path: Path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


# --------------------------------------------------------------------------- --cluster FILE everywhere
SLOW = ("name: slow-a100\nbase: a100-80g\npeak_tflops: {float16: 0.312, float32: 0.156}\nvector_tflops: 0.0195\n"
        "hbm_GBps: 2.039\nintra: {GBps: 0.3}\ninter: {GBps: 0.025}\n")  # every rate 1000 times the a100's


def _modelled_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("modelled step on "))


def test_pipeline_prices_with_the_cluster_files_own_figures(tmp_path, capsys, pipe_spec):
    # issue 40: `pipeline SPEC --cluster FILE.yaml` failed unknown-cluster 'FILE' (the file's stem looked up
    # among the built-ins); a file named like a built-in priced with the built-in's figures
    slow = write(tmp_path, "slow.yaml", SLOW)
    assert main(["pipeline", pipe_spec, "--cluster", slow]) == 0
    file_line = _modelled_line(capsys.readouterr().out)
    assert main(["pipeline", pipe_spec, "--cluster", "a100-80g"]) == 0
    builtin_line = _modelled_line(capsys.readouterr().out)
    assert file_line.startswith("modelled step on slow-a100: ") and builtin_line.startswith("modelled step on a100-80g")
    file_us = float(file_line.split(": ")[1].split(" us")[0])
    builtin_us = float(builtin_line.split(": ")[1].split(" us")[0])
    assert file_us > 10 * builtin_us, (file_line, builtin_line)


def test_every_command_taking_cluster_reads_a_file(tmp_path, capsys, pipe_spec, plain_spec):
    slow = write(tmp_path, "slow.yaml", SLOW)
    assert main(["estimate", pipe_spec, "--cluster", slow]) == 0
    assert "devices of slow-a100" in capsys.readouterr().out
    assert main(["estimate", plain_spec, "--cluster", slow]) == 0
    assert "devices of slow-a100" in capsys.readouterr().out
    assert main(["plan", plain_spec, "--cluster", slow]) == 0
    capsys.readouterr()
    assert main(["plan", plain_spec, "--search", "--cluster", slow, "--devices", "2", "--global-batch", "4"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("command", ["pipeline", "estimate", "plan"])
def test_a_cluster_file_never_passes_for_a_builtin(tmp_path, capsys, pipe_spec, command):
    fake = write(tmp_path, "fake.yaml", SLOW.replace("slow-a100", "a100-80g"))
    refused(capsys, [command, pipe_spec, "--cluster", fake], "bad-name", "built-in profile's name 'a100-80g'")


def test_a_cluster_file_named_like_a_builtin_is_read_under_its_own_file_name(tmp_path, capsys, plain_spec):
    """``a100-80g.yaml`` holding ``base: a100-80g`` and slower links (no ``name:``) was refused bad-name
    "may not take the built-in profile's name" at cluster.name, a key the file does not have."""
    own = write(tmp_path, "a100-80g.yaml", "base: a100-80g\ninter: {GBps: 0.025}\nintra: {GBps: 0.3}\n")
    assert main(["estimate", plain_spec, "--cluster", own]) == 0
    file_out = capsys.readouterr().out
    assert main(["estimate", plain_spec, "--cluster", "a100-80g"]) == 0
    builtin_out = capsys.readouterr().out
    assert " devices of a100-80g.yaml " in file_out and " devices of a100-80g " in builtin_out
    assert file_out.splitlines()[0] != builtin_out.splitlines()[0]  # its own (slower) links priced


def test_a_cluster_file_name_cannot_forge_an_output_line(tmp_path, capsys, plain_spec):
    """The profile's name comes from the file name when the file gives none: its line break is escaped."""
    forged = "x\nstep time 0.001 ms on 4 devices of a100-80g\x1b[31m"
    path = write(tmp_path, forged + ".yaml", SLOW.replace("name: slow-a100\n", ""))
    assert main(["estimate", plain_spec, "--cluster", path]) == 0
    out = capsys.readouterr().out
    assert not any(line.startswith("step time 0.001 ms") for line in out.splitlines()), out
    assert "\x1b" not in out and "x\\nstep time 0.001 ms" in out.splitlines()[0]


@pytest.mark.parametrize("make", ["/dev/null", "folder", "loop"])
def test_a_cluster_path_without_a_yaml_suffix_gets_the_files_refusal(tmp_path, capsys, plain_spec, make):
    """``--cluster /dev/null`` or a folder said "no built-in cluster"; a path is read as a file and refused as one."""
    if make == "/dev/null":
        path, says = "/dev/null", "is a device"
    elif make == "folder":
        path, says = str(tmp_path / "profiles"), "is a folder"
        Path(path).mkdir()
    else:
        path, says = str(tmp_path / "loop"), "cannot read"
        Path(path).symlink_to(path)
    refused(capsys, ["estimate", plain_spec, "--cluster", path], "cluster-not-found", says)


# --------------------------------------------------------------------------- the same hostile file, both loaders
def _both_refuse(capsys, path: str, code_suffix: str, *fragments: str, seconds: float = 10.0) -> None:
    """The spec loader (check) and the cluster loader (load_cluster, and estimate --cluster) refuse ``path``
    with the same kind of code (``spec-X`` and ``cluster-X``, or the same code)."""
    spec_code = code_suffix if "-" in code_suffix and not code_suffix.startswith("-") else f"spec{code_suffix}"
    cluster_code = code_suffix if spec_code == code_suffix else f"cluster{code_suffix}"
    refused(capsys, ["check", path], spec_code, *fragments, seconds=seconds)
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        load_cluster(Path(path))
    assert time.perf_counter() - start < seconds
    assert info.value.code == cluster_code, info.value
    for fragment in fragments:
        assert fragment in str(info.value)
    refused(capsys, ["estimate", "x.yaml", "--cluster", path], cluster_code, seconds=seconds)


def test_non_utf8_is_a_clear_error_in_both_loaders(tmp_path, capsys):
    path = write(tmp_path, "bad.yaml", b"name: caf\xe9\n")
    _both_refuse(capsys, path, "-syntax", "is not UTF-8 text", "at byte 9")


def test_a_link_to_dev_zero_is_refused_before_reading_in_both_loaders(tmp_path, capsys):
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    _both_refuse(capsys, str(link), "-not-found", "is a device", seconds=2.0)


def test_a_too_large_file_is_refused_by_both_loaders(tmp_path, capsys, monkeypatch):
    from layout_prop.io import reader

    monkeypatch.setattr(reader, "MAX_FILE_BYTES", 1000)
    path = write(tmp_path, "big.yaml", "sources: {a: '" + "x" * 200_000 + "'}\n")
    with pytest.raises(SpecError) as info:
        load_cluster(Path(path))
    assert info.value.code == "cluster-too-large"
    from layout_prop.io.loader import read_spec_text

    with pytest.raises(SpecError) as info:
        read_spec_text(Path(path), limit=1000)
    assert info.value.code == "spec-too-large"


def test_yaml_alias_bombs_are_bounded_in_both_loaders(tmp_path, capsys):
    # issue 40: aliases in a cluster's name: took 17 s and 1.3 GB (one level more: out of memory)
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = write(tmp_path, "bomb.yaml", "\n".join(levels) + "\nname: *a8\n")
    _both_refuse(capsys, path, "-too-large", "YAML aliases expand it", seconds=3.0)


def test_nesting_too_deep_is_refused_by_both_loaders(tmp_path, capsys):
    path = write(tmp_path, "deep.yaml", "name: " + "[" * 200 + "]" * 200 + "\n")
    _both_refuse(capsys, path, "-too-deep", seconds=3.0)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_fifo_is_refused_by_both_loaders_not_waited_for(tmp_path, capsys, monkeypatch):
    # issue 40: a FIFO given as --cluster hung forever
    from layout_prop.io import reader

    monkeypatch.setattr(reader, "PIPE_WRITER_WAIT_SECONDS", 0.3)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    stop = threading.Event()

    def unblock():  # a reader that never returns would keep the test waiting: open the writer end at the end
        stop.wait(8)
        if not stop.is_set():
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)

    guard = threading.Thread(target=unblock, daemon=True)
    guard.start()
    try:
        _both_refuse(capsys, str(fifo), "-not-found", "a pipe that no process writes to", seconds=5.0)
    finally:
        stop.set()


# --------------------------------------------------------------------------- the cluster file's values
@pytest.mark.parametrize("text, code, fragment", [
    ("base: a100-80g\nhbm_gb: " + "9" * 400 + "\n", "bad-value", "hbm_gb is"),
    ("base: a100-80g\ninter: {latency_us: 1.7e308}\n", "bad-value", "latency_us is 1.7e+308"),
    ("base: a100-80g\nhbm_GBps: 1.0e-300\nmemory_efficiency: 1.0e-300\n", "bad-value", "hbm_GBps is 1e-300"),
    ("base: a100-80g\nmemory_efficiency: 1.0e-300\n", "bad-value", "memory_efficiency is 1e-300"),
    ("base: [a100-80g]\n", "unknown-cluster", "to start from"),
    ("base: {a: 1}\n", "unknown-cluster", "to start from"),
    ("base: a100-80g\n1: x\nfoo: 2\n~: 3\n", "unknown-key", "and 2 more"),
    ("base: a100-80g\nbsae: 1\n", "unknown-key", "did you mean 'base'?"),
    ("base: a100-80g\ninter: {GBps: 1, latncy_us: 2}\n", "unknown-key", "did you mean 'latency_us'?"),
    ("base: a100-80g\nname: " + "n" * 100_000 + "\n", "bad-name", "100,000 characters long"),
    ("base: a100-80g\nname: \"two\\nlines\"\n", "bad-name", "a control character or a line break"),
    ("base: a100-80g\nname: [1, 2]\n", "bad-name", "not a non-empty string"),
    ("base: a100-80g\ndevice: \"\\x1b[31mred\"\n", "bad-name", "control character"),
    ("base: a100-80g\nsources: [1, 2]\n", "bad-type", "sources is a mapping"),
    ("base: a100-80g\nsources: {hbm: 3}\n", "bad-name", "a source 3 is not a non-empty string"),
    ("base: a100-80g\ndevices_per_node: 1000000000\n", "bad-value", "devices_per_node is 1000000000"),
    ("base: a100-80g\npeak_tflops: {1: 2, float32: 3}\n", "bad-dtype", "names dtype 1"),
    ("base: a100-80g\nmatmul_efficiency: .nan\n", "bad-value", "matmul_efficiency is nan"),
    ("base: a100-80g\nnodes: true\n", "bad-value", "nodes is True"),
])
def test_hostile_cluster_values_are_one_line_refusals(tmp_path, capsys, text, code, fragment):
    path = write(tmp_path, "cluster.yaml", text)
    line = refused(capsys, ["estimate", "never-read.yaml", "--cluster", path], code, fragment, seconds=3.0)
    assert len(line) < 1000


def test_a_cluster_of_extreme_accepted_figures_prices_a_finite_step(tmp_path, capsys, plain_spec):
    # every figure at the edge of its range: the step time stays finite (no 'inf ms', no division by zero)
    text = ("base: a100-80g\nname: edge\nhbm_GBps: 1.0e-6\nmemory_efficiency: 0.001\nlink_efficiency: 0.001\n"
            "matmul_efficiency: 0.001\nvector_tflops: 1.0e-6\npeak_tflops: {float32: 1.0e-6, float16: 1.0e-6}\n"
            "inter: {GBps: 1.0e-6, latency_us: 1000000}\nintra: {GBps: 1.0e-6, latency_us: 1000000}\n")
    path = write(tmp_path, "edge.yaml", text)
    assert main(["estimate", plain_spec, "--cluster", path]) == 0
    out = capsys.readouterr().out
    assert "inf" not in out and "nan" not in out and out.startswith("step time ")


# --------------------------------------------------------------------------- no silent misreading of flags and blocks
def _spec_with(tmp_path: Path, name: str, spec: dict, **blocks) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**spec, **blocks}, sort_keys=False))
    return str(path)


def test_batch_inputs_naming_a_weight_is_refused(tmp_path, capsys):
    # issue 40: batch_inputs: [embed] was accepted, the vocabulary cut into micro-batches (exit 0)
    spec = with_pp(small_gpt(), 2, {"micro_batches": 2, "batch_inputs": ["transformer.wte.weight"]})
    path = _spec_with(tmp_path, "embed.yaml", spec)
    for command in (["pipeline", path], ["estimate", path, "--cluster", "a100-80g"]):
        refused(capsys, command, "bad-pipeline", "batch input 'transformer.wte.weight' is a weight",
                "the table of embedded")


def test_the_same_output_twice_is_refused_before_the_work(tmp_path, capsys, plain_spec):
    out = tmp_path / "same.yaml"
    refused(capsys, ["plan", plain_spec, "--search", "--cluster", "a100-80g", "--devices", "2", "--global-batch",
                     "4", "-o", str(out), "--plan-out", str(tmp_path / "." / "same.yaml")],
            "same-output", "-o and --plan-out name the same file")
    refused(capsys, ["export", plain_spec, "--to", "torch", "-o", str(tmp_path / "m.py"), "--data",
                     str(tmp_path / "m.py")], "same-output", "-o and --data")
    assert not out.exists() and not (tmp_path / "m.py").exists()
    (tmp_path / "real.py").write_text("")
    (tmp_path / "link.py").symlink_to(tmp_path / "real.py")
    refused(capsys, ["export", plain_spec, "--to", "torch", "-o", str(tmp_path / "real.py"), "--data",
                     str(tmp_path / "link.py")], "same-output")


def test_recompute_none_with_layers_is_refused(tmp_path, capsys, plain_spec):
    # issue 40: --recompute none --recompute-layers l0 still recomputed l0
    refused(capsys, ["estimate", plain_spec, "--cluster", "a100-80g", "--recompute", "none", "--recompute-layers",
                     "l0"], "bad-usage", "--recompute none with --recompute-layers")
    path = _spec_with(tmp_path, "r.yaml", small_gpt(), recompute={"mode": "none", "layers": ["l0"]})
    refused(capsys, ["check", path], "bad-value", "recompute mode none names layers")


def test_an_empty_recompute_layer_list_is_refused_as_the_flag_is(tmp_path, capsys, plain_spec):
    # issue 40: recompute: {layers: []} was accepted where --recompute-layers ,,, is refused
    refused(capsys, ["estimate", plain_spec, "--cluster", "a100-80g", "--recompute-layers", ",,,"], "bad-value",
            "names no layer")
    refused(capsys, ["estimate", plain_spec, "--cluster", "a100-80g", "--recompute-layers", ""], "bad-value",
            "names no layer")
    for layers in ([], ["", " "]):
        path = _spec_with(tmp_path, "r.yaml", small_gpt(), recompute={"mode": "full", "layers": layers})
        refused(capsys, ["check", path], "bad-value", "name no layer")


def test_zero_blocks_are_typed_alike(tmp_path, capsys):
    # issue 40: zero: 3.0 was refused (bad-type) but {stage: 3.0} accepted
    lines = []
    for block in (3.0, {"stage": 3.0}, True, {"stage": True}):
        path = _spec_with(tmp_path, "z.yaml", small_gpt(), zero=block)
        lines.append(refused(capsys, ["check", path], "bad-value", "ZeRO stage must be 0, 1, 2 or 3"))
    assert "got 3.0" in lines[0] and "got 3.0" in lines[1]
    path = _spec_with(tmp_path, "r.yaml", small_gpt(), recompute=2.5)
    refused(capsys, ["check", path], "bad-value", "recompute mode must be one of")


@pytest.mark.parametrize("block, code", [
    ({"zero": {1: 2, "x": 3, None: 4}}, "unknown-key"),
    ({"recompute": {1: 2, "x": 3, "mode": "full"}}, "unknown-key"),
    ({"pipeline": {"micro_batches": 2, 1: 2, "x": 3, None: 1}}, "bad-pipeline"),
])
def test_blocks_with_unknown_keys_of_mixed_types_are_refused(tmp_path, capsys, block, code):
    # issue 40: sorting keys of mixed types crashed check, estimate and pipeline
    spec = with_pp(small_gpt(), 2, {"micro_batches": 2}) if "pipeline" in block else small_gpt()
    if "pipeline" in block:
        block = {"pipeline": {**spec["pipeline"], **block["pipeline"]}}
    path = _spec_with(tmp_path, "b.yaml", spec, **block)
    for command in (["check", path], ["estimate", path, "--cluster", "a100-80g"], ["pipeline", path]):
        if command[0] == "pipeline" and "pipeline" not in block:
            continue
        refused(capsys, command, code)


def test_a_constraint_placement_of_5000_digits_is_refused_as_inputs_refuse_it(tmp_path, capsys):
    spec = small_gpt()
    path = _spec_with(tmp_path, "c.yaml", spec, constraints={"embedded": ["S(" + "9" * 5000 + ")", "R", "R"]})
    refused(capsys, ["check", path], "bad-placement", "constraints['embedded'][0]")


def test_search_options_without_search_and_time_limit_with_it_are_refused(capsys, plain_spec):
    # issue 40: --devices without --search and --time-limit with it were ignored silently
    for extra in (["--devices", "4"], ["--global-batch", "8"], ["--axes", "tp=2"], ["--plan-out", "p.yaml"]):
        refused(capsys, ["plan", plain_spec, *extra], "bad-usage", f"{extra[0]} is an option of plan --search")
    refused(capsys, ["plan", plain_spec, "--search", "--cluster", "a100-80g", "--devices", "2", "--global-batch", "4",
                     "--time-limit", "5"], "bad-usage", "does not take --time-limit")


@pytest.mark.parametrize("argv, code", [
    (["plan", "{spec}", "--search", "--cluster", "a100-80g", "--devices", "2", "--global-batch", "4", "--axes",
      "tp=²"], "bad-axes"),
    (["plan", "{spec}", "--search", "--cluster", "a100-80g", "--devices", "2", "--global-batch", "4", "--axes",
      "tp=٢"], "bad-axes"),
    (["plan", "{spec}", "--search", "--cluster", "a100-80g", "--devices", "2", "--global-batch", "4", "--axes",
      "tp=" + "9" * 5000], "bad-axes"),
    (["plan", "{spec}", "--search", "--cluster", "a100-80g", "--devices", str(10 ** 30), "--global-batch", "4"],
     "bad-devices"),
    (["gen", "gpt", "--mesh", "dp=²,sp=1,tp=1"], "bad-mesh"),
    (["gen", "gpt", "--mesh", "dp=٢,sp=1,tp=1"], "bad-mesh"),
    (["gen", "gpt", "--mesh", "dp=1,sp=1,tp=" + "9" * 5000], "bad-mesh"),
    (["viz", "{spec}", "--tensor", "tokens", "--dims", "٢", "-o", "{spec}.svg"], "bad-dims"),
    (["viz", "{spec}", "--tensor", "tokens", "--dims", "9" * 5000, "-o", "{spec}.svg"], "bad-dims"),
    (["check", "{spec}", "--mesh", "2x٢"], "bad-usage"),
    (["estimate", "{spec}", "--cluster", "a100-80g", "--global-batch", "٤", "--micro-batch", "1"], "bad-usage"),
])
def test_integer_options_take_ascii_digits_only(capsys, plain_spec, argv, code):
    line = refused(capsys, [a.replace("{spec}", plain_spec) for a in argv], code, seconds=5.0)
    assert len(line) < 600, len(line)


def test_search_divisors_take_time_independent_of_the_numbers(tmp_path, capsys, plain_spec):
    # issue 40: plan --search counted divisors one by one up to devices_per_node (10^9: 61 s)
    from layout_prop.planner.search import _divisors

    start = time.perf_counter()
    assert _divisors(2 ** 24, 10 ** 9)[-1] == 2 ** 24 and _divisors(16_777_213, 10 ** 9) == [1, 16_777_213]
    assert _divisors(720, 10 ** 9) == [d for d in range(1, 721) if 720 % d == 0]
    big = write(tmp_path, "big.yaml", "name: wide\nbase: a100-80g\ndevices_per_node: 1048576\n")
    assert main(["plan", plain_spec, "--search", "--cluster", big, "--devices", "2", "--global-batch", "4"]) == 0
    capsys.readouterr()
    assert time.perf_counter() - start < 30


# --------------------------------------------------------------------------- a broken optional dependency
def test_plan_with_a_broken_scipy_is_the_missing_dependency_refusal(tmp_path, capsys, monkeypatch, plain_spec):
    # issue 40: scipy installed but broken (its import raises ImportError, not ModuleNotFoundError) was an
    # internal-error in the solver instead of the one-line refusal
    import sys

    fake = tmp_path / "site" / "scipy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libopenblas.so.0: cannot open shared object file')\n")
    for name in [n for n in sys.modules if n == "scipy" or n.startswith("scipy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    line = refused(capsys, ["plan", plain_spec], "missing-dependency", "plan needs scipy, which is installed but "
                   "cannot be imported (ImportError: libopenblas.so.0")
    assert "--force-reinstall" in line


# --------------------------------------------------------------------------- pipelined runs are guarded
def test_a_pipelined_run_too_large_for_memory_is_refused_before_it_starts(tmp_path, capsys):
    # issue 40: run refused a run too large in 1 s, but not with a pipeline: block (1.6 GB allocated, then a
    # MemoryError blaming the op's localize rule)
    big = with_pp(gpt_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=64, seq=2048, hidden=4096,
                           heads=32, dropout=0.0, dtype="float32"), 2, {"micro_batches": 2})
    path = _spec_with(tmp_path, "big.yaml", big)
    for command in (["run", path], ["run", path, "--max-memory", "1G"], ["pipeline", path, "--run"]):
        refused(capsys, command, "run-too-large", "the pipelined run needs about", seconds=15.0)


def test_a_pipelined_run_takes_max_time(capsys, pipe_spec):
    refused(capsys, ["run", pipe_spec, "--max-time", "0.0001"], "run-too-large",
            "the pipelined run would take about", "over the --max-time limit of 0.0001 s")
    assert main(["run", pipe_spec, "--max-time", "300", "--max-memory", "4G"]) == 0
    assert "matches one device" in capsys.readouterr().out


# --------------------------------------------------------------------------- dropout in a pipelined run
@pytest.mark.parametrize("dtype, micro_batches, schedule", [("float32", 4, "1f1b"), ("bfloat16", 2, "gpipe")])
def test_a_pipelined_run_with_dropout_matches_one_device(tmp_path, capsys, dtype, micro_batches, schedule):
    # issue 40: with gen gpt's default dropout every pipelined run said DIFFERS (each micro-batch drew the masks
    # of the whole batch's first rows); the spec plan --search -o writes failed pipeline --run
    from layout_prop.passes.pipeline import micro_batch_op

    spec = with_pp(gpt_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=4, dtype=dtype), 2,
                   {"micro_batches": micro_batches, "schedule": schedule})
    assert any(node["op"] == "dropout" and node["attrs"]["p"] > 0 for node in spec["nodes"])
    path = _spec_with(tmp_path, "drop.yaml", spec)
    assert main(["pipeline", path, "--run", "--json"]) == 0, capsys.readouterr()
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and not report["mismatches"]
    if dtype == "float32":  # the same masks: only the sums' order differs
        assert max(e["max_rel_err"] for e in [*report["outputs"].values(), *report["grads"].values()]) < 1e-5
    # the shift itself: micro-batch k's rows are the whole batch's rows k * rows ...
    from layout_prop.passes.lower import LocalOp

    op = LocalOp("d", "kernel", "dropout", ("x",), ("y",), (), attrs=({"offsets": [1, 0], "global_shape": [2, 8]},))
    assert micro_batch_op(op, 3, 4).attrs[0] == {"offsets": [7, 0], "global_shape": [8, 8]}
    assert micro_batch_op(op, 0, 1) is op


# --------------------------------------------------------------------------- tolerances that fit the dtype
def test_float16_tolerance_is_derived_from_one_devices_own_rounding(tmp_path, capsys):
    # issue 40: float16 gen gpt (tp=2, no dropout) reported a false mismatch under run --backward: the ranks
    # differed from one device by 2% on a projection's weight gradient, where one device itself was 2% from float64.
    # Since gen writes GPT-2's fused c_attn, seed 0 no longer gives such a case (every gradient's own error is
    # below 0.2%).  This one was found by a search of exact_errors over gen gpt float16 (layers 2, tp 2), seeds 0-24
    # x (seq, hidden, heads, batch) in {(8,32,4,2), (16,32,4,2), (32,32,2,2), (8,32,4,4)}, keeping the cases where
    # some gradient's own error is in (1e-2, 1/30) (a derived tolerance under 0.1) and another's is below 1e-2, then
    # run --backward on them for ranks more than 1e-2 from one device on that gradient (batch 4 seed 21: 0.9e-2).  The
    # issue's shape, seed 3: layer 1's c_attn.weight is 3.0e-2 from float64, ln_f.weight 3.6e-3; the ranks differ
    # from one device by 2.2e-2 on c_attn.weight, over float16's table 1e-2 (the issue's false mismatch).
    from layout_prop.api import analyze
    from layout_prop.io.loader import load_spec
    from layout_prop.runner import compare, execute_global, exact_errors, random_inputs, rounding_tolerance

    seed, qkv, out = 3, "grad/transformer.h.1.attn.c_attn.weight", "grad/transformer.ln_f.weight"
    spec = gpt_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=2, dropout=0.0, dtype="float16")
    path = _spec_with(tmp_path, "h.yaml", spec)
    assert main(["run", path, "--backward", "--seed", str(seed), "--json"]) == 0, capsys.readouterr().out[-600:]
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and not report["mismatches"]
    assert report["grads"][qkv[len("grad/"):]]["max_rel_err"] > 1e-2  # passes by the derived tolerance only
    g = analyze(load_spec(path), reshard=True, backward=True).graph
    inputs = random_inputs(g, seed)
    reference = execute_global(g, inputs, wanted=list(g.outputs))
    own = exact_errors(g, inputs, reference)
    assert set(own) == set(g.outputs) and own[qkv] > 1e-2 > own[out]  # measured, per value
    # still a judge: a result 10% off is a mismatch under the derived tolerance
    spec_of = {v: g.producer(v)[0].meta["specs"][g.producer(v)[1]] for v in g.outputs}
    tol = rounding_tolerance(1e-2, own[qkv])
    assert tol < 0.1
    wrong = (reference[qkv].astype("float64") * 1.1).astype("float16")
    assert compare(qkv, wrong, reference[qkv], spec_of[qkv], tol)[1] is not None
    assert rounding_tolerance(1e-2, 0.5) == 0.25  # capped: too inexact to judge by
    # a float32 graph measures nothing (its table tolerance stays)
    g32 = analyze(load_spec(small_gpt()), reshard=True, backward=True).graph
    x32 = random_inputs(g32, 0)
    assert exact_errors(g32, x32, execute_global(g32, x32, wanted=list(g32.outputs))) == {}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_searched_spec_with_dropout_passes_pipeline_run(tmp_path, capsys, dtype):
    # issue 40: the spec plan --search -o writes (gen gpt, dropout on) failed pipeline --run
    model = _spec_with(tmp_path, "gpt.yaml", gpt_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 1)), batch=4,
                                                      dtype=dtype))
    searched = str(tmp_path / "searched.yaml")
    assert main(["plan", model, "--search", "--cluster", "a100-80g", "--devices", "4", "--global-batch", "8",
                 "--axes", "pp=2", "-o", searched]) == 0
    capsys.readouterr()
    data = yaml.safe_load(Path(searched).read_text())
    assert data["pipeline"] and any(n["op"] == "dropout" and n["attrs"]["p"] > 0 for n in data["nodes"])
    rc = main(["pipeline", searched, "--run"])
    out = capsys.readouterr().out
    assert rc == 0 and "matches one device" in out, out[-800:]


def test_plan_files_are_read_by_the_same_reader(tmp_path):
    # a sharding plan (import --plan, export --data) goes through io/reader.py as specs and cluster files do
    from layout_prop.io.plan_file import load_plan

    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    cases = [(link, "plan-not-found"), (write(tmp_path, "bad.yaml", b"mesh: caf\xe9\n"), "plan-syntax"),
             (write(tmp_path, "bomb.yaml", "\n".join(levels) + "\nmesh: *a8\n"), "plan-too-large"),
             (write(tmp_path, "keys.yaml", "mesh: {shape: [2]}\n1: x\nparamters: {}\n"), "unknown-key")]
    for path, code in cases:
        start = time.perf_counter()
        with pytest.raises(SpecError) as info:
            load_plan(Path(path))
        assert info.value.code == code, (path, info.value)
        assert time.perf_counter() - start < 3
    assert "plan has no key 1 and 1 more" in str(info.value)  # keys of mixed types: no crash sorting them
    with pytest.raises(SpecError, match="did you mean 'parameters'"):
        load_plan(Path(write(tmp_path, "typo.yaml", "mesh: {shape: [2]}\nparamters: {}\n")))


@pytest.mark.parametrize("block, guess", [({"zero": {"stgae": 1}}, "'stage'"), ({"recompute": {"mdoe": "full"}}, "'mode'"),
                                          ({"pipeline": {"micro_batch": 2}}, "'micro_batches'")])
def test_a_misspelt_block_key_gets_a_did_you_mean(tmp_path, capsys, block, guess):
    spec = with_pp(small_gpt(), 2, {"micro_batches": 2}) if "pipeline" in block else small_gpt()
    if "pipeline" in block:
        block = {"pipeline": {**spec["pipeline"], **block["pipeline"]}}
    path = _spec_with(tmp_path, "b.yaml", spec, **block)
    refused(capsys, ["check", path], "", f"(did you mean {guess}?)")
