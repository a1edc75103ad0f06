"""The sample graph tests/test_agent_server.py runs on `langgraph dev`: a chat turn by a fake chat model (no
network); a human message starting with "slow" makes the turn take seconds (for multitask rollback), one
starting with "confirm" adds a confirmation that interrupts for the user's answer."""

from __future__ import annotations

import asyncio
import itertools

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import interrupt

#: Long answers, so that the stored windows are worth bounding.
model = GenericFakeChatModel(messages=(AIMessage(f"answer {i} " + "x" * 300) for i in itertools.count()))


def _last_human(state: MessagesState) -> str:
    return next((str(m.content) for m in reversed(state["messages"]) if m.type == "human"), "")


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
builder.add_node("chat", chat)
builder.add_node("confirm", confirm)
builder.add_edge(START, "chat")
builder.add_conditional_edges("chat", needs_confirmation, ["confirm", END])
builder.add_edge("confirm", END)
graph = builder.compile()
