"""Fuzz the training commands with hostile flags, cluster files and spec blocks (issue 40).

``estimate``, ``plan --search``, ``pipeline``, ``export`` and ``check`` are driven in-process
(:func:`layout_prop.cli.main`) with generated input of three kinds:

- cluster files that are each refused (a figure out of its range or of the wrong type, an
  unknown key of any type, a hostile name, a text that is not UTF-8, an alias bomb, deep
  nesting, a document that is no mapping);
- flags that are each refused (non-ASCII or 5,000-digit integers, contradictory flags, the
  same output twice, search options without ``--search``);
- ``zero:``, ``recompute:``, ``pipeline:`` and ``constraints:`` blocks of generated values, some
  surely wrong (refused), the others anything (any exit but a crash).

Every case keeps the exit-code contract: 0, 1 or 2; no ``Traceback``, never ``internal-error``;
one line on stderr on exit 2; each case within :data:`SECONDS`; and a case generated to be
refused never exits 0.  The generator is seeded (``random.Random(SEED)``): every run tries the
same cases; ``LAYOUT_PROP_FUZZ_SEED`` and ``LAYOUT_PROP_FUZZ_CASES`` try others and more.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import yaml

from layout_prop.cli import main
from layout_prop.frontends.generate import gpt_spec

from .test_hostile_files import with_pp

SEED = int(os.environ.get("LAYOUT_PROP_FUZZ_SEED", "40"))
#: cases per kind (three kinds)
CASES = int(os.environ.get("LAYOUT_PROP_FUZZ_CASES", "100"))
#: the longest one case may take (a hang guard, generous on a loaded machine)
SECONDS = 30


class _Hung(BaseException):
    """Raised by the alarm in a case that takes longer than :data:`SECONDS` (not an Exception: main does
    not turn it into an exit code)."""


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("fuzz40")
    plain = gpt_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=4, dropout=0.0, dtype="float32")
    piped = with_pp(plain, 2, {"micro_batches": 2})
    paths = {"folder": folder, "plain_data": plain, "piped_data": piped}
    for name, data in (("plain", plain), ("piped", piped)):
        paths[name] = str(folder / f"{name}.yaml")
        Path(paths[name]).write_text(yaml.safe_dump(data, sort_keys=False))
    return paths


def _run(argv: list[str], capsys) -> tuple[int, str, str, float]:
    def hung(signum, frame):
        raise _Hung(f"{argv[:3]} took over {SECONDS} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(SECONDS)
    start = time.perf_counter()
    try:
        rc = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    return rc, out, err, elapsed


def _keeps_contract(argv, rc: int, out: str, err: str, refused: bool, exits: tuple[int, ...] = (2,)) -> None:
    shown = [a[:80] for a in argv]
    assert rc in (0, 1, 2), (shown, rc, err[-500:])
    assert "Traceback" not in out + err and "internal-error" not in err, (shown, err[-800:])
    if rc == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("layout-prop: error: "), (shown, err[-800:])
    if refused:
        assert rc in exits, (shown, rc, out[-300:], err[-300:])


# --------------------------------------------------------------------------- generated values
_HOSTILE_NUMBERS = [0, -1, -1e-9, 1e-300, 1e308, 1.7e308, 10 ** 400, float("inf"), float("nan"), True, "12", "fast",
                    [1], {"a": 1}, None, 2 ** 70, 1e7]
_HOSTILE_TEXT = ["", "a\nb", "x\x1b[31m", "n" * 5000, "\u202eevil", 7, [1, 2], {"k": "v"}, None, True]
_KEYS_ANY = [1, None, True, 2.5, "bsae", "peak_tflop", "hbm", "x" * 300, "\x07"]


def _cluster_case(rng: random.Random) -> bytes:
    """A cluster file that must be refused."""
    base = {"name": "fuzz", "base": "a100-80g"}
    kind = rng.randrange(12)
    if kind == 0:
        key = rng.choice(["vector_tflops", "hbm_gb", "hbm_GBps", "devices_per_node", "nodes", "matmul_efficiency",
                          "memory_efficiency", "link_efficiency"])
        value = rng.choice(_HOSTILE_NUMBERS)
        if key == "nodes" and value is None:
            value = 0
        data = {**base, key: value}
    elif kind == 1:
        key = rng.choice(["GBps", "latency_us"])
        # (a latency may be 0 or tiny: nothing divides by it; past a second a hop is refused)
        value = rng.choice([v for v in _HOSTILE_NUMBERS if key == "GBps" or v not in (0, 1e-300, 1e7)] + [1e12])
        data = {**base, rng.choice(["intra", "inter"]): {key: value}}
    elif kind == 2:
        data = {**base, "peak_tflops": rng.choice([{"float16": rng.choice(_HOSTILE_NUMBERS), "float32": 1},
                                                   {rng.choice(_KEYS_ANY): 1, "float32": 1}, [], "fast", {}])}
    elif kind == 3:
        data = {**base, rng.choice(_KEYS_ANY): rng.choice(_HOSTILE_NUMBERS + _HOSTILE_TEXT)}
    elif kind == 4:
        data = {**base, rng.choice(["name", "device"]): rng.choice(_HOSTILE_TEXT)}
    elif kind == 5:
        data = {**base, "name": rng.choice(["a100-80g", "h100-80g", "ascend-910b"])}
    elif kind == 6:
        data = {**base, "base": rng.choice([["a100-80g"], {"a": 1}, 3, "a100", "", True])}
    elif kind == 7:
        data = {**base, "sources": rng.choice([[1, 2], "x", 3, {"hbm": 3}, {1: "x"}, {"a": "b\nc"}])}
    elif kind == 8:  # no base: a figure missing
        data = {"name": "fuzz", "devices_per_node": 8}
    elif kind == 9:
        return rng.choice([b"name: caf\xe9\n", b"\xff\xfe\x00", b"\x00\x01"])
    elif kind == 10:
        levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
            f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
        return ("\n".join(levels) + f"\n{rng.choice(['name', 'device', 'sources'])}: *a8\n").encode()
    else:
        return rng.choice([b"name: " + b"[" * 300 + b"]" * 300, b"- a\n- b\n", b"", b"base: [a100-80g\n",
                           b"42\n", b"base: a100-80g\nbase: h100-80g\n"])
    return yaml.safe_dump(data, allow_unicode=True).encode()


def test_hostile_cluster_files_are_refused_by_every_command(specs, capsys):
    rng = random.Random(SEED)
    folder = specs["folder"]
    start = time.perf_counter()
    for case in range(CASES):
        path = folder / f"cluster{case}.yaml"
        path.write_bytes(_cluster_case(rng))
        command = rng.choice(["estimate", "plan-search", "pipeline", "plan"])
        argv = {"estimate": ["estimate", specs["plain"], "--cluster", str(path)],
                "plan-search": ["plan", specs["plain"], "--search", "--cluster", str(path), "--devices", "2",
                                "--global-batch", "4"],
                "pipeline": ["pipeline", specs["piped"], "--cluster", str(path)],
                "plan": ["plan", specs["plain"], "--cluster", str(path)]}[command]
        rc, out, err, elapsed = _run(argv, capsys)
        _keeps_contract(argv + [path.read_bytes()[:300].decode("utf-8", "replace")], rc, out, err, refused=True)
    assert time.perf_counter() - start < 120


def _int_text(rng: random.Random) -> str:
    return rng.choice(["²", "٢", "٤", "9" * 5000, "-3", "0", "1e3", "", " ", "1_000", "0x10", "+2", "2.0", "∞"])


def _flag_case(rng: random.Random, specs: dict, folder: Path) -> list[str]:
    """A command line that must be refused."""
    plain, piped = specs["plain"], specs["piped"]
    search = ["plan", plain, "--search", "--cluster", "a100-80g", "--devices", "2", "--global-batch", "4"]
    kind = rng.randrange(10)
    if kind == 0:
        return [*search, "--axes", f"{rng.choice(['tp', 'pp', 'dp', 'xx'])}={_int_text(rng)}"]
    if kind == 1:
        flag = rng.choice(["--devices", "--global-batch", "--top"])
        argv = list(search)
        if flag in argv:
            argv[argv.index(flag) + 1] = _int_text(rng)
        else:
            argv += [flag, _int_text(rng)]
        return argv
    if kind == 2:
        return ["estimate", rng.choice([plain, piped]), "--cluster", "a100-80g", "--recompute", "none",
                "--recompute-layers", rng.choice(["l0", "l0,l1", ",,,", ""])]
    if kind == 3:
        name = str(folder / "same.out")
        return rng.choice([[*search, "-o", name, "--plan-out", name],
                           ["export", plain, "--to", rng.choice(["torch", "hyper-parallel", "mindspore"]), "-o", name,
                            "--data", name]])
    if kind == 4:
        return ["plan", plain, rng.choice(["--devices", "--global-batch"]), rng.choice(["2", "4"])]
    if kind == 5:
        return [*search, "--time-limit", rng.choice(["1", "60", "0.5"])]
    if kind == 6:
        return ["check", plain, "--mesh", rng.choice(["2x²", "٢", "2x" + "9" * 5000, "0x2", "x", "2x-1"])]
    if kind == 7:
        return ["gen", "gpt", "--mesh", f"dp={_int_text(rng)},sp=1,tp=1"]
    if kind == 8:
        return ["estimate", plain, "--cluster", "a100-80g", "--zero", rng.choice(["4", "-1", "٢", "3.0", "x"])]
    return ["viz", plain, "--tensor", "tokens", "--dims", rng.choice(["٢", "9" * 5000, "a", "1,,2", "²"]),
            "-o", str(folder / "t.svg")]


def test_hostile_flags_are_refused(specs, capsys):
    rng = random.Random(SEED + 1)
    start = time.perf_counter()
    for _ in range(CASES):
        argv = _flag_case(rng, specs, specs["folder"])
        rc, out, err, elapsed = _run(argv, capsys)
        _keeps_contract(argv, rc, out, err, refused=True)
    assert not (specs["folder"] / "same.out").exists()
    assert time.perf_counter() - start < 120


_ANY = [0, 1, 2, 3, -1, 2.0, 3.0, 0.5, True, None, "", "full", "selective", "none", "pp", "dp", "gpipe", "1f1b",
        "interleaved", [], ["l0"], ["transformer.wte.weight"], ["tokens"], ["", " "], [1, 2], {"a": 1}, "x" * 300,
        10 ** 30, "S(0)"]
_BLOCK_KEYS = {"zero": ["stage", "axes"], "recompute": ["mode", "layers"],
               "pipeline": ["axis", "micro_batches", "schedule", "virtual_stages", "boundaries", "layers",
                            "batch_inputs", "loss"]}


def _block_case(rng: random.Random, specs: dict) -> tuple[dict, bool]:
    """A spec with generated blocks, and whether it must be refused."""
    piped = rng.random() < 0.5
    spec = dict(specs["piped_data" if piped else "plain_data"])
    kind = rng.randrange(6)
    if kind == 0:  # a block of known keys with any values: anything but a crash
        block = rng.choice(["zero", "recompute"] + (["pipeline"] if piped else []))
        value = {key: rng.choice(_ANY) for key in rng.sample(_BLOCK_KEYS[block], rng.randint(1, 2))}
        if block == "pipeline":
            value = {**spec["pipeline"], **value}
        spec[block] = value
        return spec, False
    if kind == 1:  # an unknown key, of any type
        block = rng.choice(["zero", "recompute"] + (["pipeline"] if piped else []))
        value = dict(spec["pipeline"]) if block == "pipeline" else {}
        value[rng.choice(_KEYS_ANY + ["stgae", "layer", "micro_batch"])] = rng.choice(_ANY)
        spec[block] = value
        return spec, True
    if kind == 2:  # typed alike: a float or a boolean stage, bare or in a mapping
        stage = rng.choice([3.0, 1.0, True, False, "2", -1, 4, 2 ** 70])
        spec["zero"] = stage if rng.random() < 0.5 else {"stage": stage}
        return spec, True
    if kind == 3:
        spec["recompute"] = rng.choice([{"mode": "full", "layers": []}, {"mode": "none", "layers": ["l0"]},
                                        {"mode": "full", "layers": ["", " "]}, {"mode": 3}, 2.5, [1],
                                        {"mode": "full", "layers": "l0"}])
        return spec, True
    if kind == 4:
        spec["constraints"] = {rng.choice(["embedded", "logits", "l0_h"]): [
            rng.choice(["S(" + "9" * 5000 + ")", "S(-99)", "Q", 7, None, "P(xor)", "S(0"]), "R", "R"]}
        return spec, True
    if not piped:
        spec = dict(specs["piped_data"])
    spec["pipeline"] = {**spec["pipeline"], **rng.choice([
        {"batch_inputs": ["transformer.wte.weight"]}, {"batch_inputs": ["transformer.h.0.attn.c_attn.weight"]},
        {"micro_batches": 0}, {"micro_batches": 3},
        {"micro_batches": 2.0}, {"schedule": "zigzag"}, {"axis": "tp"}, {"axis": ["pp"]}, {"boundaries": ["nope"]},
        {"layers": [0, 2]}, {"loss": 1}, {"virtual_stages": 0}])}
    return spec, True


def test_generated_blocks_never_crash_and_wrong_ones_are_refused(specs, capsys):
    rng = random.Random(SEED + 2)
    folder = specs["folder"]
    start = time.perf_counter()
    for case in range(CASES):
        spec, wrong = _block_case(rng, specs)
        path = folder / f"blocks{case}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True))
        command = rng.choice(["check", "estimate", "pipeline", "export"] if "pipeline" in spec else
                             ["check", "estimate", "export"])
        argv = {"check": ["check", str(path)], "estimate": ["estimate", str(path), "--cluster", "a100-80g"],
                "pipeline": ["pipeline", str(path)],
                "export": ["export", str(path), "--to", "torch", "-o", str(folder / "m.py")]}[command]
        rc, out, err, elapsed = _run(argv, capsys)
        if wrong and command == "export" and "pipeline" in spec and "batch_inputs" in str(spec["pipeline"]):
            wrong = False  # (export writes the block's configuration; it does not cut micro-batches)
        blocks = {k: spec.get(k) for k in ("zero", "recompute", "pipeline", "constraints") if k in spec}
        # (check reports a block it cannot apply as a violation, exit 1, or refuses it, exit 2: never 0)
        _keeps_contract(argv + [str(blocks)[:200]], rc, out, err, refused=wrong, exits=(1, 2))
    assert time.perf_counter() - start < 180
