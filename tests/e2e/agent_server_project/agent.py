"""The sample graph tests/e2e/test_agent_server.py runs on `langgraph dev`: a chat turn by a fake chat model (no
network); a human message starting with "slow" makes the turn take seconds (for multitask rollback), one
starting with "confirm" adds a confirmation that interrupts for the user's answer.

Before each chat turn, `remember` uses Agent Server's store (`runtime.store`, the service's when
langgraph.json names `reducing_saver.client.agent_server.store`): it writes a note of the turn under
("notes", thread_id), and searches the memories the service extracted from pruned messages under
("memories", thread_id), recording the keys it found under ("recall", thread_id) for the test to compare.
"""

from __future__ import annotations

import asyncio
import itertools

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import interrupt

#: Long answers, so that the stored windows are worth bounding.
model = GenericFakeChatModel(messages=(AIMessage(f"answer {i} " + "x" * 300) for i in itertools.count()))


def _last_human(state: MessagesState) -> str:
    return next((str(m.content) for m in reversed(state["messages"]) if m.type == "human"), "")


async def remember(state: MessagesState, config: RunnableConfig, runtime: Runtime) -> dict:
    thread_id = config["configurable"]["thread_id"]
    said = _last_human(state)
    turn = said.split(" y")[0]
    await runtime.store.aput(("notes", thread_id), turn.replace(" ", "-"), {"text": turn})
    found = await runtime.store.asearch(("memories", thread_id), limit=100)
    await runtime.store.aput(
        ("recall", thread_id), "latest", {"turn": turn, "keys": sorted(i.key for i in found)}
    )
    return {}


async def chat(state: MessagesState) -> dict:
    if _last_human(state).startswith("slow"):
        await asyncio.sleep(5)
    return {"messages": [await model.ainvoke(state["messages"])]}


def needs_confirmation(state: MessagesState) -> str:
    return "confirm" if _last_human(state).startswith("confirm") else END


def confirm(state: MessagesState) -> dict:
    answer = interrupt("confirm?")
    return {"messages": [AIMessage(f"confirmed: {answer}")]}


builder = StateGraph(MessagesState)
builder.add_node("remember", remember)
builder.add_node("chat", chat)
builder.add_node("confirm", confirm)
builder.add_edge(START, "remember")
builder.add_edge("remember", "chat")
builder.add_conditional_edges("chat", needs_confirmation, ["confirm", END])
builder.add_edge("confirm", END)
graph = builder.compile()
