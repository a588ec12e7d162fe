"""The loss family: cross entropy against a hand-written reference, the vocab-parallel three-node form on
(4,) and (2, 2) meshes (equal to one device forward and backward, and to cross_entropy; no logits moved),
the counter-based generator against splitmix64 written out in Python integers, dropout's mask and
gradient, multinomial's invariants, and the typed errors (exit 2, one line)."""

from __future__ import annotations

import itertools
import json
import math
import subprocess

import numpy as np
import pytest

from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import ExecutionError
from layout_prop.io.loader import load_spec
from layout_prop.kernels.loss_numpy import (counter_uniform, cross_entropy, cross_entropy_grad, dropout,
                                            multinomial)
from layout_prop.runner import execute_global, random_inputs, run_graph

from .cli_support import cli_env, console_command

MASK64 = (1 << 64) - 1


def cli(tmp_path, capsys, spec: dict, *args: str) -> tuple[int, str, str]:
    """``layout-prop COMMAND spec.json ARGS`` in this process: (exit code, stdout, stderr)."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    code = main([args[0], str(path), *args[1:]])
    out, err = capsys.readouterr()
    return code, out, err


def splitmix64_reference(state: int) -> int:
    """splitmix64's next output from ``state``, in Python integers (Vigna's splitmix64.c)."""
    z = (state + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def test_counter_uniform_is_splitmix64_of_the_seeded_counter():
    assert splitmix64_reference(0) == 0xE220A8397B1DCDAF  # the generator's published first output
    for seed, index in itertools.product([0, 1, 7, 2**31 + 5], [0, 1, 2, 12345, 2**32 - 1]):
        want = (splitmix64_reference(((seed << 32) + index) & MASK64) >> 11) / 2.0**53
        assert counter_uniform(seed, [index])[0] == want, (seed, index)
    u = counter_uniform(3, np.arange(200_000))
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.005


# ------------------------------------------------------------------------------ cross entropy
def reference_cross_entropy(logits, target, ignore_index=-100, reduction="mean", eps=0.0):
    """torch's formula written out one token at a time with math.exp and math.log."""
    rows = logits.reshape(-1, logits.shape[-1]).tolist()
    targets = target.reshape(-1).tolist()
    losses, count = [], 0
    for row, t in zip(rows, targets):
        if t == ignore_index:
            losses.append(0.0)
            continue
        count += 1
        lse = math.log(sum(math.exp(v) for v in row))
        nll = lse - row[t]
        smooth = sum(lse - v for v in row) / len(row)
        losses.append((1 - eps) * nll + eps * smooth)
    if reduction == "none":
        return np.array(losses).reshape(target.shape)
    return sum(losses) / count if reduction == "mean" else sum(losses)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_cross_entropy_kernel_matches_the_written_out_formula(reduction, eps):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 4, 7)) * 3
    target = rng.integers(0, 7, (3, 4))
    target[0, 2] = target[2, 1] = -100
    got = cross_entropy(logits, target, reduction=reduction, label_smoothing=eps)
    np.testing.assert_allclose(got, reference_cross_entropy(logits, target, -100, reduction, eps), rtol=1e-12)


def test_cross_entropy_grad_matches_central_differences():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4, 6))
    target = np.array([1, 5, 3, 3])
    attrs = {"ignore_index": 3, "reduction": "mean", "label_smoothing": 0.2}
    grad = cross_entropy_grad(np.float64(1.0), logits, target, **attrs)
    h = 1e-6
    for i, j in itertools.product(range(4), range(6)):
        up, down = logits.copy(), logits.copy()
        up[i, j] += h
        down[i, j] -= h
        fd = (cross_entropy(up, target, **attrs) - cross_entropy(down, target, **attrs)) / (2 * h)
        assert abs(fd - grad[i, j]) < 1e-7, (i, j)
    assert not grad[2].any() and not grad[3].any()  # ignored tokens get no gradient


def vocab_parallel_spec(mesh, logits_placements, target_placements, reduction, classes=9, shape=(5, 3)):
    return {
        "mesh": {"shape": list(mesh), "names": ["a", "b"][:len(mesh)]},
        "inputs": {"logits": {"shape": [*shape, classes], "placements": list(logits_placements)},
                   "target": {"shape": list(shape), "dtype": "int64", "placements": list(target_placements)}},
        "nodes": [{"name": "m", "op": "max", "inputs": ["logits"], "attrs": {"dims": [-1]}},
                  {"name": "parts", "op": "cross_entropy_parts", "inputs": ["logits", "target", "m"],
                   "attrs": {"ignore_index": 2}},
                  {"name": "loss", "op": "cross_entropy_combine", "inputs": ["parts", "m", "target"],
                   "attrs": {"num_classes": classes, "ignore_index": 2, "reduction": reduction,
                             "label_smoothing": 0.1}}],
        "outputs": ["loss"]}


VOCAB_CASES = [
    ((4,), ["S(2)"], ["R"], "mean"),  # 9 classes on 4: 3, 3, 3, 0 (a rank without classes)
    ((4,), ["S(0)"], ["S(0)"], "sum"),  # tokens 5 on 4: 2, 2, 1, 0
    ((4,), ["S(2)"], ["S(1)"], "none"),
    ((2, 2), ["S(0)", "S(2)"], ["S(0)", "R"], "mean"),  # data-parallel tokens, vocab-parallel classes
    ((2, 2), ["S(2)", "S(2)"], ["R", "R"], "sum"),  # classes cut by both axes
    ((2, 2), ["S(1)", "S(2)"], ["S(1)", "R"], "none"),
    ((2, 2), ["R", "S(0)"], ["S(1)", "S(0)"], "mean"),
]


@pytest.mark.parametrize("mesh, logits_ps, target_ps, reduction", VOCAB_CASES)
def test_vocab_parallel_cross_entropy_equals_one_device_and_cross_entropy(mesh, logits_ps, target_ps, reduction):
    graph = load_spec(vocab_parallel_spec(mesh, logits_ps, target_ps, reduction))
    report = run_graph(graph, backward=True, seed=4)
    assert report.ok, report.mismatches
    assert set(report.grads) == {"logits"}
    # the three nodes compute cross_entropy: compare on one device with the single op on the same inputs
    inputs = random_inputs(graph, seed=4)
    three = execute_global(graph, inputs)["loss"]
    one = cross_entropy(inputs["logits"], inputs["target"], ignore_index=2, reduction=reduction, label_smoothing=0.1)
    np.testing.assert_allclose(three, one, rtol=2e-6, atol=1e-6)


def test_vocab_parallel_check_moves_no_logits(tmp_path, capsys):
    """Megatron's communication: the all-reduce of the max and of the three parts, never the logits (and for
    the mean over data-parallel tokens, a gather of the integer target)."""
    spec = vocab_parallel_spec((2, 2), ["S(0)", "S(2)"], ["S(0)", "R"], "mean", classes=512, shape=(4, 16))
    code, out, err = cli(tmp_path, capsys, spec, "check", "--reshard", "--backward", "--json")
    assert code == 0, err
    report = json.loads(out)
    moves = [(r["input"], r["from"], r["to"], [s["kind"] for s in r["steps"]]) for r in report["redistributions"]]
    assert not [m for m in moves if m[0] == "logits" or "all-to-all" in m[3]], moves
    # the mean counts the tokens that are not ignored over the whole (integer) target: its one gather
    assert [m for m in moves if "all-gather" in m[3]] == [("target", ["S(0)", "R"], ["R", "R"], ["all-gather"])]
    assert ("m", ["S(0)", "P(max)"], ["S(0)", "R"], ["all-reduce"]) in moves
    assert ("parts", ["S(0)", "P(sum)"], ["S(0)", "R"], ["all-reduce"]) in moves


def test_single_cross_entropy_moves_sharded_classes_to_tokens_and_names_the_vocab_parallel_form():
    spec = vocab_parallel_spec((4,), ["S(2)"], ["R"], "mean")
    spec["nodes"] = [{"name": "loss", "op": "cross_entropy", "inputs": ["logits", "target"]}]
    violations = analyze(load_spec(spec)).report()["violations"]
    assert [v["code"] for v in violations] == ["sharded-class-dim"]
    assert "cross_entropy_parts" in violations[0]["hint"]
    assert "all-to-all logits on 'a' to shard its dim 0 instead" in violations[0]["hint"]  # the larger token dim
    report = run_graph(load_spec(spec), backward=True, seed=0)
    assert report.ok, report.mismatches  # right, but it moves logits: tokens instead of classes, there and back
    assert [(c["kind"], c["node"]) for c in report.collectives] == [("all-to-all", "loss/logits"),
                                                                    ("all-to-all", "grad/logits")]


@pytest.mark.parametrize("change, code", [
    ({"target_dtype": "float32"}, "invalid-target"),
    ({"target_shape": [5, 4]}, "invalid-target"),
    ({"attrs": {"reduction": "avg"}}, "bad-attr"),
    ({"attrs": {"label_smoothing": 1.5}}, "bad-attr"),
])
def test_unusable_cross_entropy_input_is_one_line_and_exit_2(change, code, tmp_path, capsys):
    spec = {"mesh": {"shape": [2]},
            "inputs": {"logits": {"shape": [5, 3, 9]},
                       "target": {"shape": change.get("target_shape", [5, 3]),
                                  "dtype": change.get("target_dtype", "int64")}},
            "nodes": [{"name": "loss", "op": "cross_entropy", "inputs": ["logits", "target"],
                       "attrs": change.get("attrs", {})}]}
    if spec["inputs"]["target"]["dtype"] == "float32":
        spec["inputs"]["target"]["requires_grad"] = False
    exit_code, out, err = cli(tmp_path, capsys, spec, "check")
    assert exit_code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and code in lines[0] and "Traceback" not in err, err


def test_target_out_of_range_is_an_execution_error_not_a_wrong_answer():
    with pytest.raises(ExecutionError) as info:
        cross_entropy(np.zeros((3, 4)), np.array([0, 4, -100]))
    assert info.value.code == "target-out-of-range" and "target 4" in info.value.message
    # through the CLI: the kit's random targets lie in [0, 8), so 5 classes get targets out of range
    spec = {"mesh": {"shape": [2]}, "inputs": {"logits": {"shape": [6, 5], "placements": ["S(0)"]},
                                               "target": {"shape": [6], "dtype": "int64"}},
            "nodes": [{"name": "loss", "op": "cross_entropy", "inputs": ["logits", "target"]}]}
    done = subprocess.run(console_command() + ["run", "-", "--seed", "0"], input=json.dumps(spec), capture_output=True,
                          text=True, env=cli_env(), timeout=60)
    assert done.returncode == 2 and "target-out-of-range" in done.stderr, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ dropout
def test_dropout_keeps_one_minus_p_and_scales():
    x = np.ones((400, 500), np.float32)
    y = dropout(x, p=0.3, seed=11)
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.005  # 200,000 draws: the standard error is 0.001
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)
    assert (dropout(x, p=0.3, seed=11) == y).all() and not (dropout(x, p=0.3, seed=12) == y).all()
    assert (dropout(x, p=0.3, seed=11, training=False) == x).all()
    # a piece keyed by its global offsets draws what the whole draws there
    np.testing.assert_array_equal(dropout(x[100:200, 250:], p=0.3, seed=11, offsets=[100, 250],
                                          global_shape=[400, 500]), y[100:200, 250:])


def test_dropout_gradient_uses_the_forward_mask():
    spec = {"mesh": {"shape": [2, 2]}, "inputs": {"x": {"shape": [5, 6], "placements": ["S(0)", "S(1)"]}},
            "nodes": [{"name": "y", "op": "dropout", "inputs": ["x"], "attrs": {"p": 0.4, "seed": 3}}]}
    report = run_graph(load_spec(spec), backward=True, seed=1)
    assert report.ok and set(report.grads) == {"x"}
    x = np.random.default_rng(0).standard_normal((5, 6))
    y = dropout(x, p=0.4, seed=3)
    dy = np.random.default_rng(1).standard_normal((5, 6))
    np.testing.assert_allclose(dropout(dy, p=0.4, seed=3), np.where(y != 0, dy / 0.6, 0.0), rtol=1e-12)


@pytest.mark.parametrize("p", [1.0, -0.1, "half"])
def test_dropout_p_outside_0_1_is_exit_2(p, tmp_path, capsys):
    spec = {"mesh": {"shape": [2]}, "inputs": {"x": {"shape": [4, 4]}},
            "nodes": [{"name": "y", "op": "dropout", "inputs": ["x"], "attrs": {"p": p}}]}
    code, out, err = cli(tmp_path, capsys, spec, "check")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "bad-attr" in err or "bad-value" in err


# ------------------------------------------------------------------------------ multinomial
@pytest.mark.parametrize("mesh, placements", [((4,), ["S(0)"]), ((4,), ["S(1)"]), ((2, 2), ["S(0)", "S(1)"]),
                                              ((2, 2), ["S(1)", "S(0)"]), ((2, 2), ["R", "S(0)"])])
def test_multinomial_draws_what_one_device_draws(mesh, placements):
    spec = {"mesh": {"shape": list(mesh)},  # (probs of one or two dims, as torch takes)
            "inputs": {"x": {"shape": [15, 9], "placements": placements, "requires_grad": False}},
            "nodes": [{"name": "w", "op": "exp", "inputs": ["x"]},
                      {"name": "s", "op": "multinomial", "inputs": ["w"], "attrs": {"num_samples": 4}},
                      {"name": "r", "op": "multinomial", "inputs": ["w"],
                       "attrs": {"num_samples": 11, "replacement": True, "seed": 5}}],
            "outputs": ["s", "r"]}
    report = run_graph(load_spec(spec), seed=2)
    assert report.ok, report.mismatches
    assert all(report.outputs[name]["max_abs_err"] == 0 for name in ("s", "r"))


def test_multinomial_invariants():
    w = np.array([[0.0, 1.0, 3.0, 0.0, 6.0]] * 2000)
    without = multinomial(w, 3, seed=1)
    assert without.shape == (2000, 3) and without.dtype == np.int64
    assert set(np.unique(without)) == {1, 2, 4}  # zero weights never drawn
    assert all(len(set(row)) == 3 for row in without.tolist())  # no class twice
    first = np.bincount(without[:, 0], minlength=5) / 2000  # the first draw follows the weights
    np.testing.assert_allclose(first, [0, 0.1, 0.3, 0, 0.6], atol=0.04)
    draws = multinomial(w, 50, replacement=True, seed=2)
    freq = np.bincount(draws.ravel(), minlength=5) / draws.size
    np.testing.assert_allclose(freq, [0, 0.1, 0.3, 0, 0.6], atol=0.01)  # 100,000 draws
    with pytest.raises(ExecutionError) as info:
        multinomial(np.array([[1.0, 0.0, 0.0]]), 2)
    assert info.value.code == "invalid-probs"


def test_vocab_parallel_gradient_matches_central_differences():
    """The three nodes' backward (max_grad, cross_entropy_parts_grad, cross_entropy_combine_grad) in float64
    against central differences of the loss, on one device."""
    spec = vocab_parallel_spec((1,), ["R"], ["R"], "mean", shape=(3, 2))
    spec["inputs"]["logits"]["dtype"] = "float64"
    joint = analyze(load_spec(spec), backward=True).graph
    inputs = random_inputs(joint, seed=5)
    env = execute_global(joint, inputs)
    forward = analyze(load_spec(spec)).graph
    grad, logits = env["grad/logits"], inputs["logits"]
    dy = float(inputs["cotangent/loss"])
    h = 1e-6
    for index in itertools.product(range(3), range(2), range(9)):
        up, down = dict(inputs), dict(inputs)
        up["logits"], down["logits"] = logits.copy(), logits.copy()
        up["logits"][index] += h
        down["logits"][index] -= h
        fd = dy * (execute_global(forward, up)["loss"] - execute_global(forward, down)["loss"]) / (2 * h)
        assert abs(fd - grad[index]) < 1e-7, (index, fd, grad[index])
