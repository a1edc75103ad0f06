"""A deepagents agent driven by a scripted chat model (no network), for tests that run it for many turns.

``ScriptedModel`` answers from the conversation alone, so two runs of the same turns (one against the
service, one against a reference saver) see the same model outputs: each turn's plan depends on the
turn's number, the human message names it. Every few turns the agent writes its todos, writes, reads,
edits and lists files (two tool calls at once), hands a task to the general-purpose subagent, or calls a
tool under ``interrupt_on`` (the turn is resumed with an approval). Message ids are fixed, so states
compare whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

_TURN = re.compile(r"turn (\d+)")


def _turn_of(messages: Sequence[BaseMessage]) -> int:
    for message in reversed(messages):
        if isinstance(message, HumanMessage) and (found := _TURN.search(str(message.content))):
            return int(found.group(1))
    return -1


def _text(message: BaseMessage) -> str:
    return message.content if isinstance(message.content, str) else str(message.content)


class ScriptedModel(GenericFakeChatModel):
    """A chat model whose every answer is a function of the messages it is given."""

    messages: Any = iter(())  # unused: answers come from ``_answer``
    #: Above this many characters of history, a summarization middleware's prompt (no turn in it) is what
    #: the model is asked; its answer is the summary.
    profile: dict | None = {"max_input_tokens": 6000}

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:
        return self

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=self._answer(messages))])

    def _answer(self, messages: list[BaseMessage]) -> AIMessage:
        turn = _turn_of(messages)
        last = messages[-1] if messages else None
        if turn < 0:  # a summarization prompt, or a subagent's task
            text = _text(last) if last is not None else ""
            if "subtask" in text:
                return AIMessage(f"subagent report on {text[:40]}")
            return AIMessage(
                f"summary of {len(messages)} message(s), {sum(len(_text(m)) for m in messages)} chars"
            )
        step = sum(1 for m in messages[messages.index(_last_human(messages)) :] if isinstance(m, AIMessage))
        ident = f"ai-{turn:03d}-{step}"
        if isinstance(last, ToolMessage) or step > 0:
            return AIMessage(f"turn {turn}: done after {step} step(s). " + "x" * 120, id=ident)
        kind = turn % 8
        path = f"/notes/n{turn:03d}.md"
        if kind == 0:
            todos = [
                {"content": f"task {turn}-{k}", "status": "pending" if k else "in_progress"} for k in range(3)
            ]
            calls = [{"name": "write_todos", "args": {"todos": todos}, "id": f"c-{turn}-0"}]
        elif kind in (1, 6):  # kind 6: write_file is under interrupt_on
            calls = [
                {
                    "name": "write_file",
                    "args": {"file_path": path, "content": f"note {turn}\nline two\n"},
                    "id": f"c-{turn}-0",
                }
            ]
        elif kind == 2:
            calls = [
                {
                    "name": "read_file",
                    "args": {"file_path": f"/notes/n{turn - 1:03d}.md"},
                    "id": f"c-{turn}-0",
                }
            ]
        elif kind == 3:
            calls = [
                {
                    "name": "edit_file",
                    "args": {
                        "file_path": f"/notes/n{turn - 2:03d}.md",
                        "old_string": "line two",
                        "new_string": f"edited at {turn}",
                    },
                    "id": f"c-{turn}-0",
                }
            ]
        elif kind == 4:  # two tools at once
            calls = [
                {"name": "ls", "args": {"path": "/notes"}, "id": f"c-{turn}-0"},
                {
                    "name": "read_file",
                    "args": {"file_path": f"/notes/n{turn - 3:03d}.md"},
                    "id": f"c-{turn}-1",
                },
            ]
        elif kind == 5:
            calls = [
                {
                    "name": "task",
                    "args": {
                        "description": f"subtask {turn}: check the notes",
                        "subagent_type": "general-purpose",
                    },
                    "id": f"c-{turn}-0",
                }
            ]
        else:
            return AIMessage(f"turn {turn}: a plain answer. " + "y" * 200, id=ident)
        return AIMessage("", id=ident, tool_calls=calls)


def _last_human(messages: Sequence[BaseMessage]) -> BaseMessage:
    for message in reversed(messages):
        if isinstance(message, HumanMessage) and _TURN.search(str(message.content)):
            return message
    return messages[0]


def build_deep_agent(checkpointer: Any, *, langchain_summarization: bool = False) -> Any:
    """A deepagents agent with the scripted model, ``write_file`` under ``interrupt_on``; with
    ``langchain_summarization``, LangChain's ``SummarizationMiddleware`` in place of deepagents' own."""
    from deepagents import create_deep_agent
    from langchain.agents.middleware import SummarizationMiddleware, TodoListMiddleware

    model = ScriptedModel()
    middleware: list[Any] = [TodoListMiddleware()]
    if langchain_summarization:
        middleware.append(
            SummarizationMiddleware(model=model, trigger=("messages", 24), keep=("messages", 8))
        )
    return create_deep_agent(
        model=model,
        system_prompt="You keep notes.",
        middleware=middleware,
        interrupt_on={"write_file": {"allowed_decisions": ["approve"]}},
        checkpointer=checkpointer,
    )


def human_turn(turn: int) -> dict[str, Any]:
    return {"messages": [HumanMessage(f"turn {turn}: please go on. " + "z" * 150, id=f"h-{turn:03d}")]}
