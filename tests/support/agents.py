"""A small LangGraph chat agent with a tool, driven by a deterministic fake chat model.

The model's answers depend on the messages it is shown, so two runs agree only when both stored and
loaded the same windows: that is what the congruence tests compare.
"""

from __future__ import annotations

import uuid
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

FILLER = "lorem ipsum dolor sit amet " * 15  # ~400 characters a message


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}. {FILLER}"[:400]


class WindowEchoModel(GenericFakeChatModel):
    """Answers from what it sees: how many messages, the first human line, and asks for tools on cue."""

    messages: Any = iter(())  # GenericFakeChatModel requires it; this model computes its answers.

    def bind_tools(self, tools: Any, **kwargs: Any) -> WindowEchoModel:
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        last = messages[-1]
        first_human = next((m.content for m in messages if isinstance(m, HumanMessage)), "")
        if isinstance(last, HumanMessage) and "weather" in last.content:
            city = last.content.rsplit(" ", 1)[-1]
            message = AIMessage(
                content="",
                tool_calls=[
                    {"name": "get_weather", "args": {"city": city}, "id": f"call_{uuid.uuid4().hex[:12]}"}
                ],
            )
        else:
            message = AIMessage(
                content=f"seen {len(messages)} messages; window starts at {first_human[:24]!r}. {FILLER}"[
                    :400
                ]
            )
        return ChatResult(generations=[ChatGeneration(message=message)])


def build_agent(checkpointer: Any) -> Any:
    model = WindowEchoModel()

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [model.invoke([SystemMessage("You are terse."), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


def user_line(turn: int) -> str:
    """Every third turn asks for the weather (a tool call); the others are plain chat."""
    if turn % 3 == 2:
        return f"turn {turn}: what is the weather in city{turn}"
    return f"turn {turn}: {FILLER}"[:400]
