"""Token auth for the clients of a Ray head: the pipeline's steps, the exit handler's release,
``trace-rl`` commands given a head's address.

The RayCluster requires a token (KubeRay's ``authOptions: {mode: token}``, the Secret
``trace-ray-auth``, key ``auth_token``). Ray 2.60's clients send it only when both variables are
set: ``RAY_AUTH_MODE=token`` switches auth on for the process (read once, at Ray's first use)
and ``RAY_AUTH_TOKEN`` is the token. The token alone sends nothing, and the head answers 401.
So every step that talks to Ray gets both (``pipelines/trace_training.py``, ``pipelines/argo.py``),
and before connecting a client checks them here:

    check_client("http://head:8265")        # raises RayAuthError: one line, what to set
    with explained("http://head:8265"):     # a 401/403 from the head → RayAuthError
        client = JobSubmissionClient(url)

A missing or refused token fails in one line that names the Secret and the variable, not in a
traceback from Ray's HTTP layer; a pipeline step's body runs ``with step_errors():`` so the
step's log ends with that line alone (``trace-rl`` commands print it as ``error: ...``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

SECRET = "trace-ray-auth"
"""The Secret holding the head's token (manifests/secrets/ray-auth), key ``SECRET_KEY``."""
SECRET_KEY = "auth_token"
TOKEN_ENV = "RAY_AUTH_TOKEN"
MODE_ENV = "RAY_AUTH_MODE"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
"""Ray also reads the token from this file, or from ~/.ray/auth_token."""
CLIENT_ENV = {MODE_ENV: "token"}
"""What every client of a token-auth head sets beside ``RAY_AUTH_TOKEN``."""


class RayAuthError(RuntimeError):
    """A client of the Ray head is set up so that the head will refuse it, or it did."""


def _has_token() -> bool:
    if os.environ.get(TOKEN_ENV, "").strip():
        return True
    path = os.environ.get(TOKEN_PATH_ENV) or str(Path.home() / ".ray" / "auth_token")
    with contextlib.suppress(OSError):
        return bool(Path(path).read_text().strip())
    return False


def check_client(where: str) -> None:
    """Raise ``RayAuthError`` when this process would reach the head at ``where`` without
    its token: ``RAY_AUTH_TOKEN`` set while ``RAY_AUTH_MODE`` is not ``token`` (Ray sends
    nothing), or ``RAY_AUTH_MODE=token`` with no token at all."""
    if where == "auto":  # a Ray job's driver on a node of the cluster: the node's own settings
        return
    mode = os.environ.get(MODE_ENV, "").strip().lower()
    if os.environ.get(TOKEN_ENV, "").strip() and mode != "token":
        raise RayAuthError(
            f"{TOKEN_ENV} is set but {MODE_ENV} is {mode or 'unset'}: Ray's clients send the "
            f"token only with {MODE_ENV}=token, so the Ray head at {where} would refuse this "
            f"step; set {MODE_ENV}=token beside {TOKEN_ENV} (the compiled pipeline and the "
            "Argo manifests do)"
        )
    if mode == "token" and not _has_token():
        raise RayAuthError(
            f"{MODE_ENV}=token but {TOKEN_ENV} is empty: no token for the Ray head at {where}; "
            f"create the Secret {SECRET} (key {SECRET_KEY}) in the namespace the steps run in "
            "(docs/deploy.md, section 4), or set the run parameter ray_auth_secret to yours"
        )


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is the head refusing this client's token (or its lack of one)."""
    from ray.exceptions import AuthenticationError

    if isinstance(error, AuthenticationError):
        return True
    text = str(error)
    return "Unauthenticated" in text or "UNAUTHENTICATED" in text or "401 Unauthorized" in text


@contextlib.contextmanager
def explained(where: str) -> Iterator[None]:
    """Within the block, the head refusing the token raises ``RayAuthError`` in one line."""
    try:
        yield
    except Exception as error:
        if not is_refusal(error):
            raise
        sent = "a token" if _has_token() else "no token"
        raise RayAuthError(
            f"the Ray head at {where} refused this client ({sent} sent, {MODE_ENV}="
            f"{os.environ.get(MODE_ENV, 'unset')}): {TOKEN_ENV} must hold key {SECRET_KEY} of "
            f"the Secret {SECRET} that the RayCluster's authOptions name, with {MODE_ENV}=token"
        ) from None


@contextlib.contextmanager
def step_errors() -> Iterator[None]:
    """For a KFP step's body: a ``RayAuthError`` ends the step (exit 1) with its one line
    instead of the executor's traceback."""
    try:
        yield
    except RayAuthError as err:
        raise SystemExit(f"error: {err}") from None
