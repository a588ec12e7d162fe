"""The process that runs an audited checkout's rules, apart from layout-prop (a standalone script).

``layout-prop audit`` starts this file as ``python -I -S audit_worker.py IN_FD OUT_FD ROOT
PATHS_JSON PLATFORM``: a clean interpreter whose ``sys.path`` holds the standard library, the
checkout's root and a private folder with numpy (and, with ``--platform``, the folders its
platform layer needs); nothing of layout-prop is on it, and this file imports only the
standard library and numpy.  The parent (:mod:`layout_prop.interop.sandbox`) sends one JSON
object a line on ``IN_FD`` and reads the answers on ``OUT_FD``; the process's own stdout and
stderr go elsewhere, so what a rule prints never reaches the user nor the protocol.

Commands (``cmd``):

``load``
    Instantiate one op: import the yaml entry's module and class (when given), run the
    ``--module`` files, and take the op from the checkout's registry.  Answers
    ``{"ok": true, "expands": bool}`` or ``{"error": [type, message]}``.
``names``
    Run the ``--module`` files only; answers the op names they registered.
``infer``
    ``infer_layout`` on a batch of cases; one line per case: ``{"id", "raises": [type,
    message]}``, ``{"id", "answer": [item, ...]}`` (an item is ``{"layout": {...}}`` or
    ``{"value": ...}``), ``{"id", "bad": text}`` or ``{"id", "fatal": [type, message]}`` (the
    rule raised SystemExit or the like).
``expand``
    The rule's ``get_expand_impl`` on one rank's local arrays; every call of the kernel it
    makes is sent to the parent (``{"call": {"args", "over"}}``), which runs its own kernel
    and answers ``{"result": [...]}`` or ``{"kernel_failed": text}``; ends with ``{"none":
    true}`` (no expansion), ``{"result": [...]}`` or ``{"raised": [type, message]}``.

Values are JSON with two tags: ``{"__tuple__": [...]}`` and ``{"__nd__": base64 of .npy}``
(read with ``allow_pickle=False``).  Everything this process answers is data the parent
checks and judges by its own execution: nothing said here is believed.
"""

import base64
import contextlib
import copy
import importlib
import importlib.util
import io
import json
import os
import sys
import types
import warnings

#: the longest message, repr or answer list a reply carries
MAX_TEXT = 1200
MAX_ITEMS = 64
MAX_DEPTH = 8
MAX_VALUES = 4096


def _block_layout_prop():
    """Refuse ``import layout_prop`` (it is not on the path; this also covers an installed copy)."""

    class _Refuse:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "layout_prop" or name.startswith("layout_prop."):
                raise ImportError("layout-prop is not importable in the audit's worker")
            return None

    sys.meta_path.insert(0, _Refuse())


# --------------------------------------------------------------------------- values
def encode(value, depth=0, budget=None):
    """A value as tagged JSON data (tuples and arrays tagged); anything else as its type name.

    At most ``MAX_VALUES`` values in all (``budget`` counts them down), so a nested answer is cut short.
    """
    import numpy as np

    budget = [MAX_VALUES] if budget is None else budget
    budget[0] -= 1
    if depth > MAX_DEPTH or budget[0] < 0:
        return {"__other__": "a value nested too deep or too large"}
    if value is None or isinstance(value, (bool, str)):
        return value[:MAX_TEXT] if isinstance(value, str) else value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        return encode_array(value)
    if isinstance(value, (list, tuple)):
        items = [encode(v, depth + 1, budget) for v in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            items.append({"__other__": f"{len(value) - MAX_ITEMS} more items"})
        return {"__tuple__": items} if isinstance(value, tuple) else items
    return {"__other__": str(type(value).__name__)[:100]}


def encode_array(array):
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return {"__nd__": base64.b64encode(buffer.getvalue()).decode("ascii")}


def decode(value):
    """Tagged JSON data (from the parent) as Python values."""
    import numpy as np

    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        if "__nd__" in value:
            return np.load(io.BytesIO(base64.b64decode(value["__nd__"])), allow_pickle=False)
        return {k: decode(v) for k, v in value.items()}
    return value


def _over_file_limit(exc):
    """Whether ``exc`` is the worker's file-size limit (``RLIMIT_FSIZE``) refusing a write: what the
    rule printed or wrote went past it.  Python ignores ``SIGXFSZ``, so the write raises ``EFBIG``;
    that is the sandbox's doing, never a refusal of the inputs by the rule."""
    import errno

    return isinstance(exc, OSError) and exc.errno == errno.EFBIG


#: what the worker reports when a rule's output went past its file-size limit
FILE_LIMIT = ["OSError(EFBIG)", "it wrote past the audit worker's 16 MiB file-size limit "
              "(what a rule prints goes to a scratch file)"]


def _text(exc):
    try:
        message = str(exc)
    except BaseException:  # noqa: B036 - a hostile __str__
        message = "<its message cannot be shown>"
    if not isinstance(message, str):
        message = "<its message cannot be shown>"
    return [str(getattr(type(exc), "__name__", "exception"))[:100], message[:MAX_TEXT]]


# --------------------------------------------------------------------------- the stand-in platform
def _stand_in():
    import numpy as np

    class HostTensor(np.ndarray):
        """A numpy array with the few torch/MindSpore Tensor methods the rules' code calls."""

        def __new__(cls, data, dtype=None):
            return np.asarray(data, dtype=dtype).view(cls)

        def int(self):  # noqa: A003 - the Tensor method's name
            return self.astype(np.int32).view(HostTensor)

        def nonzero(self):
            return np.argwhere(np.asarray(self)).view(HostTensor)

        def numel(self):
            return int(self.size)

        @property
        def device(self):
            return "cpu"

    class HostPlatform:
        """What the rules read of hyper-parallel's platform layer: rank 0 (or the expanded rank), no groups."""

        Tensor = HostTensor
        rank = 0

        @staticmethod
        def tensor(data, *args):
            return np.asarray(data).view(HostTensor)

        @staticmethod
        def tensor_to_numpy(tensor):
            return np.asarray(tensor)

        def get_rank(self):
            return self.rank

        @staticmethod
        def get_world_size():
            return 1 << 20  # every mesh is "the last pipeline stage" (Layout.repeat_num)

        @staticmethod
        def init_process_group(*args, **kwargs):
            return None

        def __getattr__(self, name):
            raise AttributeError(f"layout-prop's stand-in for hyper-parallel's platform layer has no {name!r} "
                                 f"(audit runs the rules without MindSpore or torch)")

    return HostTensor, HostPlatform()


class Worker:
    def __init__(self, root, platform):
        self.root = root
        self.platform_mode = platform
        self.host = None
        self.ops = {}
        self.answers = {}
        if not platform:
            self.tensor_type, self.host = _stand_in()
            package = types.ModuleType("hyper_parallel")
            package.__path__ = [os.path.join(root, "hyper_parallel")]
            package.__file__ = os.path.join(root, "hyper_parallel", "__init__.py")
            plat = types.ModuleType("hyper_parallel.platform")
            plat.__path__ = [os.path.join(root, "hyper_parallel", "platform")]
            plat.__file__ = os.path.join(root, "hyper_parallel", "platform", "__init__.py")
            host = self.host
            plat.get_platform = lambda: host
            package.platform = plat
            sys.modules["hyper_parallel"] = package
            sys.modules["hyper_parallel.platform"] = plat
        else:
            importlib.import_module("hyper_parallel")
            self.tensor_type = None
        with self.quiet():
            self.layout_class = importlib.import_module("hyper_parallel.core.layout").Layout
            self.base_class = importlib.import_module("hyper_parallel.core.shard.ops.parallel_ops").DistributedOp
            self.registry = importlib.import_module(
                "hyper_parallel.core.shard.ops.parallel_ops_register")._DISTRIBUTED_OPS

    @contextlib.contextmanager
    def quiet(self):
        """The checkout's process-group set-up replaced by no-ops; its warnings silenced."""
        saved = []
        platform_mod = sys.modules.get("hyper_parallel.platform")
        mesh_mod = sys.modules.get("hyper_parallel.core.device_mesh")
        if self.platform_mode and platform_mod is not None:
            plat = platform_mod.get_platform()
            saved.append((plat, "init_process_group", plat.__dict__.get("init_process_group")))
            plat.init_process_group = lambda *args, **kwargs: None
        if self.platform_mode and mesh_mod is not None:
            cls = mesh_mod.DeviceMesh
            saved.append((cls, "_init_process_groups", cls.__dict__.get("_init_process_groups")))
            cls._init_process_groups = staticmethod(lambda *args, **kwargs: {})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            for owner, name, old in saved:
                if old is None:
                    with contextlib.suppress(AttributeError):
                        delattr(owner, name)
                else:
                    setattr(owner, name, old)

    @contextlib.contextmanager
    def as_rank(self, rank):
        if self.host is None:
            yield
            return
        old = self.host.rank
        self.host.rank = int(rank)
        try:
            yield
        finally:
            self.host.rank = old

    def host_tensor(self, array):
        import numpy as np

        return np.asarray(array).view(self.tensor_type) if self.tensor_type is not None else array

    # ----------------------------------------------------------------------- commands
    def run_files(self, files):
        if not files or getattr(self, "files_run", False):  # once per worker
            return
        self.files_run = True
        for k, path in enumerate(files):
            spec = importlib.util.spec_from_file_location(f"audit_user_module_{k}", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot import {path!r}: not a Python file name")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)

    def load(self, msg):
        name = msg["op"]
        with self.quiet():
            if msg.get("module"):
                module = importlib.import_module(msg["module"])
                getattr(module, msg["class"])(name)
            self.run_files(msg.get("files") or [])
        op = self.registry.get(name)
        if op is None:
            raise LookupError(f"no op {name!r} is registered")
        self.ops[name] = op
        get_impl = getattr(type(op), "get_expand_impl", None)
        return {"ok": True, "expands": get_impl is not None and get_impl is not self.base_class.get_expand_impl}

    def names(self, msg):
        before = dict(self.registry)
        with self.quiet():
            self.run_files(msg.get("files") or [])
        return {"names": [str(k)[:200] for k, v in self.registry.items() if before.get(k) is not v]}

    def layout(self, desc):
        if desc is None:
            return None
        base = self.layout_class(tuple(desc["mesh_shape"]), tuple(desc["alias_name"]), init_backend=False)
        out = base(*[tuple(e) if isinstance(e, list) else e for e in desc["alias_map"]])
        for axis, op in desc["partial"]:
            out.set_partial_by_dev_axis(axis, op)
        return out

    def item(self, value):
        if value is not None and hasattr(value, "tensor_map"):
            return {"layout": {"mesh_shape": encode(getattr(value, "mesh_shape", None)),
                               "tensor_map": encode(value.tensor_map), "partial": encode(getattr(value, "partial", None))}}
        return {"value": encode(value)}

    def infer(self, msg, send):
        op = self.ops[msg["op"]]
        self.answers = {}
        for case in msg["cases"]:
            with self.quiet():
                layouts = tuple(self.layout(d) for d in case["layouts"])
                try:
                    answer = op.infer_layout(layouts, decode(case["extra"]))
                except Exception as exc:  # the rule refuses these inputs (unless the sandbox made it fail)
                    if _over_file_limit(exc):
                        send({"id": case["id"], "fatal": FILE_LIMIT})
                    else:
                        send({"id": case["id"], "raises": _text(exc)})
                    continue
                except BaseException as exc:  # noqa: B036 - SystemExit, KeyboardInterrupt: no refusal
                    send({"id": case["id"], "fatal": _text(exc)})
                    continue
            try:
                items = list(answer) if isinstance(answer, (tuple, list)) else [answer]
                if len(items) > MAX_ITEMS:
                    send({"id": case["id"], "bad": f"an answer of {len(items)} values"})
                    continue
                reply = [self.item(v) for v in items]
            except Exception as exc:  # an answer whose attributes cannot be read
                send({"id": case["id"], "bad": "an answer that cannot be read: " + ": ".join(_text(exc))})
                continue
            self.answers[case["id"]] = (layouts, items)
            send({"id": case["id"], "answer": reply, "tuple": isinstance(answer, (tuple, list))})

    def expand(self, msg, send, receive):
        import numpy as np

        op = self.ops[msg["op"]]
        layouts, items = self.answers[msg["id"]]
        outputs = [items[i] for i in msg["out"]]
        position = {int(k): v for k, v in msg["position"].items()}  # operand -> argument position
        call_attrs = msg["call_attrs"]
        rank = msg["rank"]

        class KernelFailed(Exception):
            pass

        def func(*upos, **_keywords):
            args = [np.asarray(upos[position[i]]) for i in range(len(position))]
            over = {attr: encode(upos[p]) for attr, p in call_attrs.items()}
            send({"call": {"args": [encode_array(a) for a in args], "over": over}})
            reply = receive()
            if "kernel_failed" in reply:
                raise KernelFailed(reply["kernel_failed"])
            result = decode(reply["result"])
            return result[0] if reply.get("single") else tuple(result)

        try:
            with self.quiet(), self.as_rank(rank):
                impl = op.get_expand_impl(func, outputs[0] if len(outputs) == 1 else outputs, list(layouts),
                                          copy.deepcopy(decode(msg["extra"])))
            if impl is None:
                send({"none": True})
                return
            upos = [None] * msg["n_args"]
            for p, value in msg["call_values"]:
                upos[p] = decode(value)
            for i, a in enumerate(decode(msg["args"])):
                upos[position[i]] = self.host_tensor(a) if msg["host"] else a
            with self.quiet(), self.as_rank(rank):
                result = impl(*upos, **decode(msg["call_kwargs"]))
            results = list(result) if isinstance(result, (tuple, list)) else [result]
            send({"result": [encode_array(np.asarray(r)) for r in results[:MAX_ITEMS]]})
        except Exception as exc:
            send({"fatal": FILE_LIMIT} if _over_file_limit(exc) else {"raised": _text(exc)})


def main(argv):
    in_fd, out_fd, root, paths, platform = int(argv[1]), int(argv[2]), argv[3], json.loads(argv[4]), argv[5] == "1"
    sys.path[:] = [p for p in sys.path if "site-packages" not in p] + [root] + list(paths)
    _block_layout_prop()
    reader = os.fdopen(in_fd, "rb", buffering=1 << 16)
    writer = os.fdopen(out_fd, "wb", buffering=0)

    def send(obj):
        writer.write(json.dumps(obj, separators=(",", ":")).encode("utf-8") + b"\n")

    def receive():
        line = reader.readline()
        if not line:
            os._exit(0)  # the parent went away
        return json.loads(line)

    try:
        worker = Worker(root, platform)
    except BaseException as exc:  # noqa: B036 - the checkout's base modules do not load
        send({"error": _text(exc)})
        return
    send({"ok": True})
    while True:
        msg = receive()
        cmd = msg.get("cmd")
        try:
            if cmd == "load":
                send(worker.load(msg))
            elif cmd == "names":
                send(worker.names(msg))
            elif cmd == "infer":
                worker.infer(msg, send)
            elif cmd == "expand":
                worker.expand(msg, send, receive)
            else:
                send({"error": ["ValueError", f"unknown command {cmd!r}"]})
        except Exception as exc:
            send({"fatal": FILE_LIMIT} if _over_file_limit(exc) else {"error": _text(exc)})
        except BaseException as exc:  # noqa: B036 - SystemExit from the checkout's code: this worker is done
            send({"fatal": _text(exc)})
            return


if __name__ == "__main__":
    main(sys.argv)
