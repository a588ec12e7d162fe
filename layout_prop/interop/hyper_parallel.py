"""Load the sharding rules of a hyper-parallel checkout, and convert its layouts to ours.

hyper-parallel (MindSpore's hyper-parallel package, Apache-2.0) registers one
``DistributedOp`` instance per op name: its ``yaml/`` files under
``hyper_parallel/core/shard/ops`` name the class and module of each op, and instantiating
the class registers it.  :func:`load_checkout` does the same from a path the user gives,
without copying any of it into this repository, and returns the registry.

Nothing of the checkout's platform layer runs by default: its package ``__init__`` (which
imports the whole API and starts MindSpore or torch) is skipped, and ``get_platform()``
returns a stand-in that gives the rules what they read (a numpy Tensor, rank 0, no process
groups).  With ``platform=True`` the package is imported as it is; a ``Layout`` then builds a
device mesh that would initialise a process group (HCCL or mccl), so while the checkout's
code runs :func:`quiet_backend` replaces the platform's ``init_process_group`` and the
mesh's ``_init_process_groups`` by no-ops (and restores them afterwards).  A module that
does not import is refused with one line (``upstream-import-failed``).

Layout conversions: :func:`to_upstream` writes one of our layouts as
``Layout(mesh_shape, alias_name)(*alias_tensor_map)`` plus ``set_partial_by_dev_axis``;
:func:`from_upstream` reads a ``Layout`` back (device matrix, tensor_map, partial status);
:func:`upstream_text` writes the reproducer form.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from layout_prop.core.errors import LayoutError, LayoutPropError, OpError, SpecError, cut, describe
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh

__all__ = ["Checkout", "CheckoutFiles", "YamlEntry", "read_checkout", "yaml_entries", "load_checkout", "quiet_backend", "to_upstream", "from_upstream", "upstream_text",
           "OPS_DIR", "host_rank", "host_tensor"]

#: where a checkout keeps its rules, relative to its root
OPS_DIR = Path("hyper_parallel") / "core" / "shard" / "ops"
#: the partial ops both sides know
_PARTIAL_OPS = ("sum", "avg", "max", "min")


@dataclass
class Checkout:
    """A loaded hyper-parallel checkout.

    ``ops`` maps each registered op name to its ``DistributedOp`` instance; ``sources``
    to the yaml file (or module) that registered it; ``layout_class`` is the checkout's
    ``Layout``; ``failed`` maps op names whose class could not be loaded to the reason.
    """

    root: Path
    ops: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    layout_class: Any = None
    base_class: Any = None
    platform: str = ""  # "stand-in" (layout-prop's, the default) or "package" (hyper-parallel's own)
    given: str = ""  # the path as the user wrote it (reports print it: the same on every machine)
    registry: dict = field(default_factory=dict)


def _check_root(path: Path) -> Path:
    root = Path(path)
    if not (root / OPS_DIR).is_dir():
        raise SpecError("not-a-checkout", f"the folder has no {OPS_DIR.as_posix()}",
                        path=str(path), hint="give the folder that holds hyper_parallel/ (a hyper-parallel checkout)")
    return root.resolve()


@contextlib.contextmanager
def quiet_backend(checkout: Checkout | None = None):
    """Run the checkout's code with its process-group set-up replaced by no-ops (restored on exit)."""
    platform_mod = sys.modules.get("hyper_parallel.platform")
    mesh_mod = sys.modules.get("hyper_parallel.core.device_mesh")
    saved = []
    if platform_mod is not None:
        platform = platform_mod.get_platform()
        saved.append((platform, "init_process_group", platform.__dict__.get("init_process_group")))
        platform.init_process_group = lambda *args, **kwargs: None
    if mesh_mod is not None:
        cls = mesh_mod.DeviceMesh
        saved.append((cls, "_init_process_groups", cls.__dict__.get("_init_process_groups")))
        cls._init_process_groups = staticmethod(lambda *args, **kwargs: {})
    try:
        with warnings.catch_warnings():  # the rules' own warnings (a conservative fallback...) are no output
            warnings.simplefilter("ignore")
            yield
    finally:
        for owner, name, old in saved:
            if old is None:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, old)


class _HostTensor(np.ndarray):
    """A numpy array with the few torch/MindSpore Tensor methods the rules' mesh code calls."""

    def __new__(cls, data, dtype=None):
        return np.asarray(data, dtype=dtype).view(cls)

    def int(self):  # noqa: A003 - the Tensor method's name
        return self.astype(np.int32).view(_HostTensor)

    def nonzero(self):
        return np.argwhere(np.asarray(self)).view(_HostTensor)

    def numel(self) -> int:
        return int(self.size)

    @property
    def device(self) -> str:  # what an expansion passes on to the kernel's tensors
        return "cpu"


def host_tensor(array) -> "_HostTensor":
    """``array`` as the stand-in platform's Tensor (a numpy view with the methods the rules' code calls)."""
    return np.asarray(array).view(_HostTensor)


def _host_tensor(data, *args) -> _HostTensor:
    return np.asarray(data).view(_HostTensor)


class _HostPlatform:
    """What the rules and their ``Layout``/``DeviceMesh`` read of hyper-parallel's platform layer.

    One process, rank 0, no process groups: ``infer_layout`` reads a mesh's shape, names and
    rank list only.  An attribute not listed here raises ``AttributeError`` naming it.
    """

    Tensor = _HostTensor
    tensor = staticmethod(_host_tensor)

    @staticmethod
    def tensor_to_numpy(tensor):
        return np.asarray(tensor)

    rank = 0  # the rank an expansion runs as (host_rank); infer_layout itself reads no rank

    def get_rank(self) -> int:
        return self.rank

    @staticmethod
    def get_world_size() -> int:
        return 1 << 20  # every mesh is "the last pipeline stage" (Layout.repeat_num)

    @staticmethod
    def init_process_group(*args, **kwargs) -> None:
        return None

    def __getattr__(self, name):
        raise AttributeError(f"layout-prop's stand-in for hyper-parallel's platform layer has no {name!r} "
                             f"(audit runs the rules without MindSpore or torch)")


_HOST_PLATFORM = _HostPlatform()


@contextlib.contextmanager
def host_rank(rank: int):
    """While an expansion runs for ``rank``, the stand-in platform's ``get_rank()`` answers it."""
    old = _HOST_PLATFORM.rank
    _HOST_PLATFORM.rank = int(rank)
    try:
        yield
    finally:
        _HOST_PLATFORM.rank = old


def _install_host_platform(root: Path) -> None:
    """Put ``hyper_parallel`` (without running its ``__init__``) and a platform stand-in in ``sys.modules``.

    The package's ``__init__`` imports its whole API, and ``hyper_parallel.platform`` starts
    MindSpore or torch; the rules need neither (``core``, ``core/shard`` and ``core/shard/ops``
    have empty ``__init__`` files).  A snapshot that needs a newer MindSpore than the installed
    one loads this way too.
    """
    package_dir = root / "hyper_parallel"
    package = types.ModuleType("hyper_parallel")
    package.__path__ = [str(package_dir)]
    package.__file__ = str(package_dir / "__init__.py")
    platform = types.ModuleType("hyper_parallel.platform")
    platform.__path__ = [str(package_dir / "platform")]
    platform.__file__ = str(package_dir / "platform" / "__init__.py")
    platform.get_platform = lambda: _HOST_PLATFORM
    package.platform = platform
    sys.modules["hyper_parallel"] = package
    sys.modules["hyper_parallel.platform"] = platform


def _import(name: str):
    try:
        return importlib.import_module(name)
    except LayoutPropError:
        raise
    except BaseException as exc:  # an ImportError, or a platform layer failing as it starts: one line
        raise SpecError("upstream-import-failed", f"importing {name} failed: {describe(exc)}",
                        hint="the checkout's platform layer (MindSpore) must import in this Python; "
                             "run `python -c 'import " + name + "'` with the checkout on PYTHONPATH to see why") \
            from None


#: a dotted module name, and a class or file name, as the yaml files may give them
_MODULE_NAME = re.compile(r"hyper_parallel(\.[A-Za-z_][A-Za-z0-9_]*)+")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class YamlEntry:
    """One op of a checkout's ``ops/yaml`` files: its name, the module and class that implement it."""

    name: str
    module: str
    cls: str
    source: str


def _entry(root: Path, name: str, config: Any, default: dict, path: Path) -> YamlEntry:
    """One yaml entry, checked: a mapping whose module is a file of the checkout's own package."""
    where = f"{path.name}: {cut(name)}"
    if config is not None and not isinstance(config, dict):
        raise SpecError("bad-checkout", f"{where} is a {type(config).__name__}, not a mapping", path=str(path),
                        hint="each op of an ops/yaml file maps distributed_op_class and distributed_op_file")
    merged = {**default, **(config or {})}
    module = merged.get("distributed_op_module")
    if module is None:
        file = merged.get("distributed_op_file")
        if not isinstance(file, str) or not _IDENTIFIER.fullmatch(file):
            raise SpecError("bad-checkout", f"{where}: distributed_op_file {cut(file)} is not a module name",
                            path=str(path), hint="give the name of a module of hyper_parallel/core/shard/ops")
        module = "hyper_parallel.core.shard.ops." + file
    if not isinstance(module, str) or not _MODULE_NAME.fullmatch(module):
        raise SpecError("foreign-module", f"{where}: module {cut(module)} is not in the checkout's package "
                        f"hyper_parallel", path=str(path),
                        hint="audit imports only the checkout's own modules (hyper_parallel.*)")
    cls = merged.get("distributed_op_class")
    if not isinstance(cls, str) or not _IDENTIFIER.fullmatch(cls):
        raise SpecError("bad-checkout", f"{where}: distributed_op_class {cut(cls)} is not a class name",
                        path=str(path), hint="give the name of a DistributedOp subclass of the module")
    relative = Path(*module.split("."))
    if not ((root / relative).with_suffix(".py").is_file() or (root / relative / "__init__.py").is_file()):
        raise SpecError("bad-checkout", f"{where}: module {cut(module)} is not a file of the checkout",
                        path=str(path), hint=f"a module hyper_parallel.X names a file under {root.name}/hyper_parallel")
    return YamlEntry(str(name), module, cls, path.name)


def yaml_entries(root: Path) -> list[YamlEntry]:
    """The ops the checkout's ``ops/yaml`` files declare, checked (a refusal for a malformed entry)."""
    import yaml

    entries = []
    for path in sorted((root / OPS_DIR / "yaml").glob("*.yaml")):
        try:
            if not path.is_file() or path.stat().st_size > (8 << 20):
                raise OSError("not a regular file of at most 8 MiB")
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
            raise SpecError("bad-checkout", f"cannot read {path.name}: {describe(exc)}", path=str(path),
                            hint="the checkout's ops/yaml files must be readable YAML") from None
        if not isinstance(data, dict):
            continue
        default = data.pop("__default__", None) or {}
        if not isinstance(default, dict):
            raise SpecError("bad-checkout", f"{path.name}: __default__ is not a mapping", path=str(path),
                            hint="__default__ maps keys shared by the file's ops")
        for name, config in data.items():
            entries.append(_entry(root, name, config, default, path))
    return entries


@dataclass
class CheckoutFiles:
    """A checkout as ``audit`` reads it without importing any of it: its root and its yaml entries.

    ``modules`` are the user's ``--module`` files (run in the audit's worker after the checkout).
    """

    root: Path
    entries: dict[str, YamlEntry]
    given: str = ""
    platform: bool = False
    modules: tuple[str, ...] = ()


def read_checkout(path: str | Path, platform: bool = False, modules=()) -> CheckoutFiles:
    """The checkout at ``path`` (refused with ``not-a-checkout``, ``bad-checkout`` or ``foreign-module``)."""
    root = _check_root(Path(path))
    for module in modules:
        if not Path(module).is_file():
            raise OpError("module-not-found", f"no Python file at {cut(str(module))}",
                          hint="give the path of a .py file")
    entries = {e.name: e for e in yaml_entries(root)}
    return CheckoutFiles(root, entries, str(path), platform, tuple(str(Path(m).resolve()) for m in modules))


def load_checkout(path: str | Path, platform: bool = False) -> Checkout:
    """Import the ``DistributedOp`` classes of the checkout at ``path`` and instantiate each yaml entry.

    By default the package's ``__init__`` and its platform layer do not run: a stand-in gives
    the rules what they read (:func:`_install_host_platform`).  ``platform=True`` imports the
    package as it is, with its platform layer (MindSpore or torch must import).  The first
    load in a process decides; a later one reuses it.

    Raises ``SpecError`` ``not-a-checkout`` for a folder without ``hyper_parallel/core/shard/ops``,
    ``upstream-import-failed`` when its package or Layout type does not import.  A single op
    whose class does not load is recorded in ``Checkout.failed`` (the others still load).
    """
    root = _check_root(Path(path))
    loaded = sys.modules.get("hyper_parallel")
    if loaded is not None and getattr(loaded, "__file__", None):
        where = Path(loaded.__file__).resolve().parent.parent
        if where != root:
            raise SpecError("upstream-already-loaded", f"this process already imported hyper_parallel from "
                            f"{cut(str(where))!r}", hint="audit one checkout per process")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    if loaded is None and not platform:
        _install_host_platform(root)
    checkout = Checkout(root=root, given=str(path))
    if platform:
        _import("hyper_parallel")  # the package's own __init__, which starts its platform layer
    checkout.platform = "stand-in" if _import("hyper_parallel.platform").get_platform() is _HOST_PLATFORM \
        else "package"
    layout_mod = _import("hyper_parallel.core.layout")
    ops_mod = _import("hyper_parallel.core.shard.ops.parallel_ops")
    register_mod = _import("hyper_parallel.core.shard.ops.parallel_ops_register")
    checkout.layout_class = layout_mod.Layout
    checkout.base_class = ops_mod.DistributedOp
    checkout.registry = register_mod._DISTRIBUTED_OPS  # the dict upstream registers into
    with quiet_backend(checkout):
        for entry in yaml_entries(root):
            name, source = entry.name, entry.source
            try:
                module = importlib.import_module(entry.module)
                cls = getattr(module, entry.cls)
                instance = cls(name)
            except Exception as exc:  # one op that does not load is reported; the rest load
                checkout.failed[name] = f"{source}: {describe(exc)}"
                continue
            checkout.ops[name] = instance
            checkout.sources[name] = source
    return checkout


def add_registered(checkout: Checkout, source: str) -> list[str]:
    """Take into ``checkout.ops`` every op registered in upstream's registry since loading (a user's module)."""
    new = []
    for name, op in checkout.registry.items():
        if checkout.ops.get(name) is not op:
            checkout.ops[name] = op
            checkout.sources[name] = source
            checkout.failed.pop(name, None)
            new.append(name)
    return new


# --------------------------------------------------------------------------- layouts
def to_upstream(checkout: Checkout, layout: Layout):
    """Our ``layout`` as the checkout's ``Layout`` (same device matrix, alias names, tensor_map, partial)."""
    mesh = layout.mesh
    base = checkout.layout_class(tuple(mesh.shape), tuple(mesh.names), init_backend=False)
    out = base(*_alias_map(layout))
    for axis, op in layout.partial_axes().items():
        out.set_partial_by_dev_axis(mesh.names[axis], op)
    return out


def _alias_map(layout: Layout) -> tuple:
    names = layout.mesh.names
    out = []
    for entry in layout.tensor_map():
        if isinstance(entry, tuple):
            out.append(tuple(names[layout.mesh.ndim - 1 - k] for k in entry))
        else:
            out.append("None" if entry == -1 else names[layout.mesh.ndim - 1 - entry])
    return tuple(out)


def from_upstream(up, mesh: DeviceMesh, partial_as: dict | None = None) -> Layout:
    """The checkout's ``Layout`` ``up`` as ours on ``mesh``; ``LayoutError`` when it has no such form.

    ``partial_as`` reads an upstream partial op as one of ours (``{"all": "min"}``: for bools
    the two agree).  ``unsupported-layout`` for a partial op we do not model (prod, all) or another mesh;
    ``invalid-layout`` for a tensor_map that is no layout (a mesh axis used twice...).
    """
    shape = tuple(int(n) for n in up.mesh_shape)
    if shape != tuple(mesh.shape):
        raise LayoutError("unsupported-layout", f"the rule answered on mesh {list(shape)}, the inputs were on "
                          f"{list(mesh.shape)}", hint="an output layout is on the inputs' device matrix")
    tensor_map = up.tensor_map
    if tensor_map is None:
        raise LayoutError("invalid-layout", "the rule answered a Layout without a tensor_map",
                          hint="call the Layout with one alias per tensor dim")
    partial = {}
    for axis, op in enumerate(up.partial):
        if op is None:
            continue
        op = (partial_as or {}).get(op, op)
        if op not in _PARTIAL_OPS:
            raise LayoutError("unsupported-layout", f"partial op {op!r} on mesh axis {mesh.names[axis]!r}",
                              hint=f"layout-prop models the partial ops {', '.join(_PARTIAL_OPS)}")
        partial[axis] = op
    entries = [tuple(int(k) for k in e) if isinstance(e, (tuple, list)) else int(e) for e in tensor_map]
    return Layout.from_tensor_map(mesh, entries, partial)


def upstream_text(layout: Layout, var: str) -> list[str]:
    """Python lines that build ``layout`` as the checkout's ``Layout`` in ``var``.

    >>> from layout_prop.core.mesh import DeviceMesh
    >>> upstream_text(Layout(DeviceMesh((2, 2), ("dp", "tp")), ["S(0)", "P"], 2), "x")
    ['x = Layout((2, 2), ("dp", "tp"))("dp", "None")', 'x.set_partial_by_dev_axis("tp", "sum")']
    """
    mesh = layout.mesh
    comma = "," if mesh.ndim == 1 else ""
    shape = "(" + ", ".join(map(str, mesh.shape)) + comma + ")"
    names = "(" + ", ".join(f'"{n}"' for n in mesh.names) + comma + ")"
    args = ", ".join("(" + ", ".join(f'"{x}"' for x in e) + ")" if isinstance(e, tuple) else f'"{e}"'
                     for e in _alias_map(layout))
    lines = [f"{var} = Layout({shape}, {names})({args})"]
    for axis, op in layout.partial_axes().items():
        lines.append(f'{var}.set_partial_by_dev_axis("{mesh.names[axis]}", "{op}")')
    return lines
