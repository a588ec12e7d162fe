"""``audit`` cannot be bent by the checkout it audits (issue #40 item 5).

The rules run in a worker process (a clean interpreter without layout-prop, resource and time
limits, a private protocol); a rule that crashes, hangs, prints, patches layout-prop or answers
garbage is a named failure of its op, and the other ops keep their verdicts.  Each case is a
small fake checkout written in ``tmp_path`` with the snapshot's structure
(``hyper_parallel/core/layout.py``, ``core/shard/ops/parallel_ops.py``, ``..._register.py``,
``yaml/*.yaml``); nothing here needs the shared snapshot.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

from layout_prop.cli import main

#: the fake checkout's Layout: the few members the audit's worker and the rules below use
LAYOUT = '''
class Layout:
    def __init__(self, mesh_shape, alias_name, init_backend=True):
        self.mesh_shape = tuple(mesh_shape)
        self.alias_name = tuple(alias_name)
        self.tensor_map = None
        self.alias_tensor_map = None
        self.partial = [None] * len(self.mesh_shape)

    def __call__(self, *alias):
        out = Layout(self.mesh_shape, self.alias_name)
        n = len(self.alias_name)

        def index(a):
            return n - 1 - self.alias_name.index(a)

        out.alias_tensor_map = alias
        out.tensor_map = tuple(-1 if a == "None" else tuple(index(x) for x in a) if isinstance(a, tuple)
                               else index(a) for a in alias)
        return out

    def set_partial_by_dev_axis(self, axis, op):
        self.partial[self.alias_name.index(axis)] = op

    def is_partial(self):
        return any(p is not None for p in self.partial)
'''

BASE = '''
from .parallel_ops_register import register_distributed_op


class DistributedOp:
    def __init__(self, op_name):
        self.op_name = op_name
        register_distributed_op(op_name, self)

    def infer_layout(self, layouts, extra_args):
        raise NotImplementedError

    def get_expand_impl(self, func, output_layout, layouts, extra_args):
        return None
'''

REGISTER = '''
_DISTRIBUTED_OPS = {}


def register_distributed_op(op_name, op_class):
    _DISTRIBUTED_OPS[op_name] = op_class


def get_distributed_op(op_name):
    return _DISTRIBUTED_OPS.get(op_name, None)
'''

#: a right elementwise rule: any sharding, no Partial input (what the snapshot's ReLU does)
GOOD = '''
from .parallel_ops import DistributedOp


class Elementwise(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        if layouts[0].is_partial():
            raise ValueError("no partial input")
        return layouts[0]
'''

#: hostile rules, one class each (the module is imported once per worker)
HOSTILE = '''
import os
import sys

from .parallel_ops import DistributedOp


class Answers42(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        return 42


class AnswersNone(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        return None


class Exits(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        os._exit(0)


class SysExit(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        sys.exit(0)


class Loops(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        while True:
            pass


class HugeTuple(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        return (layouts[0],) * 10 ** 6


class OtherMesh(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        return type(layouts[0])((8,), ("x",))("None", "None", "None")


class Forges(DistributedOp):
    """Writes a line of garbage where the worker answers the audit."""

    def infer_layout(self, layouts, extra_args):
        os.write(int(sys.argv[2]), b"all right, trust me\\n")
        return layouts[0]


class ClosesThePipe(DistributedOp):
    """Closes the worker's answer pipe and lives on."""

    def infer_layout(self, layouts, extra_args):
        import time

        os.close(int(sys.argv[2]))
        time.sleep(60)


class PatchesTheAudit(DistributedOp):
    """Wrong for exp (a partial sum is kept), and tries to turn the verdict into right."""

    def infer_layout(self, layouts, extra_args):
        try:
            import layout_prop.interop.audit as audit
            audit.execute = lambda *args, **kwargs: None
        except ImportError:
            pass
        for name in list(sys.modules):
            if name.startswith("layout_prop"):
                sys.modules[name].execute = lambda *args, **kwargs: None
        return layouts[0]


class Prints(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        print("{'not': 'json'} from a rule")
        sys.stderr.write("and on stderr\\n")
        if layouts[0].is_partial():
            raise ValueError("no partial input")
        return layouts[0]
'''


def make_checkout(root: Path, ops: dict[str, tuple[str, str]], modules: dict[str, str] | None = None,
                  layout: str = LAYOUT, yaml_text: str | None = None) -> Path:
    """A fake hyper-parallel checkout: ``ops`` maps an upstream op name to (module file, class)."""
    ops_dir = root / "hyper_parallel" / "core" / "shard" / "ops"
    (ops_dir / "yaml").mkdir(parents=True)
    for package in (root / "hyper_parallel", root / "hyper_parallel" / "core", root / "hyper_parallel" / "core" / "shard",
                    ops_dir):
        (package / "__init__.py").write_text("raise RuntimeError('the package __init__ must not run')\n"
                                             if package.name == "hyper_parallel" else "")
    (root / "hyper_parallel" / "core" / "layout.py").write_text(layout)
    (ops_dir / "parallel_ops.py").write_text(BASE)
    (ops_dir / "parallel_ops_register.py").write_text(REGISTER)
    for name, text in {"parallel_good": GOOD, "parallel_hostile": HOSTILE, **(modules or {})}.items():
        (ops_dir / f"{name}.py").write_text(text)
    if yaml_text is None:
        yaml_text = "".join(f"{name}:\n  distributed_op_class: {cls}\n  distributed_op_file: {module}\n"
                            for name, (module, cls) in ops.items())
    (ops_dir / "yaml" / "ops.yaml").write_text(yaml_text)
    return root


def audit_json(capsys, root: Path, *more: str) -> tuple[int, dict]:
    code = main(["audit", str(root), "--mesh", "4", "--time-limit", "2", "--json", *more])
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.fixture(scope="module")
def clean_relu(tmp_path_factory):
    """The good rule's report in a checkout of its own: what every hostile checkout must leave unchanged."""
    from layout_prop.interop.audit import Limits, run_audit
    from layout_prop.interop.hyper_parallel import read_checkout

    root = make_checkout(tmp_path_factory.mktemp("clean"), {"ReLU": ("parallel_good", "Elementwise")})
    report = run_audit(read_checkout(root), meshes=[(4,)], limits=Limits(call_seconds=5))
    relu = report.ops[0].to_dict()
    assert relu["right"] == 3 and relu["rejected"] == 1 and report.ok  # R, S(0), S(2) right; P(sum) refused
    return relu


def _by_op(data: dict) -> dict:
    return {o["op"]: o for o in data["ops"]}


def test_hostile_rules_are_named_failures_and_the_good_op_keeps_its_verdict(tmp_path, capsys, clean_relu):
    ops = {"ReLU": ("parallel_good", "Elementwise"), "Sigmoid": ("parallel_hostile", "Answers42"),
           "Silu": ("parallel_hostile", "AnswersNone"), "Cos": ("parallel_hostile", "Exits"),
           "Sin": ("parallel_hostile", "SysExit"), "Neg": ("parallel_hostile", "HugeTuple"),
           "relu": ("parallel_hostile", "OtherMesh"), "gelu": ("parallel_hostile", "Forges"),
           "sigmoid": ("parallel_hostile", "Prints"), "exp": ("parallel_hostile", "ClosesThePipe")}
    root = make_checkout(tmp_path, ops)
    code, data = audit_json(capsys, root)
    by_op = _by_op(data)
    assert code == 1 and data["ok"] is False
    expected = {"Sigmoid": "bad-answer", "Silu": "bad-answer", "Cos": "crashed", "Sin": "crashed", "exp": "crashed",
                "Neg": "bad-answer", "relu": "bad-answer", "gelu": "bad-answer"}
    assert {name: by_op[name].get("failure", {}).get("kind") for name in expected} == expected
    assert "42" in by_op["Sigmoid"]["failure"]["message"] and "None" in by_op["Silu"]["failure"]["message"]
    assert "exited with code 0" in by_op["Cos"]["failure"]["message"]
    assert "SystemExit" in by_op["Sin"]["failure"]["message"]
    assert "1000000 values" in by_op["Neg"]["failure"]["message"]
    assert "mesh [8]" in by_op["relu"]["failure"]["message"]
    assert "closed its answer pipe" in by_op["exp"]["failure"]["message"]
    assert data["failures"] == {"bad-answer": 5, "crashed": 3}
    # the good op's verdict is unchanged; printing is no failure and reaches neither stdout nor the verdict
    assert by_op["ReLU"] == {**clean_relu, "op": "ReLU"}
    assert by_op["sigmoid"]["right"] == 3 and "failure" not in by_op["sigmoid"]


def test_a_rule_that_patches_layout_prop_is_still_wrong(tmp_path, capsys):
    """Exp keeping a partial sum is wrong; the rule's attempt to patch the audit's execute changes nothing."""
    root = make_checkout(tmp_path, {"Exp": ("parallel_hostile", "PatchesTheAudit")})
    code, data = audit_json(capsys, root)
    exp = data["ops"][0]
    assert code == 1 and exp["wrong"] == 1 and exp["right"] == 3
    assert exp["reproducers"]["wrong"]["inputs"]["in0"]["placements"] == ["P(sum)"]


def test_looping_rules_time_out_and_the_audit_ends_in_time(tmp_path, capsys, clean_relu):
    """A rule looping in infer_layout and a module looping as it is imported: `timeout`, each after its limit."""
    modules = {"parallel_import_loop": "while True:\n    pass\n"}
    root = make_checkout(tmp_path, {"ReLU": ("parallel_good", "Elementwise"), "Exp": ("parallel_hostile", "Loops"),
                                    "Cos": ("parallel_import_loop", "Never")}, modules)
    start = time.monotonic()
    code = main(["audit", str(root), "--mesh", "4", "--time-limit", "1", "--json"])
    elapsed = time.monotonic() - start
    by_op = _by_op(json.loads(capsys.readouterr().out))
    assert code == 1 and elapsed < 20
    assert by_op["Exp"]["failure"]["kind"] == by_op["Cos"]["failure"]["kind"] == "timeout"
    assert "loading Cos" in by_op["Cos"]["failure"]["message"]
    assert by_op["ReLU"] == {**clean_relu, "op": "ReLU"}


def test_a_syntax_error_in_a_rule_module_is_a_load_failure_not_an_unknown_op(tmp_path, capsys):
    root = make_checkout(tmp_path, {"ReLU": ("parallel_good", "Elementwise"), "Exp": ("parallel_broken", "X")},
                         {"parallel_broken": "def broken(:\n"})
    code, data = audit_json(capsys, root, "--op", "Exp", "--op", "ReLU")
    by_op = _by_op(data)
    assert code == 1 and by_op["Exp"]["failure"]["kind"] == "load-failed"
    assert "SyntaxError" in by_op["Exp"]["failure"]["message"] and by_op["ReLU"]["right"] == 3
    code = main(["audit", str(root), "--mesh", "4", "--op", "Exp"])
    out = capsys.readouterr().out
    assert code == 1 and "Exp (layout-prop exp): load-failed: ops.yaml: SyntaxError" in out
    assert out.splitlines()[-1] == "some ops could not be audited"


def _refusal(capsys, args) -> str:
    assert main(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1, captured
    return err[0]


def test_yaml_names_outside_the_checkout_are_refused_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "ran"
    yaml_text = f"touch {marker}:\n  distributed_op_module: os\n  distributed_op_class: system\n"
    root = make_checkout(tmp_path / "c", {}, yaml_text=yaml_text)
    assert "foreign-module" in _refusal(capsys, ["audit", str(root), "--mesh", "4"])
    assert not marker.exists()
    for text in ("X:\n  distributed_op_module: hyper_parallel.nope\n  distributed_op_class: A\n",
                 "X:\n  distributed_op_file: ../../os\n  distributed_op_class: A\n"):
        (root / "hyper_parallel/core/shard/ops/yaml/ops.yaml").write_text(text)
        line = _refusal(capsys, ["audit", str(root), "--mesh", "4"])
        assert "foreign-module" in line or "bad-checkout" in line


@pytest.mark.parametrize("yaml_text", ["ReLU:\n  - distributed_op_class\n", "ReLU:\n  distributed_op_file: parallel_good\n",
                                       "ReLU:\n  distributed_op_file: nothing\n  distributed_op_class: A\n",
                                       "__default__: [1]\nReLU: {}\n"])
def test_a_malformed_yaml_entry_is_a_one_line_refusal(tmp_path, capsys, yaml_text):
    root = make_checkout(tmp_path, {}, yaml_text=yaml_text)
    assert "bad-checkout" in _refusal(capsys, ["audit", str(root), "--mesh", "4"])


def test_a_layout_module_without_layout_is_a_one_line_refusal(tmp_path, capsys):
    root = make_checkout(tmp_path, {"ReLU": ("parallel_good", "Elementwise")}, layout="X = 1\n")
    assert "upstream-import-failed" in _refusal(capsys, ["audit", str(root), "--mesh", "4"])


def test_a_mesh_of_four_axes_is_a_one_line_refusal(tmp_path, capsys):
    root = make_checkout(tmp_path, {"ReLU": ("parallel_good", "Elementwise")})
    assert "invalid-mesh" in _refusal(capsys, ["audit", str(root), "--mesh", "2x2x2x2"])


def test_the_worker_cannot_import_layout_prop(tmp_path, capsys):
    """The worker's interpreter has the checkout and numpy on its path, nothing of layout-prop."""
    probe = textwrap.dedent('''
        import sys
        from .parallel_ops import DistributedOp


        class Probe(DistributedOp):
            def infer_layout(self, layouts, extra_args):
                try:
                    import layout_prop  # noqa: F401
                except ImportError:
                    if layouts[0].is_partial():
                        raise ValueError("no partial input")
                    return layouts[0]
                return 42  # a bad answer, if layout_prop were importable
    ''')
    root = make_checkout(tmp_path, {"ReLU": ("parallel_probe", "Probe")}, {"parallel_probe": probe})
    code, data = audit_json(capsys, root)
    assert code == 0 and data["ops"][0]["right"] == 3


@pytest.mark.parametrize("text", ["raise ValueError('nope')\n", "import os\nos._exit(3)\n"])
def test_a_module_file_that_fails_or_exits_is_a_one_line_refusal(tmp_path, capsys, text):
    root = make_checkout(tmp_path / "c", {"ReLU": ("parallel_good", "Elementwise")})
    module = tmp_path / "mine.py"
    module.write_text(text)
    line = _refusal(capsys, ["audit", str(root), "--mesh", "4", "--module", str(module)])
    assert "module-failed" in line and ("ValueError: nope" in line or "exited with code 3" in line)


def test_a_module_file_registers_an_op_the_worker_audits(tmp_path, capsys, clean_relu):
    """--module: a user's rule for an op the checkout lacks (Exp) is audited with the checkout's ReLU."""
    root = make_checkout(tmp_path / "c", {"ReLU": ("parallel_good", "Elementwise")})
    module = tmp_path / "mine.py"
    module.write_text("from hyper_parallel.core.shard.ops.parallel_good import Elementwise\n\nElementwise('Exp')\n")
    code, data = audit_json(capsys, root, "--module", str(module))
    by_op = _by_op(data)
    assert code == 0 and by_op["Exp"]["source"] == str(module) and by_op["Exp"]["right"] == 3
    assert by_op["ReLU"] == {**clean_relu, "op": "ReLU"}


def test_the_parent_reads_the_workers_values_with_suspicion():
    """Arrays without pickle and of bounded size, known tags only, bounded nesting: else bad-answer."""
    import base64
    import io

    import numpy as np

    from layout_prop.interop.sandbox import WorkerFailure, decode_array, decode_value, encode_value

    array = np.arange(6.0).reshape(2, 3)
    assert np.array_equal(decode_array(encode_value(array)["__nd__"]), array)
    assert decode_value({"__tuple__": [1, [2, {"__tuple__": []}]]}) == (1, [2, ()])
    pickled, huge = io.BytesIO(), io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.lib.format.write_array_header_2_0(huge, {"descr": "<f8", "fortran_order": False, "shape": (10 ** 12,)})
    for text in (base64.b64encode(pickled.getvalue()).decode(), base64.b64encode(huge.getvalue()).decode(),
                 "not base64!", 42):
        with pytest.raises(WorkerFailure) as failure:
            decode_array(text)
        assert failure.value.kind == "bad-answer"
    deep = 1
    for _ in range(50):
        deep = [deep]
    for value in ({"__import__": "os"}, deep, {"__nd__": "x", "more": 1}):
        with pytest.raises(WorkerFailure):
            decode_value(value)


def test_an_expansion_that_fails_leaves_answers_unjudged_and_the_verdict_is_not_right(tmp_path, capsys):
    """A rule wrong for exp (a partial sum kept) whose get_expand_impl always raises: its answers cannot be
    executed (unjudged), and the audit does not say they are right (exit 1)."""
    rule = textwrap.dedent('''
        from .parallel_ops import DistributedOp


        class Unjudgeable(DistributedOp):
            def infer_layout(self, layouts, extra_args):
                return layouts[0]

            def get_expand_impl(self, func, output_layout, layouts, extra_args):
                raise RuntimeError("no execution for you")
    ''')
    root = make_checkout(tmp_path, {"Exp": ("parallel_unjudgeable", "Unjudgeable")}, {"parallel_unjudgeable": rule})
    assert main(["audit", str(root), "--mesh", "4", "--time-limit", "2"]) == 1
    out = capsys.readouterr().out
    assert "unjudged 4: the rule's expansion did not run on numpy arrays: RuntimeError: no execution for you" in out
    assert out.splitlines()[-1] == "no wrong answer found, but 4 accepted answers could not be judged"


#: what one op's code can leave behind in its worker, each aimed at the ops audited after it
LEFTOVERS = '''
import os
import sys
import threading
import time

from .parallel_ops import DistributedOp

MARKER = {marker!r}


class Elementwise(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        if layouts[0].is_partial():
            raise ValueError("no partial input")
        return layouts[0]


def _garbage_when_the_next_op_loads():
    """In a grandchild that left the worker's session: write garbage on the inherited answer pipe."""
    fd = int(sys.argv[2])
    deadline = time.monotonic() + 20
    while not os.path.exists(MARKER) and time.monotonic() < deadline:
        time.sleep(0.005)
    for _ in range(400):
        try:
            os.write(fd, b"garbage from an earlier op\\\\n")
        except OSError:
            break
        time.sleep(0.005)


class ForksAChild(Elementwise):
    def __init__(self, name):
        super().__init__(name)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                _garbage_when_the_next_op_loads()
            os._exit(0)
        os.wait()


def _patch_when_the_next_op_loads():
    good = "hyper_parallel.core.shard.ops.parallel_marked"
    deadline = time.monotonic() + 20
    while good not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.001)
    if good in sys.modules:
        sys.modules[good].Elementwise.infer_layout = lambda self, layouts, extra_args: layouts[0]


class PatchesTheNextOp(Elementwise):
    def __init__(self, name):
        super().__init__(name)
        threading.Thread(target=_patch_when_the_next_op_loads, daemon=True).start()
'''


def test_what_an_op_leaves_running_cannot_change_the_next_ops_verdict(tmp_path, capsys, clean_relu):
    """A grandchild writing on the old answer pipe, a thread patching the next op's class: ReLU unchanged.

    Cos and Exp (one module) are audited before ReLU (another); ReLU's module marks its import with
    a file, which the grandchild waits for.  Each module's ops get a worker of their own, so neither
    leftover reaches ReLU.
    """
    marker = tmp_path / "relu-imported"
    marked = f"open({str(marker)!r}, 'w').close()\n" + GOOD
    root = make_checkout(tmp_path / "co", {"Cos": ("parallel_leftovers", "ForksAChild"),
                                           "Exp": ("parallel_leftovers", "PatchesTheNextOp"),
                                           "ReLU": ("parallel_marked", "Elementwise")},
                         {"parallel_leftovers": LEFTOVERS.format(marker=str(marker)), "parallel_marked": marked})
    code, data = audit_json(capsys, root)
    by_op = _by_op(data)
    assert marker.exists()  # ReLU's module was imported: the leftovers had their chance
    assert by_op["ReLU"] == {**clean_relu, "op": "ReLU"}
    assert "failure" not in by_op["Cos"] and "failure" not in by_op["Exp"] and code == 0


def test_a_rule_printing_past_the_file_size_limit_is_a_failure_not_a_refusal(tmp_path, capsys, clean_relu):
    """Past the worker's 16 MiB file-size limit a write raises OSError (EFBIG): that is the sandbox's doing.

    It was taken for the rule refusing the inputs: Exp 'rejected 4 (over-strict 3)', exit 0.
    """
    floods = textwrap.dedent('''
        import os

        from .parallel_good import Elementwise


        class Floods(Elementwise):
            def infer_layout(self, layouts, extra_args):
                for _ in range(300):  # 19 MiB
                    os.write(1, b"x" * 65536)
                return super().infer_layout(layouts, extra_args)
    ''')
    root = make_checkout(tmp_path, {"Exp": ("parallel_floods", "Floods"), "ReLU": ("parallel_good", "Elementwise")},
                         {"parallel_floods": floods})
    code, data = audit_json(capsys, root)
    by_op = _by_op(data)
    assert code == 1 and by_op["Exp"]["failure"]["kind"] == "crashed"
    assert "16 MiB file-size limit" in by_op["Exp"]["failure"]["message"]
    assert by_op["ReLU"] == {**clean_relu, "op": "ReLU"}
