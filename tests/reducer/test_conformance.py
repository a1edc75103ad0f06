"""langgraph-checkpoint-conformance against the in-process ReducingSaver.

The suite skips every capability it does not detect, so a wrapper that hid ``aprune`` would still
"pass". Each test therefore also pins the detected set: equal to the inner saver's, and spelled out.
The suite never writes a ``messages`` channel, so this proves the delegation, not the reducer.
"""

from __future__ import annotations

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import BASE_CAPABILITIES, Capability, DetectedCapabilities
from langgraph.checkpoint.conformance.report import CapabilityReport
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from reducing_saver.reducer import MessageReducer, ReducingSaver


def reducer() -> MessageReducer:
    return MessageReducer(max_messages=6, min_messages=4)


def check_report(
    report: CapabilityReport, pairs: list[tuple[object, ReducingSaver]], expected: frozenset
) -> None:
    failures = {
        name: result.failures
        for name, result in report.results.items()
        if result.detected and not result.passed
    }
    detected = {Capability(name) for name, result in report.results.items() if result.detected}
    print(f"\n{report.checkpointer_name}: detected {sorted(c.value for c in detected)}")
    for name, messages in failures.items():
        print(f"  {name} FAILED:")
        for message in messages:
            print(f"    {message}")

    assert failures == {}
    assert all(report.results[c.value].tests_passed > 0 for c in detected)
    assert detected == expected
    assert pairs, "the factory was never called"
    for inner, wrapper in pairs:
        assert (
            DetectedCapabilities.from_instance(inner).detected
            == DetectedCapabilities.from_instance(wrapper).detected
        )
        assert DetectedCapabilities.from_instance(wrapper).detected == expected


async def test_conformance_over_in_memory_saver() -> None:
    pairs: list[tuple[object, ReducingSaver]] = []

    @checkpointer_test(name="ReducingSaver(InMemorySaver)")
    async def factory():
        inner = InMemorySaver()
        wrapper = ReducingSaver(inner, reducer())
        pairs.append((inner, wrapper))
        yield wrapper

    report = await validate(factory)
    check_report(report, pairs, frozenset(BASE_CAPABILITIES))
    assert frozenset(BASE_CAPABILITIES) == {
        Capability.PUT,
        Capability.PUT_WRITES,
        Capability.GET_TUPLE,
        Capability.LIST,
        Capability.DELETE_THREAD,
    }


async def test_conformance_over_async_postgres_saver(fresh_pg: str) -> None:
    pairs: list[tuple[object, ReducingSaver]] = []

    @checkpointer_test(name="ReducingSaver(AsyncPostgresSaver)")
    async def factory():
        async with AsyncPostgresSaver.from_conn_string(fresh_pg) as inner:
            await inner.setup()
            wrapper = ReducingSaver(inner, reducer())
            pairs.append((inner, wrapper))
            yield wrapper

    report = await validate(factory)
    check_report(
        report,
        pairs,
        frozenset(
            {
                Capability.PUT,
                Capability.PUT_WRITES,
                Capability.GET_TUPLE,
                Capability.LIST,
                Capability.DELETE_THREAD,
                Capability.PRUNE,
            }
        ),
    )
