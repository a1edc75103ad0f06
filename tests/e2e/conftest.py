"""Fixtures of the end-to-end tests: the project's Docker image, built once per run."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.test_compose import Stack, require_engine


@pytest.fixture(scope="session")
def service_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, dict[str, str]]]:
    """The project's image, built once per run by ``docker-compose build`` under a tag of its own (the
    compose tests' stack, and the tests that run the service in the image, share it); afterwards the
    stack is taken down, the image removed and dangling images pruned. Without a Docker engine: skip on
    a developer's machine, fail when CI=true."""
    require_engine()
    stack = Stack(tmp_path_factory.mktemp("compose"))
    figures: dict[str, str] = {}
    try:
        started = time.monotonic()
        stack.run("build", timeout=1200)
        figures["build"] = f"{time.monotonic() - started:.0f} s"
        yield stack, figures
    finally:
        stack.run("down", "-v", "--remove-orphans", timeout=300, check=False)
        stack.docker("image", "rm", stack.image)
        stack.docker("image", "prune", "-f")
