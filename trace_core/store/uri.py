"""The two facts about artifact locations that every layer needs, in one place and without the
storage libraries: which URIs are object storage, and which run names the registry accepts.

    is_remote("s3://mlpipeline/trace")      # True (and KFP's minio://); paths, file:// False
    check_run_name("nightly")               # returns it; ValueError naming the rule otherwise
"""

from __future__ import annotations

import re

REMOTE_SCHEMES = ("s3://", "minio://")
"""Object-store URIs: ``minio://bucket/key`` is how KFP names its artifacts on S3."""
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A run name becomes one object-key segment of the checkpoint registry."""
RUN_NAME_RULE = (
    "use letters, digits, '.', '_' and '-' (at most 128), starting with a letter or digit"
)


def is_remote(uri: str) -> bool:
    """True for ``s3://`` and ``minio://`` URIs (any case of the scheme)."""
    return uri[:8].lower().startswith(REMOTE_SCHEMES)


def check_run_name(name: str, what: str = "run name") -> str:
    """``name`` if the registry accepts it; else a ValueError that says ``what`` and the rule."""
    if not RUN_NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r}: {RUN_NAME_RULE}")
    return name
