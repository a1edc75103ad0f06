"""An on_prune hook for service processes under test: appends what it gets to a JSON-lines file."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

_lock = threading.Lock()


def record(messages: list[Any], namespace: tuple[str, ...]) -> None:
    """Append one line per pruned message to the file named by RS_TEST_PRUNE_LOG."""
    path = os.environ["RS_TEST_PRUNE_LOG"]
    lines = []
    for message in messages:
        fields = message if isinstance(message, dict) else message.model_dump()
        lines.append(
            json.dumps(
                {
                    "id": fields.get("id"),
                    "type": fields.get("type"),
                    "content": fields.get("content"),
                    "namespace": list(namespace),
                }
            )
        )
    with _lock, open(path, "a", encoding="utf-8") as out:
        out.write("".join(line + "\n" for line in lines))
