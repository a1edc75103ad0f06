"""Refuse stored values whose msgpack extensions name code, in every channel and pending write.

:func:`check_value` reads a ``msgpack`` value's extensions the way LangGraph's decoder meets them, nested
ones included, without importing or calling anything, and refuses the value unless every target is
acceptable under an :class:`ExtensionPolicy` (setting ``allowed_state_types``), and unless LangGraph's
decoder can read it. docs/security.md ("Code in stored values", "What the default ``--allow-state-type *``
accepts, and its limit") describes what is accepted, how a module is read, and the limits.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib.machinery import ModuleSpec
from typing import Any

import ormsgpack
from langgraph.checkpoint.serde._msgpack import SAFE_MSGPACK_METHODS, SAFE_MSGPACK_TYPES

from reducing_saver.wire import Blob

__all__ = [
    "ANY_CLASS",
    "MAX_EXTENSION_DEPTH",
    "ExtensionPolicy",
    "UnreadableValueError",
    "UnsafeValueError",
    "check_extensions",
]

#: The ``allowed_state_types`` entry that accepts class-shaped names outside the standard library.
ANY_CLASS = "*"
#: How deep extensions may nest in one value. JsonPlus nests one level per model, dataclass or Enum held
#: in another's fields; each level is read once more, so the bound also bounds the work per byte.
MAX_EXTENSION_DEPTH = 32
_SETTING = "REDUCING_SAVER_ALLOWED_STATE_TYPES"
_CALLING_CODES = frozenset(range(6))
_METHOD_CODE = 3
_LANGGRAPH_CODES = frozenset(range(8))
#: Standard-library classes that start processes, found re-exported by third-party modules
#: (``from subprocess import Popen``): refused under any module name.
_GADGET_NAMES = frozenset({"Popen"})
_OPTIONS = ormsgpack.OPT_NON_STR_KEYS
#: Callables whose call at a module's top level makes a class of the name it is assigned to.
_CLASS_FACTORIES = frozenset(
    {
        "namedtuple",
        "NamedTuple",
        "TypedDict",
        "make_dataclass",
        "Enum",
        "IntEnum",
        "StrEnum",
        "Flag",
        "IntFlag",
        "create_model",
    }
)
#: Finders whose ``find_spec`` acts (setuptools' distutils shim imports and unloads modules for ``pip``).
_SKIPPED_FINDERS = frozenset({"_distutils_hack"})
#: Modules read for :func:`defined_classes`, at most (each parse is kept).
_MODULES_KEPT = 512


class UnsafeValueError(ValueError):
    """A channel value or pending write names a callable the service does not store.

    Attributes:
        field: The value's place in the request, e.g. ``"values.notes"`` or ``"writes[2]"``.
        code: The msgpack extension code (:class:`UnreadableValueError`: ``None`` for the value itself).
        module: The module the extension names, or ``None`` when the payload does not name one.
        name: The attribute the extension names, or ``None``.
    """

    code: int | None

    def __init__(self, field: str, code: int, module: str | None, name: str | None, reason: str) -> None:
        self.field, self.code, self.module, self.name = field, code, module, name
        what = f" naming {module}.{name}" if module is not None and name is not None else ""
        super().__init__(
            f"{field}: msgpack extension code {code}{what} is refused ({reason}); a stored value may name "
            f"only LangGraph's safe types and the allowed state types (setting allowed_state_types, "
            f"{_SETTING}), because every reader's deserializer would import and call it"
        )


class UnreadableValueError(UnsafeValueError):
    """A channel value or pending write that LangGraph's decoder cannot read: stored, it would break every
    read of its thread.

    Attributes:
        field: The value's place in the request.
        code: The extension whose payload cannot be decoded, or ``None`` for the value itself.
        reason: What the decoder (ormsgpack) said.
    """

    def __init__(self, field: str, code: int | None, reason: str) -> None:
        ValueError.__init__(
            self,
            f"{field}: not msgpack a reader can decode ({reason}"
            + ("" if code is None else f", in the payload of msgpack extension code {code}")
            + "); every reader of the thread, the service's client and a stock saver alike, would fail on "
            "it (an extension or a map as a map key, a string that is not UTF-8, nesting deeper than "
            "ormsgpack reads, or truncated bytes)",
        )
        self.field, self.code, self.module, self.name, self.reason = field, code, None, None, reason


class ExtensionPolicy:
    """Which extension targets a stored value may name.

    Args:
        allowed: ``allowed_state_types`` entries: ``"*"``, ``"module"`` (the module and its submodules)
            or ``"module:Class"``.
        message_classes: ``(module, class name)`` pairs accepted as well (the messages channel's).

    Raises:
        ValueError: If an entry is not ``*``, a dotted module name or ``module:Class``.
    """

    def __init__(
        self, allowed: Iterable[str] = (ANY_CLASS,), message_classes: Iterable[tuple[str, str]] = ()
    ) -> None:
        self.any_class = False
        modules: set[str] = set()
        types: set[tuple[str, str]] = set(message_classes)
        for entry in allowed:
            entry = entry.strip()
            if entry == ANY_CLASS:
                self.any_class = True
                continue
            module, sep, name = entry.partition(":")
            if not _is_module_name(module) or (sep and not name.isidentifier()):
                raise ValueError(f"{entry!r} is not *, a module name or module:Class")
            if sep:
                types.add((module, name))
            else:
                modules.add(module)
        self.modules = frozenset(modules)
        self.types = frozenset(types)

    def refusal(self, code: int, module: str, name: str, method: Any = None) -> str | None:
        """Why the policy refuses a target, or ``None`` when it accepts it."""
        if code == _METHOD_CODE:
            # LangGraph reads code 3 as getattr(getattr(module, name), method)(arg).
            if (module, name, method) in SAFE_MSGPACK_METHODS:
                return None
            if method != "fromisoformat":  # what JsonPlus writes for datetime subclasses
                return f"method {method!r} is not one LangGraph calls"
        key = (module, name)
        if key in SAFE_MSGPACK_TYPES or key in self.types:
            return None
        if not _is_module_name(module) or not name.isidentifier():
            return "not a module and attribute name"
        if module in self.modules or any(module.startswith(m + ".") for m in self.modules):
            return None
        if not self.any_class:
            return "not an allowed state type"
        if module.partition(".")[0] in sys.stdlib_module_names:
            return "a standard-library callable outside LangGraph's safe types"
        if name in _GADGET_NAMES:
            return "a process-starting class"
        if not name[0].isupper():
            return "a function name, not a class name"
        classes = defined_classes(module)
        if classes is None:  # not in this environment: the default mode's stated limit
            return None
        if name not in classes:
            return (
                f"not a class {module} defines (the name is bound there by an import or an assignment, "
                "as a re-exported standard-library callable is, or the module's source cannot be read)"
            )
        return None


@functools.lru_cache(maxsize=_MODULES_KEPT)
def defined_classes(module: str) -> frozenset[str] | None:
    """The class names ``module`` defines at its top level, read from its source without running it.

    Returns:
        ``None`` when this environment has no such module; an empty set when its source cannot be read
        (compiled code, a namespace package) or parsed; else every name whose top-level bindings are all
        ``class`` statements or class-factory calls (see the module docstring).
    """
    try:
        spec = _find_spec(module)
    except Exception:  # noqa: BLE001 - a finder failing on a client's name: treat as not found
        return None
    if spec is None:
        return None
    origin = spec.origin
    if not spec.has_location or origin is None or not origin.endswith(".py"):
        return frozenset()
    try:
        with open(origin, "rb") as file:
            tree = ast.parse(importlib.util.decode_source(file.read()), origin)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return frozenset()
    kinds: dict[str, bool] = {}
    for name, is_class in _top_level_bindings(tree.body):
        kinds[name] = kinds.get(name, True) and is_class
    return frozenset(name for name, is_class in kinds.items() if is_class)


def _find_spec(module: str) -> ModuleSpec | None:
    """``module``'s spec as the import system would find it, without importing its parent packages."""
    path: list[str] | None = None
    spec = None
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        spec = next(
            (
                found
                for finder in sys.meta_path
                if hasattr(finder, "find_spec")
                and type(finder).__module__ not in _SKIPPED_FINDERS
                and (found := finder.find_spec(name, path)) is not None
            ),
            None,
        )
        if spec is None:
            return None
        if depth < len(parts):
            if spec.submodule_search_locations is None:  # not a package: no submodules to find
                return None
            path = list(spec.submodule_search_locations)
    return spec


def _top_level_bindings(body: list[ast.stmt]) -> Iterator[tuple[str, bool]]:
    """``(name, binds a class)`` for each name a module's top level binds (conditional blocks included)."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield node.name, True
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, False
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                yield (alias.asname or alias.name.partition(".")[0]), False
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            is_class = (
                not isinstance(node, ast.AugAssign)
                and isinstance(node.value, ast.Call)
                and _callee_name(node.value.func) in _CLASS_FACTORIES
            )
            for target in targets:
                for name in _names(target):
                    yield name, is_class and isinstance(target, ast.Name)
        else:
            yield from _block_bindings(node)


def _block_bindings(node: ast.stmt) -> Iterator[tuple[str, bool]]:
    """What a compound statement at a module's top level binds: its blocks' bindings, and its own targets
    (a loop's, a with's, an except's, a walrus), which are never classes."""
    for child in ast.walk(node):
        if isinstance(child, ast.NamedExpr):
            yield child.target.id, False
    if isinstance(node, (ast.For, ast.AsyncFor)):
        yield from ((name, False) for name in _names(node.target))
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        for item in node.items:
            if item.optional_vars is not None:
                yield from ((name, False) for name in _names(item.optional_vars))
    for field in ("body", "orelse", "finalbody"):
        block = getattr(node, field, None)
        if isinstance(block, list):
            yield from _top_level_bindings(block)
    for handler in getattr(node, "handlers", None) or ():
        if handler.name:
            yield handler.name, False
        yield from _top_level_bindings(handler.body)
    for case in getattr(node, "cases", None) or ():
        for pattern in ast.walk(case.pattern):
            if isinstance(pattern, (ast.MatchAs, ast.MatchStar)) and pattern.name:
                yield pattern.name, False
        yield from _top_level_bindings(case.body)


def _callee_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _names(target: ast.AST) -> Iterator[str]:
    """Every name ``target`` (an assignment target, a loop's or a with's) binds."""
    for node in ast.walk(target):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id


def check_extensions(values: Mapping[str, Any] | Iterable[tuple[str, Any]], policy: ExtensionPolicy) -> None:
    """Refuse the first value whose extensions name a target ``policy`` refuses.

    Args:
        values: ``field -> value`` (a mapping or pairs); values that are not ``msgpack`` blobs (inline
            primitives, another serde's bytes such as encrypted ones) are skipped.
        policy: What the extensions may name.

    Raises:
        UnsafeValueError: Naming the field, the extension code and its target.
    """
    items = values.items() if isinstance(values, Mapping) else values
    for field, value in items:
        if isinstance(value, Blob) and value.type == "msgpack":
            check_value(value.data, field, policy)


def check_value(data: bytes, field: str, policy: ExtensionPolicy) -> None:
    """Refuse one msgpack value whose extensions, nested ones included, name a refused target, or that
    LangGraph's decoder cannot read.

    The value and the payload of every extension LangGraph opens are decoded as its decoder does. A target
    met before the point where decoding fails is named first (a reader's decoder would have met it);
    otherwise the first failure is.

    Raises:
        UnsafeValueError: Naming ``field``, the extension code and its target.
        UnreadableValueError: Naming ``field`` (and the extension code) when the bytes cannot be decoded.
    """
    # A work list, not recursion: each payload is decoded by a call of its own, after its parent's ended,
    # so the C stack holds one decoder at a time. Read in order, it is breadth first: the error names the
    # outermost refused extension, in document order.
    found: list[tuple[int, bytes, int]] = []
    depth = 1

    def record(code: int, payload: bytes) -> None:
        found.append((code, payload, depth))

    unreadable: UnreadableValueError | None = None
    _, error = _decode(data, record)
    if error is not None:
        unreadable = UnreadableValueError(field, None, error)
    index = 0
    while index < len(found):
        code, payload, depth = found[index]
        index += 1
        if code not in _LANGGRAPH_CODES:
            continue
        if depth > MAX_EXTENSION_DEPTH:
            raise UnsafeValueError(
                field, code, None, None, f"extensions nested more than {MAX_EXTENSION_DEPTH} deep"
            )
        depth += 1  # what this payload holds is recorded one level down
        tup, error = _decode(payload, record)
        if error is not None and unreadable is None:
            unreadable = UnreadableValueError(field, code, error)
        if code in _CALLING_CODES and error is None:
            _check_target(field, code, tup, policy)
    if unreadable is not None:
        raise unreadable


def _check_target(field: str, code: int, tup: Any, policy: ExtensionPolicy) -> None:
    # JsonPlus always writes an array (module, name, argument[, method]); anything else is refused, since
    # LangGraph's decoder indexes whatever it gets (a map with keys 0 and 1 would work just as well).
    if type(tup) is not list or len(tup) < (4 if code == _METHOD_CODE else 3):
        raise UnsafeValueError(field, code, None, None, "malformed payload")
    module, name = tup[0], tup[1]
    if type(module) is not str or type(name) is not str:
        raise UnsafeValueError(field, code, None, None, "malformed payload")
    reason = policy.refusal(code, module, name, tup[3] if code == _METHOD_CODE else None)
    if reason is not None:
        raise UnsafeValueError(field, code, module, name, reason)


def _decode(data: bytes, record: Callable[[int, bytes], None]) -> tuple[Any, str | None]:
    """``(data decoded, None)``, each extension handed to ``record`` (and ``None`` in its place); or
    ``(None, what the decoder said)`` when the bytes cannot be decoded (what was recorded before the
    point of failure still counts)."""
    try:
        return ormsgpack.unpackb(data, ext_hook=record, option=_OPTIONS), None
    except Exception as exc:  # noqa: BLE001 - any decoding error, from bytes a client chose
        return None, str(exc) or type(exc).__name__


def _is_module_name(module: str) -> bool:
    return bool(module) and all(part.isidentifier() for part in module.split("."))
