"""Importing this module is the proof of an import: it creates the file named by ``HOSTILE_TRIPWIRE``.

The corpus names it in ``importlib.import_module`` payloads; a service that decoded them the way
LangGraph's default serializer does would import it and leave the file behind.
"""

import os
from pathlib import Path

if target := os.environ.get("HOSTILE_TRIPWIRE"):
    Path(target).write_text("imported\n")
