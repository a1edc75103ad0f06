"""Hostile requests, each with a name and what the service must answer.

Every case is a request a careless or malicious client could send. ``tests/e2e/test_hostile_corpus.py``
replays each against a running service (a real uvicorn process on PostgreSQL, with an API key) and
checks that the answer's status is one of ``expect``, that its detail names what it should (``names``),
that nothing was stored, that no marker file appeared, and that the next ordinary request is served.

Payloads that name code (``os.system``, ``subprocess.Popen``, ``builtins.eval``,
``importlib.import_module``) are shaped exactly as LangGraph's msgpack ext hook reads each extension
code, and point at marker files: decoded the stock way, codes 0 and 1 really run them
(``test_the_attacks_are_live`` proves it in a subprocess), so an absent marker means "not executed".

The per-step routes also take ``application/msgpack`` bodies; the cases named ``msgpack-...`` send those
(code in the envelope itself, code inside the messages bin, and the structure attacks in msgpack form).

Code is refused in every channel and pending write, not only in the messages one (the cases named
``...-other-channel``, ``...-pending-write`` and those of :data:`STATE_VALUE_CASES`): every reader of a
stored value decodes it with LangGraph's hook. That includes the content of a DeltaChannel snapshot
(extension code 7 as the whole messages value, :data:`SNAPSHOT_CASE`): a snapshot is stored as sent, never
reduced, but a reader decodes what it holds, so one naming code is refused like any other value.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import ormsgpack
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.base import empty_checkpoint

TARGETS = [("os", "system"), ("subprocess", "Popen"), ("builtins", "eval"), ("importlib", "import_module")]
TRIPWIRE_MODULE = "tests.hostile.tripwire"
HUMAN = ("langchain_core.messages.human", "HumanMessage")
AI = ("langchain_core.messages.ai", "AIMessage")
MB = 1024 * 1024


@dataclass
class Context:
    """Where markers go: one file per case and target, plus the tripwire the import payloads create."""

    markers: Path
    tripwire: Path

    def marker(self, case: str) -> Path:
        return self.markers / f"{case}.marker"


@dataclass
class Case:
    """One hostile request.

    Attributes:
        name: Unique, stable id (pytest shows it).
        path: The route.
        body: Builds the raw body bytes from a ``Context``.
        expect: Acceptable statuses.
        names: Substrings the response's detail must contain (the field, the cap's setting, ...).
        method: HTTP method.
        headers: Extra headers (content type overrides, say).
        raw: Send over a raw socket (bodies too large for an HTTP client to finish sending).
    """

    name: str
    path: str
    body: Callable[[Context], bytes]
    expect: frozenset[int] = frozenset({422})
    names: tuple[str, ...] = ()
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    raw: bool = False


# -- building blocks -----------------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def config(thread_id: Any = "victim", **extra: Any) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", **extra}}


def checkpoint(**changes: Any) -> dict[str, Any]:
    cp = dict(empty_checkpoint())
    cp.pop("channel_values")
    cp["channel_versions"] = {"messages": "1"}
    cp.update(changes)
    return cp


def put_body(messages: Any, thread_id: Any = "victim", **overrides: Any) -> dict[str, Any]:
    """A checkpoint put whose messages channel is ``messages`` (a wire value)."""
    body = {
        "config": config(thread_id),
        "checkpoint": checkpoint(),
        "values": {"messages": messages},
        "metadata": {"source": "loop", "step": 1},
        "new_versions": {"messages": "1"},
    }
    body.update(overrides)
    return body


def msgpack_value(data: bytes) -> dict[str, str]:
    return {"type": "msgpack", "data": b64(data)}


def json_bytes(body: Any) -> Callable[[Context], bytes]:
    return lambda ctx: orjson.dumps(body)


def attack_argument(target: tuple[str, str], marker: Path) -> Any:
    return {
        ("os", "system"): f"touch {marker}",
        ("subprocess", "Popen"): ["touch", str(marker)],
        ("builtins", "eval"): f"open({str(marker)!r}, 'w').close()",
        ("importlib", "import_module"): TRIPWIRE_MODULE,
    }[target]


def attack(code: int, target: tuple[str, str], marker: Path) -> ormsgpack.Ext:
    """An extension shaped the way LangGraph's ext hook reads each code."""
    module, name = target
    arg = attack_argument(target, marker)
    payload = {
        0: (module, name, arg),  # getattr(import_module(module), name)(arg)
        1: (module, name, [arg]),  # ...(*args)
        2: (module, name, {"command": arg}),  # ...(**kwargs)
        3: (module, name, arg, "__call__"),  # getattr(getattr(mod, name), method)(arg)
        4: (module, name, {"command": arg}),  # pydantic v1: cls(**kwargs)
        5: (module, name, {"command": arg}, "model_validate_json"),  # pydantic v2
        6: (module, name, arg, "C", b"\x00"),  # numpy-shaped; never a message
        7: ormsgpack.packb([(module, name, arg)]),  # a snapshot's value, nested where no snapshot goes
    }[code]
    return ormsgpack.Ext(code, payload if isinstance(payload, bytes) else ormsgpack.packb(payload))


def message_ext(module_class: tuple[str, str], fields: dict[str, Any]) -> ormsgpack.Ext:
    return ormsgpack.Ext(5, ormsgpack.packb((*module_class, fields, "model_validate_json")))


def human_with(ext: ormsgpack.Ext) -> ormsgpack.Ext:
    fields = HumanMessage("hello", id="h").model_dump()
    fields["additional_kwargs"] = {"x": ext}
    return message_ext(HUMAN, fields)


def ai_calling_with(ext: ormsgpack.Ext) -> ormsgpack.Ext:
    fields = AIMessage("", id="a", tool_calls=[{"name": "t", "args": {"q": "ok"}, "id": "c"}]).model_dump()
    fields["tool_calls"][0]["args"]["q"] = ext
    return message_ext(AI, fields)


PLACEMENTS: dict[str, Callable[[ormsgpack.Ext], list[Any]]] = {
    "element": lambda ext: [ext],
    "in-additional-kwargs": lambda ext: [human_with(ext)],
    "in-tool-call-args": lambda ext: [
        message_ext(HUMAN, HumanMessage("q", id="q").model_dump()),
        ai_calling_with(ext),
    ],
}


def _ext_case(code: int, target: tuple[str, str], placement: str) -> Case:
    name = f"ext{code}-{target[0]}.{target[1]}-{placement}"

    def body(ctx: Context) -> bytes:
        ext = attack(code, target, ctx.marker(name))
        return orjson.dumps(
            put_body(msgpack_value(ormsgpack.packb(PLACEMENTS[placement](ext))), thread_id=name)
        )

    return Case(name, "/v1/checkpoints/put", body, names=("messages", f"code {code}"))


def snapshot_body(ctx: Context) -> bytes:
    """Extension 7 as the whole messages value: a DeltaChannel snapshot, whose content names os.system.

    A reader decodes a snapshot's content with the same hook as any value, so what it names runs there.
    """
    inside = ormsgpack.packb(
        [
            attack(0, ("os", "system"), ctx.marker("snapshot")),
            attack(1, ("subprocess", "Popen"), ctx.marker("snapshot")),
        ]
    )
    return orjson.dumps(
        put_body(msgpack_value(ormsgpack.packb(ormsgpack.Ext(7, inside))), thread_id="snapshot")
    )


SNAPSHOT_CASE = Case(
    "ext7-top-level-snapshot",
    "/v1/checkpoints/put",
    snapshot_body,
    names=("values.messages", "code 0", "os.system"),
)


def benign_snapshot_body(ctx: Context) -> bytes:
    """A DeltaChannel snapshot of ordinary messages: stored as sent, never reduced."""
    inside = ormsgpack.packb([message_ext(HUMAN, HumanMessage("hi", id="h").model_dump())])
    return orjson.dumps(
        put_body(msgpack_value(ormsgpack.packb(ormsgpack.Ext(7, inside))), thread_id="snapshot")
    )


# -- code in other channels and in pending writes --------------------------------------------------

#: (code, target) pairs the state-channel cases use: every calling code LangGraph has but pydantic v1.
STATE_CODES = (0, 1, 2, 3, 5)
STATE_TARGETS = [("subprocess", "Popen"), ("os", "system")]
STATE_PLACES = ("other-channel", "pending-write")


def state_body(place: str, value: bytes, thread_id: str) -> dict[str, Any]:
    """A put with ``value`` in a channel that is not the messages one, or a writes/put holding it."""
    if place == "pending-write":
        cid = empty_checkpoint()["id"]
        return {
            "config": config(thread_id, checkpoint_id=cid),
            "writes": [["notes", msgpack_value(value)]],
            "task_id": "t",
        }
    no_messages = msgpack_value(ormsgpack.packb([]))
    return put_body(
        no_messages,
        thread_id=thread_id,
        values={"messages": no_messages, "notes": msgpack_value(value)},
        new_versions={"messages": "1", "notes": "1"},
    )


def _state_case(code: int, target: tuple[str, str], place: str, msgpack: bool) -> Case:
    name = f"ext{code}-{target[0]}.{target[1]}-{place}"
    field = "writes[0]" if place == "pending-write" else "values.notes"

    def body(ctx: Context) -> bytes:
        value = ormsgpack.packb({"note": attack(code, target, ctx.marker(name))})
        built = state_body(place, value, thread_id=name)
        return ormsgpack.packb(in_msgpack(built)) if msgpack else orjson.dumps(built)

    path = "/v1/writes/put" if place == "pending-write" else "/v1/checkpoints/put"
    names = (field, f"code {code}", f"{target[0]}.{target[1]}")
    return msgpack_case(name, path, body, names=names) if msgpack else Case(name, path, body, names=names)


def _state_value_case(
    name: str, build: Callable[[Context], Any], names: tuple[str, ...], place: str = "other-channel"
) -> Case:
    """A channel value (or pending write) built by ``build``, refused with a detail naming ``names``."""

    def body(ctx: Context) -> bytes:
        return orjson.dumps(state_body(place, ormsgpack.packb(build(ctx)), thread_id=name))

    return Case(
        name, "/v1/writes/put" if place == "pending-write" else "/v1/checkpoints/put", body, names=names
    )


def ext(code: int, *payload: Any) -> ormsgpack.Ext:
    return ormsgpack.Ext(code, ormsgpack.packb(payload))


def in_messages(depth: int, leaf: ormsgpack.Ext) -> ormsgpack.Ext:
    """``leaf`` in the additional_kwargs of a message, in another message's, ``depth`` messages deep."""
    value = leaf
    for _ in range(depth):
        value = human_with(value)
    return value


#: Names of the state-value cases beyond the code x target x place grid, with what their detail names.
STATE_VALUE_CASES: list[tuple[str, Callable[[Context], Any], tuple[str, ...], str]] = [
    (
        "ext1-subprocess.Popen-in-state-dataclass",
        lambda ctx: ext(
            2, "myapp.state", "Task", {"name": attack(1, ("subprocess", "Popen"), ctx.marker("in-dataclass"))}
        ),
        ("values.notes", "subprocess.Popen"),
        "other-channel",
    ),
    (
        "ext0-os.system-in-state-snapshot",
        lambda ctx: ormsgpack.Ext(
            7, ormsgpack.packb([attack(0, ("os", "system"), ctx.marker("in-snapshot"))])
        ),
        ("values.notes", "os.system"),
        "other-channel",
    ),
    (
        "ext1-subprocess.Popen-in-numpy-payload",
        lambda ctx: ext(6, "<i8", [1], "C", attack(1, ("subprocess", "Popen"), ctx.marker("in-numpy"))),
        ("values.notes", "subprocess.Popen"),
        "other-channel",
    ),
    (
        "ext0-yaml.unsafe_load-function",
        lambda ctx: ext(
            0, "yaml", "unsafe_load", f"!!python/object/apply:os.system ['touch {ctx.marker('yaml')}']"
        ),
        ("values.notes", "yaml.unsafe_load", "function name"),
        "other-channel",
    ),
    (
        "ext1-reexported-Popen",
        lambda ctx: ext(
            1, "numpy.distutils.fcompiler.gnu", "Popen", [["touch", str(ctx.marker("reexport"))]]
        ),
        ("values.notes", "Popen"),
        "other-channel",
    ),
    (
        "ext3-pathlib.Path-write_text",
        lambda ctx: ext(3, "pathlib", "Path", str(ctx.marker("write-text")), "write_text"),
        ("values.notes", "write_text"),
        "other-channel",
    ),
    (
        "ext0-malformed-map-payload",
        lambda ctx: ormsgpack.Ext(
            0,
            ormsgpack.packb(
                {0: "os", 1: "system", 2: f"touch {ctx.marker('map')}"}, option=ormsgpack.OPT_NON_STR_KEYS
            ),
        ),
        ("values.notes", "malformed"),
        "other-channel",
    ),
    (
        "ext-nested-33-deep",
        lambda ctx: nested_exts(33),
        ("values.notes", "nested more than"),
        "other-channel",
    ),
    (
        "ext0-os.system-pending-write-in-message",
        lambda ctx: [human_with(attack(0, ("os", "system"), ctx.marker("write-message")))],
        ("writes[0]", "os.system"),
        "pending-write",
    ),
]


#: Standard-library callables that third-party modules of the service's own environment re-export under
#: their own names: ``(module, name, extension builder)``. The first three act on files when a stock
#: reader decodes them (``test_the_attacks_are_live``); the others start threads or make directories.
REEXPORTS: list[tuple[str, str, Callable[[Context, str], ormsgpack.Ext]]] = [
    (
        "pip._internal.utils.wheel",
        "ZipFile",
        lambda ctx, case: ext(1, "pip._internal.utils.wheel", "ZipFile", [str(ctx.marker(case)), "w"]),
    ),
    (
        "pip._internal.utils.filesystem",
        "NamedTemporaryFile",
        lambda ctx, case: ext(
            2,
            "pip._internal.utils.filesystem",
            "NamedTemporaryFile",
            {"dir": str(ctx.markers), "prefix": case, "delete": False},
        ),
    ),
    ("sqlite_vec", "Connection", lambda ctx, case: ext(0, "sqlite_vec", "Connection", str(ctx.marker(case)))),
    ("aiosqlite.core", "Thread", lambda ctx, case: ext(2, "aiosqlite.core", "Thread", {"name": case})),
    ("anyio.from_thread", "Thread", lambda ctx, case: ext(2, "anyio.from_thread", "Thread", {"name": case})),
    (
        "psycopg_pool._acompat",
        "Worker",
        lambda ctx, case: ext(2, "psycopg_pool._acompat", "Worker", {"name": case}),
    ),
    (
        "langchain_core.runnables.config",
        "ThreadPoolExecutor",
        lambda ctx, case: ext(2, "langchain_core.runnables.config", "ThreadPoolExecutor", {"max_workers": 1}),
    ),
    (
        "setuptools.command.editable_wheel",
        "TemporaryDirectory",
        lambda ctx, case: ext(
            2, "setuptools.command.editable_wheel", "TemporaryDirectory", {"dir": str(ctx.markers)}
        ),
    ),
]
#: Where the re-export cases put their value: another channel, a pending write, the messages channel
#: (inside a message) and a pending write to it.
REEXPORT_PLACES = ("other-channel", "pending-write", "in-message", "pending-write-messages")


def _reexport_case(
    module: str, name: str, build: Callable[[Context, str], ormsgpack.Ext], place: str
) -> Case:
    case = f"reexport-{module}.{name}-{place}"
    field = {"other-channel": "values.notes", "in-message": "messages"}.get(place, "writes[0]")

    def body(ctx: Context) -> bytes:
        value = build(ctx, case)
        if place == "in-message":
            return orjson.dumps(put_body(msgpack_value(ormsgpack.packb([human_with(value)])), thread_id=case))
        if place == "pending-write-messages":
            built = state_body("pending-write", ormsgpack.packb([human_with(value)]), thread_id=case)
            built["writes"][0][0] = "messages"
            return orjson.dumps(built)
        return orjson.dumps(state_body(place, ormsgpack.packb({"note": value}), thread_id=case))

    path = "/v1/writes/put" if place.startswith("pending-write") else "/v1/checkpoints/put"
    return Case(case, path, body, names=(field, f"{module}.{name}"))


def nested_exts(depth: int) -> ormsgpack.Ext:
    value: Any = 1
    for _ in range(depth):
        value = ext(2, "myapp.state", "Node", {"child": value})
    return value


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"a": value}
    return value


def deep_text(depth: int) -> bytes:
    """JSON nested ``depth`` deep, built as text (a Python structure that deep would not serialize)."""
    return b'{"a":' * depth + b"1" + b"}" * depth


def _replace_metadata(body: bytes, metadata: bytes) -> bytes:
    marker = b'"metadata":{"source":"loop","step":1}'
    assert marker in body
    return body.replace(marker, b'"metadata":' + metadata)


MSGPACK_HEADERS = {"Content-Type": "application/msgpack"}


def in_msgpack(body: Any) -> Any:
    """A JSON-shaped body as the msgpack client sends it: every typed value's base64 ``data`` as bytes."""
    if isinstance(body, dict):
        if body.keys() == {"type", "data"} and isinstance(body["data"], str):
            return {"type": body["type"], "data": base64.b64decode(body["data"])}
        return {key: in_msgpack(value) for key, value in body.items()}
    if isinstance(body, list):
        return [in_msgpack(item) for item in body]
    return body


def msgpack_case(name: str, path: str, body: Callable[[Context], bytes], **options: Any) -> Case:
    return Case(f"msgpack-{name}", path, body, headers=MSGPACK_HEADERS, **options)


def packed(body: Any) -> Callable[[Context], bytes]:
    return lambda ctx: ormsgpack.packb(in_msgpack(body))


def _msgpack_ext_case(code: int, target: tuple[str, str]) -> Case:
    name = f"msgpack-ext{code}-{target[0]}.{target[1]}-in-messages-bin"

    def body(ctx: Context) -> bytes:
        ext = attack(code, target, ctx.marker(name))
        return ormsgpack.packb(in_msgpack(put_body(msgpack_value(ormsgpack.packb([ext])), thread_id=name)))

    return Case(
        name, "/v1/checkpoints/put", body, names=("messages", f"code {code}"), headers=MSGPACK_HEADERS
    )


def _msgpack_envelope_ext(code: int, target: tuple[str, str], where: str) -> Case:
    """An extension in the body's own structure (the metadata, or the messages value itself)."""
    name = f"ext{code}-{target[0]}.{target[1]}-in-envelope-{where}"

    def body(ctx: Context) -> bytes:
        ext = attack(code, target, ctx.marker(name))
        if where == "metadata":
            return ormsgpack.packb(
                in_msgpack(put_body(msgpack_value(ormsgpack.packb([])), thread_id="env", metadata={"x": ext}))
            )
        return ormsgpack.packb(in_msgpack(put_body(ext, thread_id="env")))

    return msgpack_case(name, "/v1/checkpoints/put", body, names=("extension", f"code {code}"))


def _get(thread_id: Any, **extra: Any) -> Callable[[Context], bytes]:
    return json_bytes({"config": config(thread_id, **extra)})


THREAD_IDS = {
    "nul": "vic\x00tim",
    "slash-traversal": "../../etc/passwd",
    "dotdot": "..",
    "backslash": "..\\..\\windows",
    "escape-sequence": "\x1b[2J\x1b[31mowned",
    "10kb": "t" * 10 * 1024,
}


def _cases() -> list[Case]:
    cases: list[Case] = []
    # -- code execution through the messages channel: codes 0-7, four targets, three placements --------
    for code in range(8):
        for target in TARGETS:
            for placement in PLACEMENTS:
                cases.append(_ext_case(code, target, placement))

    put = "/v1/checkpoints/put"
    cases.append(SNAPSHOT_CASE)
    # Messages nested four deep were left unreduced by the messages codec, and stored with what they held.
    cases.append(
        Case(
            "ext1-subprocess.Popen-under-four-nested-messages",
            put,
            lambda ctx: orjson.dumps(
                put_body(
                    msgpack_value(
                        ormsgpack.packb(
                            [in_messages(4, attack(1, ("subprocess", "Popen"), ctx.marker("deep-messages")))]
                        )
                    ),
                    thread_id="deep-messages",
                )
            ),
            names=("values.messages", "code 1", "subprocess.Popen"),
        )
    )
    # -- code in any other channel and in pending writes, JSON and msgpack bodies ---------------------
    for code in STATE_CODES:
        for target in STATE_TARGETS:
            for place in STATE_PLACES:
                cases.append(_state_case(code, target, place, msgpack=False))
                cases.append(_state_case(code, target, place, msgpack=True))
    cases += [_state_value_case(*spec) for spec in STATE_VALUE_CASES]
    # An extension as a map key: ormsgpack, so every reader, refuses the whole value (it used to be stored).
    for place, named in (("other-channel", "values.notes"), ("pending-write", "writes[0] (channel 'notes')")):
        cases.append(
            Case(
                f"ext0-os.system-as-a-map-key-{place}",
                "/v1/writes/put" if place == "pending-write" else "/v1/checkpoints/put",
                lambda ctx, place=place: orjson.dumps(
                    state_body(
                        place,
                        b"\x81"
                        + ormsgpack.packb(attack(0, ("os", "system"), ctx.marker(f"key-{place}")))
                        + b"\x01",
                        thread_id=f"ext-key-{place}",
                    )
                ),
                names=(named, "not msgpack a reader can decode"),
            )
        )
    # -- standard-library callables under a third-party module's name ------------------------------------
    cases += [_reexport_case(*reexport, place) for reexport in REEXPORTS for place in REEXPORT_PLACES]
    # -- structure ---------------------------------------------------------------------------------
    cases += [
        Case(
            "deep-metadata-40",
            put,
            lambda ctx: _replace_metadata(
                orjson.dumps(put_body(msgpack_value(ormsgpack.packb([])), thread_id="deep")),
                orjson.dumps(nested(40)),
            ),
            names=("max_nesting_depth",),
        ),
        Case(
            "deep-metadata-100000",
            put,
            lambda ctx: _replace_metadata(
                orjson.dumps(put_body(msgpack_value(ormsgpack.packb([])), thread_id="deep")),
                deep_text(100_000),
            ),
            names=("max_nesting_depth",),
        ),
        Case(
            "deep-list-filter-5000",
            "/v1/checkpoints/list",
            lambda ctx: b'{"config":null,"filter":' + deep_text(5000) + b"}",
            names=("max_nesting_depth",),
        ),
        Case(
            "deep-arrays-get-3000",
            "/v1/checkpoints/get",
            lambda ctx: b'{"config":' + b"[" * 3000 + b"]" * 3000 + b"}",
            names=("max_nesting_depth",),
        ),
        Case(
            "messages-million-entries",
            put,
            lambda ctx: orjson.dumps(
                put_body(msgpack_value(ormsgpack.packb([None] * 1_000_000)), thread_id="million")
            ),
            names=("values.messages", "1000000", "max_messages_per_put"),
        ),
        Case(
            "messages-million-human-dicts",
            put,
            lambda ctx: orjson.dumps(
                put_body(
                    msgpack_value(ormsgpack.packb([{"type": "human", "content": ""}] * 1_000_000)),
                    thread_id="million2",
                )
            ),
            expect=frozenset({413, 422}),
        ),
        Case(
            "body-100mb-declared",
            put,
            lambda ctx: b"{" + b" " * (100 * MB) + b"}",
            expect=frozenset({413}),
            names=("max_body_bytes",),
            raw=True,
        ),
        Case(
            "body-100mb-chunked",
            put,
            lambda ctx: b"{" + b" " * (100 * MB) + b"}",
            expect=frozenset({413}),
            names=("max_body_bytes",),
            raw=True,
            headers={"transfer-encoding": "chunked"},
        ),
        Case(
            "truncated-msgpack",
            put,
            lambda ctx: orjson.dumps(
                put_body(
                    msgpack_value(
                        ormsgpack.packb([message_ext(HUMAN, HumanMessage("hi", id="h").model_dump())] * 3)[
                            :-5
                        ]
                    ),
                    thread_id="trunc",
                )
            ),
            names=("values.messages", "msgpack"),
        ),
        Case(
            "invalid-msgpack-byte",
            put,
            lambda ctx: orjson.dumps(put_body(msgpack_value(b"\xc1"), thread_id="c1")),
            names=("values.messages",),
        ),
        Case(
            "empty-msgpack",
            put,
            lambda ctx: orjson.dumps(put_body(msgpack_value(b""), thread_id="empty")),
            names=("values.messages",),
        ),
        Case(
            "msgpack-array-header-claims-4-billion",
            put,
            lambda ctx: orjson.dumps(put_body(msgpack_value(b"\xdd\xff\xff\xff\xff"), thread_id="claims")),
            names=("max_messages_per_put",),
        ),
        Case(
            "bad-base64-messages",
            put,
            json_bytes(put_body({"type": "msgpack", "data": "!!!not base64!!!"}, thread_id="b64")),
            names=("values.messages", "base64"),
        ),
        Case(
            "bad-base64-other-channel",
            put,
            json_bytes(
                put_body(
                    msgpack_value(ormsgpack.packb([])),
                    thread_id="b64b",
                    values={
                        "messages": msgpack_value(ormsgpack.packb([])),
                        "other": {"type": "msgpack", "data": "%%%%"},
                    },
                )
            ),
            names=("values.other", "base64"),
        ),
        Case(
            "bad-base64-write",
            "/v1/writes/put",
            json_bytes(
                {
                    "config": config("b64w", checkpoint_id=empty_checkpoint()["id"]),
                    "writes": [["messages", {"type": "msgpack", "data": "a"}]],
                    "task_id": "t",
                }
            ),
            names=("writes[0]", "base64"),
        ),
        Case(
            "non-utf8-latin1",
            put,
            lambda ctx: (
                orjson.dumps(put_body(msgpack_value(ormsgpack.packb([])), thread_id="caf\u00e9"))
                .decode()
                .encode("latin-1")
            ),
            names=("UTF-8",),
        ),
        Case(
            "non-utf8-utf16",
            put,
            lambda ctx: (
                orjson.dumps(put_body(msgpack_value(ormsgpack.packb([])), thread_id="utf16"))
                .decode()
                .encode("utf-16")
            ),
            names=("UTF-8",),
        ),
        Case("not-json", put, lambda ctx: b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, names=("body",)),
        Case(
            "lone-surrogate-escape",
            put,
            lambda ctx: orjson.dumps(put_body(msgpack_value(ormsgpack.packb([])), thread_id="SURR")).replace(
                b'"SURR"', b'"\\ud800"'
            ),
            names=("body",),
        ),
        Case(
            "duplicate-top-level-key",
            put,
            lambda ctx: orjson.dumps(put_body(msgpack_value(ormsgpack.packb([])), thread_id="dup")).replace(
                b'"metadata":', b'"metadata":{},"metadata":', 1
            ),
            names=("repeats the key", "metadata"),
        ),
        Case(
            "duplicate-thread-id-key",
            "/v1/checkpoints/get",
            lambda ctx: (
                b'{"config":{"configurable":{"thread_id":"victim","thread_id":"mine","checkpoint_ns":""}}}'
            ),
            names=("repeats the key", "thread_id"),
        ),
        Case(
            "duplicate-key-spaced",
            "/v1/threads/delete",
            lambda ctx: b'{ "thread_id" : "a" , "thread_id" : "b" }',
            names=("repeats the key",),
        ),
        Case(
            "duplicate-key-escaped",
            "/v1/threads/delete",
            lambda ctx: b'{"thread_id":"a","thread\\u005fid":"b"}',
            names=("repeats the key",),
        ),
    ]
    # -- limits ------------------------------------------------------------------------------------
    lst = "/v1/checkpoints/list"
    cases += [
        Case("limit-negative", lst, json_bytes({"config": None, "limit": -1}), names=("limit",)),
        Case(
            "limit-huge", lst, json_bytes({"config": None, "limit": 10**6}), names=("limit", "max_list_limit")
        ),
        Case(
            "limit-beyond-int64",
            lst,
            lambda ctx: b'{"config":null,"limit":100000000000000000000000000000}',
            names=("64-bit",),
        ),
        Case(
            "metadata-int-beyond-64-bits",
            put,
            lambda ctx: _replace_metadata(
                orjson.dumps(put_body(msgpack_value(ormsgpack.packb([])), thread_id="bigint")),
                b'{"n":-100000000000000000000000000000}',
            ),
            names=("64-bit",),
        ),
        Case(
            "limit-string",
            lst,
            json_bytes({"config": None, "limit": "10; DROP TABLE checkpoints"}),
            names=("limit",),
        ),
        Case(
            "list-config-without-thread",
            lst,
            json_bytes({"config": {"configurable": {"checkpoint_ns": ""}}}),
            names=("thread_id",),
        ),
        Case(
            "list-reserved-prefix-key",
            lst,
            json_bytes({"config": {"configurable": {"thread_id": "x", "__thread_id_prefix__": ""}}}),
            names=("__thread_id_prefix__", "reserved"),
        ),
        # The marker EncryptingSaver gives the backend's saver (a DeltaChannel thread: prune nothing) is the service's own.
        Case(
            "put-reserved-delta-channel-key",
            put,
            json_bytes(
                put_body(
                    msgpack_value(ormsgpack.packb([])), config=config("delta-key", __delta_channel__=True)
                )
            ),
            names=("__delta_channel__", "reserved"),
        ),
        Case(
            "writes-10000",
            "/v1/writes/put",
            json_bytes(
                {
                    "config": config("w", checkpoint_id=empty_checkpoint()["id"]),
                    "writes": [[f"c{i}", i] for i in range(10_000)],
                    "task_id": "t",
                }
            ),
            names=("writes", "10000", "max_writes_per_call"),
        ),
        Case(
            "channels-10000-values",
            put,
            json_bytes(
                put_body(
                    msgpack_value(ormsgpack.packb([])),
                    thread_id="ch",
                    values={f"c{i}": i for i in range(10_000)},
                )
            ),
            names=("values", "max_channels"),
        ),
        Case(
            "channels-10000-new-versions",
            put,
            json_bytes(
                put_body(
                    msgpack_value(ormsgpack.packb([])),
                    thread_id="ch2",
                    new_versions={f"c{i}": "1" for i in range(10_000)},
                )
            ),
            names=("new_versions", "max_channels"),
        ),
        Case(
            "channels-10000-versions-seen",
            put,
            json_bytes(
                put_body(
                    msgpack_value(ormsgpack.packb([])),
                    thread_id="ch3",
                    checkpoint=checkpoint(versions_seen={"node": {f"c{i}": "1" for i in range(10_000)}}),
                )
            ),
            names=("max_channels",),
        ),
        Case(
            "delta-history-10000-channels",
            "/v1/checkpoints/delta-history",
            json_bytes({"config": config("d"), "channels": [f"c{i}" for i in range(10_000)]}),
            names=("channels", "max_channels"),
        ),
        Case(
            "prune-10000-threads",
            "/v1/threads/prune",
            json_bytes({"thread_ids": [f"t{i}" for i in range(10_000)], "strategy": "delete"}),
            names=("thread_ids", "max_ids_per_call"),
        ),
        Case(
            "runs-delete-10000",
            "/v1/runs/delete",
            json_bytes({"run_ids": [f"r{i}" for i in range(10_000)]}),
            names=("run_ids", "max_ids_per_call"),
        ),
        Case(
            "checkpoint-id-not-uuid",
            put,
            json_bytes(
                put_body(
                    msgpack_value(ormsgpack.packb([])),
                    thread_id="cid",
                    checkpoint=checkpoint(id="not-a-uuid"),
                )
            ),
            names=("checkpoint", "id"),
        ),
        Case(
            "checkpoint-id-sql",
            put,
            json_bytes(
                put_body(
                    msgpack_value(ormsgpack.packb([])),
                    thread_id="cid2",
                    checkpoint=checkpoint(id="1' OR '1'='1"),
                )
            ),
            names=("checkpoint", "id"),
        ),
        Case(
            "config-checkpoint-id-not-uuid",
            "/v1/checkpoints/get",
            _get("victim", checkpoint_id="../../x"),
            names=("checkpoint_id", "UUID"),
        ),
        Case(
            "writes-checkpoint-id-not-uuid",
            "/v1/writes/put",
            json_bytes(
                {"config": config("w2", checkpoint_id="x" * 5000), "writes": [["c", 1]], "task_id": "t"}
            ),
            names=("checkpoint_id", "UUID"),
        ),
        Case(
            "before-checkpoint-id-not-uuid",
            lst,
            json_bytes({"config": None, "before": {"configurable": {"checkpoint_id": "yesterday"}}}),
            names=("checkpoint_id",),
        ),
    ]
    # -- thread ids, on every route that takes one ---------------------------------------------------
    for kind, thread_id in THREAD_IDS.items():
        names = ("thread_id",) + (("max_thread_id_length",) if kind == "10kb" else ())
        cases += [
            Case(f"thread-{kind}-get", "/v1/checkpoints/get", _get(thread_id), names=names),
            Case(
                f"thread-{kind}-put",
                put,
                json_bytes(put_body(msgpack_value(ormsgpack.packb([])), thread_id=thread_id)),
                names=names,
            ),
            Case(
                f"thread-{kind}-delete",
                "/v1/threads/delete",
                json_bytes({"thread_id": thread_id}),
                names=("thread_id",),
            ),
            Case(
                f"thread-{kind}-copy",
                "/v1/threads/copy",
                json_bytes({"source_thread_id": "ok", "target_thread_id": thread_id}),
                names=("target_thread_id",),
            ),
            Case(
                f"thread-{kind}-prune",
                "/v1/threads/prune",
                json_bytes({"thread_ids": ["ok", thread_id], "strategy": "delete"}),
                names=("thread_ids",),
            ),
        ]
    # -- NUL (U+0000), which PostgreSQL's text and JSONB cannot hold, wherever a value reaches them --
    cid = empty_checkpoint()["id"]
    no_messages = msgpack_value(ormsgpack.packb([]))
    cases += [
        Case(
            "nul-inline-channel-value",
            put,
            json_bytes(
                put_body(
                    no_messages,
                    thread_id="nul1",
                    values={"messages": no_messages, "x": "a\x00b"},
                    new_versions={"messages": "1", "x": "1"},
                )
            ),
            names=("NUL",),
        ),
        Case(
            "nul-metadata-key",
            put,
            json_bytes(put_body(no_messages, thread_id="nul2", metadata={"k\x00": 1})),
            names=("NUL",),
        ),
        Case(
            "nul-checkpoint-extra-field",
            put,
            json_bytes(put_body(no_messages, thread_id="nul3", checkpoint=checkpoint(extra="a\x00"))),
            names=("NUL",),
        ),
        Case(
            "nul-new-version",
            put,
            json_bytes(put_body(no_messages, thread_id="nul4", new_versions={"messages": "1\x00"})),
            names=("NUL",),
        ),
        Case(
            "nul-checkpoint-ns-put",
            put,
            json_bytes(
                put_body(
                    no_messages, config={"configurable": {"thread_id": "nul5", "checkpoint_ns": "a\x00"}}
                )
            ),
            names=("NUL",),
        ),
        Case(
            "nul-checkpoint-ns-get",
            "/v1/checkpoints/get",
            _get("victim", checkpoint_ns="a\x00"),
            names=("NUL",),
        ),
        Case(
            "nul-write-task-id",
            "/v1/writes/put",
            json_bytes(
                {"config": config("nul6", checkpoint_id=cid), "writes": [["c", 1]], "task_id": "t\x00"}
            ),
            names=("NUL",),
        ),
        Case(
            "nul-write-channel",
            "/v1/writes/put",
            json_bytes(
                {"config": config("nul7", checkpoint_id=cid), "writes": [["c\x00", 1]], "task_id": "t"}
            ),
            names=("NUL",),
        ),
        Case(
            "nul-list-filter-key",
            "/v1/checkpoints/list",
            json_bytes({"config": None, "filter": {"k\x00": 1}}),
            names=("NUL",),
        ),
        Case("nul-run-id", "/v1/runs/delete", json_bytes({"run_ids": ["r\x00"]}), names=("NUL",)),
        msgpack_case(
            "nul-metadata-key",
            put,
            packed(put_body(no_messages, thread_id="nul8", metadata={"k\x00": 1})),
            names=("NUL",),
        ),
    ]
    # -- application/msgpack bodies on the per-step routes -------------------------------------------
    for code in range(8):
        for target in TARGETS:
            cases.append(_msgpack_ext_case(code, target))
    for code in (0, 1, 5):
        for where in ("metadata", "messages-value"):
            cases.append(_msgpack_envelope_ext(code, ("os", "system"), where))
    empty = msgpack_value(ormsgpack.packb([]))
    get_config = ormsgpack.packb(config("victim"))
    cases += [
        msgpack_case(
            "duplicate-key",
            "/v1/checkpoints/get",
            lambda ctx: b"\x82\xa6config" + get_config + b"\xa6config" + get_config,
            names=("repeats the key", "config"),
        ),
        msgpack_case(
            "integer-map-key",
            "/v1/checkpoints/get",
            lambda ctx: b"\x81\xa6config\x81\x01\xc0",
            names=("map key",),
        ),
        msgpack_case(
            "bytes-in-metadata",
            put,
            lambda ctx: ormsgpack.packb(in_msgpack(put_body(empty, thread_id="mb", metadata={"x": b"raw"}))),
            names=("bytes", "'x'"),
        ),
        msgpack_case(
            "bytes-in-array",
            "/v1/writes/put",
            lambda ctx: ormsgpack.packb(
                {
                    "config": config("mw", checkpoint_id=empty_checkpoint()["id"]),
                    "writes": [["c", b"raw"]],
                    "task_id": "t",
                }
            ),
            names=("bytes",),
        ),
        msgpack_case(
            "typed-value-extra-key",
            put,
            lambda ctx: ormsgpack.packb(
                in_msgpack(put_body({"type": "msgpack", "data": b"\x90", "x": 1}, thread_id="tx"))
            ),
            names=("type", "data"),
        ),
        msgpack_case(
            "nan-in-metadata",
            put,
            lambda ctx: ormsgpack.packb(
                in_msgpack(put_body(empty, thread_id="nan", metadata={"x": float("nan")}))
            ),
            names=("finite",),
        ),
        msgpack_case(
            "infinity-in-array",
            "/v1/writes/put",
            lambda ctx: ormsgpack.packb(
                {
                    "config": config("inf", checkpoint_id=empty_checkpoint()["id"]),
                    "writes": [["c", float("inf")]],
                    "task_id": "t",
                }
            ),
            names=("finite",),
        ),
        msgpack_case(
            "deep-metadata-40",
            put,
            lambda ctx: ormsgpack.packb(in_msgpack(put_body(empty, thread_id="deep", metadata=nested(40)))),
            names=("max_nesting_depth",),
        ),
        msgpack_case(
            "deep-arrays-5000",
            "/v1/checkpoints/get",
            lambda ctx: b"\x81\xa6config" + b"\x91" * 5000 + b"\xc0",
            names=("max_nesting_depth",),
        ),
        msgpack_case(
            "truncated",
            put,
            lambda ctx: ormsgpack.packb(in_msgpack(put_body(empty, thread_id="tr")))[:-3],
            names=("msgpack",),
        ),
        msgpack_case(
            "trailing-bytes",
            "/v1/checkpoints/get",
            lambda ctx: ormsgpack.packb({"config": config("victim")}) + b"\xc0",
            names=("after its msgpack value",),
        ),
        msgpack_case("reserved-byte", "/v1/checkpoints/get", lambda ctx: b"\xc1", names=("msgpack",)),
        msgpack_case(
            "non-utf8-string",
            "/v1/checkpoints/get",
            lambda ctx: b"\x81\xa6config\x81\xacconfigurable\x81\xa9thread_id\xa2\xff\xfe",
            names=("UTF-8",),
        ),
        msgpack_case(
            "top-level-array",
            "/v1/checkpoints/get",
            lambda ctx: ormsgpack.packb([config("victim")]),
            names=("body",),
        ),
        msgpack_case("json-sent-as-msgpack", "/v1/checkpoints/get", _get("victim"), names=("body",)),
        msgpack_case(
            "messages-million-entries",
            put,
            lambda ctx: ormsgpack.packb(
                in_msgpack(put_body(msgpack_value(ormsgpack.packb([None] * 1_000_000)), thread_id="million"))
            ),
            names=("values.messages", "max_messages_per_put"),
        ),
        msgpack_case(
            "bad-base64-string-data",
            put,
            lambda ctx: ormsgpack.packb(put_body({"type": "msgpack", "data": "!!!"}, thread_id="b64")),
            names=("values.messages", "base64"),
        ),
        msgpack_case(
            "thread-traversal-put",
            put,
            packed(put_body(empty, thread_id="../../etc/passwd")),
            names=("thread_id",),
        ),
        msgpack_case(
            "checkpoint-id-not-uuid",
            put,
            packed(put_body(empty, thread_id="cid", checkpoint=checkpoint(id="1' OR '1'='1"))),
            names=("checkpoint", "id"),
        ),
        msgpack_case(
            "on-a-json-only-route",
            "/v1/threads/delete",
            lambda ctx: ormsgpack.packb({"thread_id": "victim"}),
            expect=frozenset({415}),
            names=("application/msgpack", "application/json"),
        ),
    ]
    cases += _store_cases()
    names = [case.name for case in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases


def _store_cases() -> list[Case]:
    """The store routes: labels a store refuses, caps, SQL in filter keys, shapes (nothing stored)."""
    items, search, spaces, batch = "/store/items", "/store/items/search", "/store/namespaces", "/store/batch"

    def put(
        namespace: Any = ("a",), key: Any = "k", value: Any = None, **extra: Any
    ) -> Callable[[Context], bytes]:
        return json_bytes(
            {"namespace": list(namespace), "key": key, "value": {"v": 1} if value is None else value, **extra}
        )

    def case(
        name: str, path: str, body: Callable[[Context], bytes], names: tuple[str, ...], method: str = "POST"
    ) -> Case:
        return Case(f"store-{name}", path, body, names=names, method=method)

    no_body = json_bytes({})
    return [
        case("put-label-with-dot", items, put(("a.b",)), ("namespace[0]", "'.'"), "PUT"),
        case("put-label-traversal", items, put(("..", "etc")), ("namespace[0]",), "PUT"),
        case("put-empty-namespace", items, put(()), ("namespace", "empty"), "PUT"),
        case("put-empty-label", items, put(("a", "")), ("namespace[1]", "empty"), "PUT"),
        case("put-langgraph-first", items, put(("langgraph", "x")), ("namespace", "langgraph"), "PUT"),
        case("put-nul-label", items, put(("a\x00b",)), ("namespace[0]", "NUL"), "PUT"),
        case(
            "put-20-labels",
            items,
            put(tuple(f"l{i}" for i in range(20))),
            ("namespace", "limit of 16"),
            "PUT",
        ),
        case("put-10kb-label", items, put(("l" * 10240,)), ("namespace[0]", "limit of 256"), "PUT"),
        case("put-empty-key", items, put(key=""), ("key", "empty"), "PUT"),
        case("put-nul-key", items, put(key="k\x00"), ("key", "NUL"), "PUT"),
        case("put-10kb-key", items, put(key="k" * 10240), ("key", "limit of 256"), "PUT"),
        case("put-value-2mb", items, put(value={"v": "x" * (2 * MB)}), ("value", "limit of"), "PUT"),
        case("put-value-nul", items, put(value={"v": "a\x00b"}), ("value", "NUL"), "PUT"),
        case("put-value-not-object", items, put(value=[1, 2]), ("value",), "PUT"),
        case("put-ttl-negative", items, put(ttl=-5), ("ttl",), "PUT"),
        case("put-ttl-without-store-ttl", items, put(ttl=5), ("ttl", "--store-ttl"), "PUT"),
        case("put-index-not-a-list", items, put(index="text"), ("index",), "PUT"),
        case("put-unknown-field", items, put(owner="rival"), ("owner",), "PUT"),
        case(
            "put-deep-value",
            items,
            lambda ctx: b'{"namespace":["a"],"key":"k","value":' + b'{"a":' * 40 + b"1" + b"}" * 40 + b"}",
            ("max_nesting_depth",),
            "PUT",
        ),
        case("get-no-key", f"{items}?namespace=a", no_body, ("key",), "GET"),
        case("get-no-namespace", f"{items}?key=k", no_body, ("namespace",), "GET"),
        case("get-empty-label", f"{items}?namespace=a..b&key=k", no_body, ("namespace[1]", "empty"), "GET"),
        case("get-10kb-label", f"{items}?namespace={'l' * 10240}&key=k", no_body, ("namespace[0]",), "GET"),
        case(
            "delete-label-with-dot",
            items,
            json_bytes({"namespace": ["a.b"], "key": "k"}),
            ("namespace[0]",),
            "DELETE",
        ),
        case(
            "delete-nul-key", items, json_bytes({"namespace": ["a"], "key": "\x00"}), ("key", "NUL"), "DELETE"
        ),
        case(
            "search-limit-1e6",
            search,
            json_bytes({"namespace_prefix": [], "limit": 1_000_000}),
            ("limit", "0..1000"),
            "POST",
        ),
        case(
            "search-offset-negative",
            search,
            json_bytes({"namespace_prefix": [], "offset": -1}),
            ("offset",),
            "POST",
        ),
        case(
            "search-filter-sql-key",
            search,
            json_bytes({"namespace_prefix": [], "filter": {"a') OR 1=1 --": 1}}),
            ("filter", "refused"),
            "POST",
        ),
        case(
            "search-filter-json-path-key",
            search,
            json_bytes({"namespace_prefix": [], "filter": {"$.x": 1}}),
            ("filter",),
            "POST",
        ),
        case(
            "search-filter-unknown-operator",
            search,
            json_bytes({"namespace_prefix": [], "filter": {"a": {"$where": "1"}}}),
            ("filter.a", "$where"),
            "POST",
        ),
        case(
            "search-prefix-with-dot",
            search,
            json_bytes({"namespace_prefix": ["tenants.other"]}),
            ("namespace_prefix[0]",),
            "POST",
        ),
        case(
            "search-query-20k",
            search,
            json_bytes({"namespace_prefix": [], "query": "q" * 20_000}),
            ("query",),
            "POST",
        ),
        case("namespaces-max-depth-0", spaces, json_bytes({"max_depth": 0}), ("max_depth",), "POST"),
        case("namespaces-limit-1e6", spaces, json_bytes({"limit": 1_000_000}), ("limit",), "POST"),
        case("namespaces-suffix-with-dot", spaces, json_bytes({"suffix": ["a.b"]}), ("path[0]",), "POST"),
        case("batch-unknown-op", batch, json_bytes({"ops": [{"op": "drop_table"}]}), ("op",), "POST"),
        case(
            "batch-10k-ops",
            batch,
            json_bytes({"ops": [{"op": "get", "namespace": ["a"], "key": "k"}] * 10_000}),
            ("ops", "limit of 1000"),
            "POST",
        ),
        case(
            "batch-refused-op-stores-nothing",
            batch,
            json_bytes(
                {
                    "ops": [
                        {"op": "put", "namespace": ["a"], "key": "k", "value": {"v": 1}},
                        {"op": "put", "namespace": ["a.b"], "key": "k", "value": {"v": 1}},
                    ]
                }
            ),
            ("ops[1].namespace[0]",),
            "POST",
        ),
        case(
            "batch-match-type-regex",
            batch,
            json_bytes(
                {
                    "ops": [
                        {
                            "op": "list_namespaces",
                            "match_conditions": [{"match_type": "regex", "path": [".*"]}],
                        }
                    ]
                }
            ),
            ("match_type",),
            "POST",
        ),
    ]


CASES: list[Case] = _cases()
