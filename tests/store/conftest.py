"""Fixtures of the storage tests: SeaweedFS S3 stores on 127.0.0.1, and small trees.

``seaweed`` (tests/conftest.py) is one server for the whole session; ``crashable`` is a fresh
one per test, for tests that kill and restart it. Both are stopped by pid (SIGTERM, then
SIGKILL) when their scope ends, and the session checks that none is left running.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo
from trace_core.store.artifacts import RetryPolicy, S3Settings, S3Store
from trace_core.store.server import SeaweedServer

BUCKET = "trace"  # the bucket of tests/conftest.py's ``seaweed``, and of ``crashable``
_started: list[SeaweedServer] = []


def _start(data_dir: Path) -> SeaweedServer:
    server = SeaweedServer.start(data_dir, buckets=(BUCKET,))
    _started.append(server)
    return server


@pytest.fixture
def crashable(tmp_path: Path) -> Iterator[SeaweedServer]:
    """A server of this test's own, to kill and restart on the same folder and ports."""
    server = _start(tmp_path / "seaweedfs")
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _no_server_left() -> Iterator[None]:
    yield
    alive = [s.pid for s in _started if s.running()]
    assert not alive, f"SeaweedFS servers still running after the tests: pids {alive}"


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A prefix of this test's own, so tests sharing the session server never meet."""
    return f"{request.node.name}-{os.getpid()}".replace("[", "-").replace("]", "")


@pytest.fixture
def bucket_store(seaweed: SeaweedServer, prefix: str) -> S3Store:
    """s3://trace/PREFIX on the session server, configured without touching os.environ."""
    return s3_store(seaweed, prefix)


def s3_store(server: SeaweedServer, prefix: str, retry: RetryPolicy | None = None) -> S3Store:
    return S3Store(BUCKET, prefix, S3Settings.from_env(server.env()), retry)


@pytest.fixture
def tree_factory() -> Callable[..., RolloutTree]:
    return hand_tree


def hand_tree(tree_id: int = 0, strategy: str = "trace", iteration: int = 0) -> RolloutTree:
    """A small tree worked out by hand (rewards 1, 0, 1, 1 at leaves 3, 4, 6, 7).

        0 prompt  (V 0.5)
        ├── 1 ── 3 r=1
        │   └─ 4 r=0   (continuation from 1)
        └── 2 ── 5 ── 6 r=1
                  └── 7 r=1 (continuation from 5)

    V̂: leaves below 0 are 3, 4, 6, 7 → 3/4; below 1: 1/2; below 2 and 5: 1.
    """
    info = TreeInfo("run-a", iteration, f"p{tree_id}", tree_id, strategy, 3)
    b = TreeBuilder(info, prompt_tokens=np.arange(4, dtype=np.int32), prompt_text="What is 2+3?")
    lp = [-0.5, -0.25]
    n1 = b.add_turn(0, [11, 12], [21], lp, text="calc[2+3]", observation="5")
    n2 = b.add_turn(0, [13, 14], [22], lp, text="search[2+3]", observation="five")
    n3 = b.add_turn(n1, [15, 16], [], lp, text="answer[5]")
    n4 = b.add_turn(n1, [17, 18], [], lp, text="answer[6]", branch=True)
    n5 = b.add_turn(n2, [19, 20], [23], lp, text="calc[2+3]", observation="5")
    n6 = b.add_turn(n5, [21, 22], [], lp, text="answer[5]")
    n7 = b.add_turn(n5, [23, 24], [], lp, text="answer[<5>]", branch=True)
    for node, reward in ((n3, 1), (n4, 0), (n6, 1), (n7, 1)):
        b.set_reward(node, reward)
    b.set_predicted_v(0, 0.5)
    b.set_predicted_v(n1, 0.4)
    b.set_predicted_v(n5, 0.9)
    return b.build()


@pytest.fixture
def store_on() -> Callable[[SeaweedServer, str, RetryPolicy | None], S3Store]:
    """``store_on(server, prefix, retry)``: a store on a server of the test's own."""
    return s3_store
