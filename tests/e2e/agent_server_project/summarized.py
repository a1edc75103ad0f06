"""The second graph of the sample project, for running summaries (tests/e2e/test_agent_server.py): a chat turn
by a fake chat model (no network) whose answer carries a ``FACT:`` line, which the deterministic test
summarizer keeps, and says which running summary the model was sent (its version and how many messages it
covered, or none), so the test sees what the agent saw.
"""

from __future__ import annotations

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langgraph.graph import START, MessagesState, StateGraph


class _Model(GenericFakeChatModel):
    """Answers from its prompt: the last human turn's number, and the running summary it was given."""

    def _generate(self, messages: list[BaseMessage], stop=None, run_manager=None, **kwargs):
        from langchain_core.outputs import ChatGeneration, ChatResult

        said = next((str(m.content) for m in reversed(messages) if m.type == "human"), "")
        question = said.splitlines()[-1] if said else ""
        summary = next((m for m in messages if m.additional_kwargs.get("lc_source") == "summarization"), None)
        if summary is None:
            seen = "saw no summary"
        else:
            mark = summary.additional_kwargs.get("reducing_saver_summary", {})
            seen = f"saw summary version {mark.get('version')} covering {mark.get('covered')}"
        answer = AIMessage(f"FACT: answered {question}\n{seen}")
        return ChatResult(generations=[ChatGeneration(message=answer)])


model = _Model(messages=iter(()))


async def chat(state: MessagesState) -> dict:
    return {"messages": [await model.ainvoke(state["messages"])]}


builder = StateGraph(MessagesState)
builder.add_node("chat", chat)
builder.add_edge(START, "chat")
graph = builder.compile()
