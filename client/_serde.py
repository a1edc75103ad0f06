"""SafeJsonPlusSerializer: LangGraph's serializer, reading stored values without running what they name.

``JsonPlusSerializer`` writes a graph's own types as msgpack extensions naming ``(module, class)`` and, by
default, reads them back by importing that module and calling that attribute, whatever it is: a stored
value naming ``subprocess.Popen`` starts a process in the reader. LangGraph's strict mode
(``LANGGRAPH_STRICT_MSGPACK``) stops that, but then reads a graph's own pydantic models, dataclasses and
Enums only once a compiled graph has registered them (``with_allowlist``), which it does only in strict
mode.

This serializer writes exactly what ``JsonPlusSerializer`` writes, and reads an extension's target only
when it is

* one of LangGraph's safe types (``SAFE_MSGPACK_TYPES``, and for method calls ``SAFE_MSGPACK_METHODS``),
  or a type given in ``allowed_types`` or through ``with_msgpack_allowlist``: imported as LangGraph does;
* outside strict mode, a pydantic model, dataclass, Enum or namedtuple class already loaded in this
  process, found in ``sys.modules`` without importing anything and without running a module
  ``__getattr__``. A graph's state types are loaded by the time it reads its state, since the graph's
  module defines or imports them.

Anything else (a function such as ``os.system``, a class such as ``subprocess.Popen``, a module nobody
imported) is not imported or called: the value reads as its serialized argument, the way LangGraph's
strict mode reads a blocked type, and a warning names it once.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from collections.abc import Iterable
from enum import Enum
from typing import Any

import ormsgpack
from langgraph.checkpoint.serde import _msgpack as lg_msgpack
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.serde.types import _DeltaSnapshot

__all__ = ["SafeJsonPlusSerializer"]

logger = logging.getLogger(__name__)

_OPTIONS = ormsgpack.OPT_NON_STR_KEYS
# LangGraph's extension codes (langgraph.checkpoint.serde.jsonplus).
_SINGLE_ARG, _POS_ARGS, _KW_ARGS, _METHOD, _PYDANTIC_V1, _PYDANTIC_V2, _NUMPY, _SNAPSHOT = range(8)
#: How many refused types are remembered for warn-once (bounded: payloads choose the names).
_MAX_WARNED = 1000
_warned: set[tuple[str, str]] = set()


class SafeJsonPlusSerializer(JsonPlusSerializer):
    """A ``JsonPlusSerializer`` whose reads never import or call what a stored value names, unless safe.

    The default serializer of ``RemoteReducingSaver``. Wrap it to encrypt:
    ``EncryptedSerializer(cipher, SafeJsonPlusSerializer())``.

    Args:
        allowed_types: More types to read, as classes or ``(module, name)`` pairs (imported when met).
        loaded_data_classes: Read pydantic models, dataclasses, Enums and namedtuples loaded in this process.
            Defaults to on, and to off when ``LANGGRAPH_STRICT_MSGPACK`` is set (strict mode then reads only
            the safe types and those a compiled graph registers).
    """

    def __init__(
        self,
        *,
        allowed_types: Iterable[tuple[str, ...] | type] = (),
        loaded_data_classes: bool | None = None,
    ) -> None:
        super().__init__(allowed_msgpack_modules=None)
        self._allowed = _keys(allowed_types)
        self._loaded_data_classes = (
            not lg_msgpack.STRICT_MSGPACK_ENABLED if loaded_data_classes is None else loaded_data_classes
        )
        self._unpack_ext_hook = self._ext_hook

    def with_msgpack_allowlist(
        self, extra_allowlist: Iterable[tuple[str, ...] | type]
    ) -> SafeJsonPlusSerializer:
        """A copy that also reads ``extra_allowlist`` (what a compiled graph registers in strict mode)."""
        extra = _keys(extra_allowlist)
        if extra <= self._allowed:
            return self
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._allowed = self._allowed | extra
        clone._unpack_ext_hook = clone._ext_hook
        return clone

    # -- reading ----------------------------------------------------------------------------------

    def _unpack(self, data: bytes) -> Any:
        # Nested extensions come back through this serializer's hook, never LangGraph's.
        return ormsgpack.unpackb(data, ext_hook=self._unpack_ext_hook, option=_OPTIONS)

    def _ext_hook(self, code: int, data: bytes) -> Any:
        if code == _SNAPSHOT:
            return _DeltaSnapshot(self._unpack(data))
        if code == _NUMPY:
            return _numpy_array(self._unpack, data)
        if code not in (_SINGLE_ARG, _POS_ARGS, _KW_ARGS, _METHOD, _PYDANTIC_V1, _PYDANTIC_V2):
            return None
        tup: Any = None
        try:
            tup = self._unpack(data)
            module, name, arg = tup[0], tup[1], tup[2]
            if code == _METHOD:
                if (module, name, tup[3]) not in lg_msgpack.SAFE_MSGPACK_METHODS:
                    return _refused(code, module, name, arg)
                return getattr(getattr(importlib.import_module(module), name), tup[3])(arg)
            cls = self._resolve(module, name)
            if cls is None:
                return _refused(code, module, name, arg)
            return _construct(code, cls, module, name, arg)
        except Exception as exc:  # noqa: BLE001 - a type's own constructor may raise anything
            # As LangGraph does: a value that cannot be rebuilt reads as its serialized data.
            logger.debug("could not rebuild a msgpack extension (code %d): %s", code, type(exc).__name__)
            return _item(tup, 2)

    def _resolve(self, module: Any, name: Any) -> Any:
        """The class to call for ``module.name``, or ``None`` when this serializer refuses it."""
        if type(module) is not str or type(name) is not str:
            return None
        key = (module, name)
        if key in lg_msgpack.SAFE_MSGPACK_TYPES or key in self._allowed:
            return getattr(importlib.import_module(module), name)
        if not self._loaded_data_classes:
            return None
        namespace = getattr(sys.modules.get(module), "__dict__", None)
        found = namespace.get(name) if isinstance(namespace, dict) else None
        return found if _is_data_class(found) else None


def _construct(code: int, cls: Any, module: str, name: str, arg: Any) -> Any:
    if code == _SINGLE_ARG:
        return cls(arg)
    if code == _POS_ARGS:
        if (module, name) == ("langgraph.types", "Send"):  # its timeout is keyword-only
            return cls(*arg[:2], timeout=arg[2]) if len(arg) > 2 else cls(*arg)
        return cls(*arg)
    if code == _KW_ARGS:
        return cls(**arg)
    try:  # pydantic v1 and v2: a dump the constructor rejects is built without validation
        return cls(**arg)
    except Exception:  # noqa: BLE001 - validators raise anything
        return cls.construct(**arg) if code == _PYDANTIC_V1 else cls.model_construct(**arg)


def _is_data_class(obj: Any) -> bool:
    """Whether ``obj`` is a class whose construction from stored data only builds data."""
    if not isinstance(obj, type):
        return False
    if issubclass(obj, Enum) or dataclasses.is_dataclass(obj):
        return True
    if issubclass(obj, tuple) and "_fields" in dir(obj):  # a namedtuple
        return True
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and issubclass(
        obj, (pydantic.BaseModel, pydantic.SecretStr, pydantic.SecretBytes)
    ):
        return True
    pydantic_v1 = sys.modules.get("pydantic.v1")
    return pydantic_v1 is not None and issubclass(obj, pydantic_v1.BaseModel)


def _refused(code: int, module: Any, name: Any, arg: Any) -> Any:
    key = (str(module), str(name))
    if key not in _warned and len(_warned) < _MAX_WARNED:
        _warned.add(key)
        logger.warning(
            "A stored value names %s.%s (msgpack extension code %d), which is not one of LangGraph's safe "
            "types, not an allowed type, and not a pydantic model, dataclass, Enum or namedtuple loaded in "
            "this process: it was neither imported nor called, and reads as its serialized data",
            *key,
            code,
        )
    return arg


def _numpy_array(unpack: Any, data: bytes) -> Any:
    try:
        import numpy as np

        dtype, shape, order, buffer = unpack(data)
        return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape, order=order)
    except Exception:  # noqa: BLE001 - as LangGraph: an array that cannot be rebuilt reads as None
        return None


def _item(tup: Any, index: int) -> Any:
    try:
        return tup[index]
    except Exception:  # noqa: BLE001 - whatever the payload decoded to
        return None


def _keys(types: Iterable[tuple[str, ...] | type]) -> frozenset[tuple[str, ...]]:
    return frozenset((t.__module__, t.__name__) if isinstance(t, type) else tuple(t) for t in types)
