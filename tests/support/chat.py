"""A real LangGraph chat graph answered by a langchain_core fake chat model, and its questions."""

from __future__ import annotations


def padded(text: str, length: int = 400) -> str:
    """``text`` padded to exactly ``length`` characters, so message sizes do not drift between turns."""
    return text.ljust(length, ".")[:length]


def human(turn: int, prefix: str = "g", length: int = 400):
    from langchain_core.messages import HumanMessage

    return HumanMessage(padded(f"question {turn}", length), id=f"{prefix}-h-{turn:04d}")


def build_chat_graph(
    checkpointer, *, prefix: str = "g", length: int = 400, with_tools: bool = False, state_schema=None
):
    """A compiled ``StateGraph(MessagesState)`` whose chat node answers with ``GenericFakeChatModel``.

    Without tools each turn adds one AI answer of ``length`` characters. With tools, on two turns out of
    three the model first calls one or two tools (answered by a prebuilt ``ToolNode``), then answers.
    Ids are deterministic and fixed-width (``f"{prefix}-ai-{turn:04d}"``), so sizes do not drift.
    """
    import itertools

    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    def answers():
        for turn in itertools.count():
            if with_tools and turn % 3 != 2:
                calls = [
                    {
                        "id": f"{prefix}-call-{turn:04d}-{k}",
                        "name": "lookup",
                        "args": {"q": f"turn {turn:04d} part {k}"},
                    }
                    for k in range(1 + turn % 2)
                ]
                yield AIMessage("", id=f"{prefix}-ai-{turn:04d}-call", tool_calls=calls)
            yield AIMessage(padded(f"answer {turn}", length), id=f"{prefix}-ai-{turn:04d}")

    model = GenericFakeChatModel(messages=answers())

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        return padded(f"result for {q}", length)

    def chat(state):
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(state_schema or MessagesState)
    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    if with_tools:
        builder.add_node("tools", ToolNode([lookup]))
        builder.add_conditional_edges("chat", tools_condition)
        builder.add_edge("tools", "chat")
    else:
        builder.add_edge("chat", END)
    return builder.compile(checkpointer=checkpointer)


def build_subgraph_chat(checkpointer, **chat):
    """A parent graph whose one node is :func:`build_chat_graph` (``chat`` its arguments) as a subgraph
    sharing ``messages``, the usual multi-agent shape: each turn the subgraph checkpoints the parent's
    window in a namespace of its own (``inner:<task id>``) and hands the messages back."""
    from langgraph.graph import START, MessagesState, StateGraph

    parent = StateGraph(MessagesState)
    parent.add_node("inner", build_chat_graph(None, **chat))
    parent.add_edge(START, "inner")
    return parent.compile(checkpointer=checkpointer)
