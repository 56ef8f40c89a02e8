"""Pin each pushed image's digest in components/images.env, beside its tag (make push).

``make push`` writes the registry's digest of each image it pushed into its line:
``TRACE_IMAGE=<registry>/<path>/trace:<tag>@sha256:<hex>``.

    python -m pipelines.digests record TRACE_IMAGE build/TRACE_IMAGE.digest

``make push`` runs this after each push, on the file its container tool wrote:

- buildah: ``buildah push --digestfile FILE REF`` writes the digest of the manifest it pushed,
  ``sha256:<hex>``;
- docker, whose push writes no file: ``docker image inspect --format '{{json .RepoDigests}}'
  REF`` after the push, ``["<registry>/<path>/trace@sha256:<hex>", ...]``, one entry for each
  repository the image was pushed to or pulled from; the entry of REF's repository is taken.

(Not docker's ``--iidfile``: that is the image's ID, the digest of its config, by which no
registry serves the image.) ``make manifests`` (``pipelines.regenerate``) then writes the pinned
references everywhere: the kustomize images component gets ``digest:``, the compiled pipeline
and the Argo manifests name ``image:tag@sha256:...``, which a node pulls by the digest alone.

A pin belongs to the tag it was pushed under: ``make manifests REGISTRY=...`` drops it, and so
must whoever edits a tag in components/images.env (delete the ``@sha256:...`` with the old tag;
the next ``make push`` pins the new one). ``make images`` builds, and ``make push`` pushes, the
tag without the digest.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from components.images import IMAGES_ENV

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def tag_of(reference: str) -> str:
    """``registry/path/name:tag`` of a reference that may carry ``@sha256:...``."""
    return reference.partition("@")[0]


def repository_of(reference: str) -> str:
    """``registry/path/name``: the reference without its tag and digest, with Docker Hub's
    implicit ``docker.io/`` and ``library/`` taken off (docker writes its names either way)."""
    rest = tag_of(reference)
    if rest.rfind(":") > rest.rfind("/"):
        rest = rest[: rest.rfind(":")]
    for prefix in ("docker.io/", "index.docker.io/", "library/"):
        rest = rest.removeprefix(prefix)
    return rest


def parse_digest(text: str, reference: str) -> str:
    """The digest a container tool wrote for ``reference``: buildah's ``--digestfile``
    (``sha256:<hex>``) or docker's ``RepoDigests`` as JSON (the entry of its repository)."""
    text = text.strip()
    if DIGEST.fullmatch(text):
        return text
    try:
        entries = json.loads(text)
    except json.JSONDecodeError:
        entries = None
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ValueError(
            f"expected sha256:<64 hex> (buildah push --digestfile) or docker's RepoDigests as "
            f"JSON, got {text[:120]!r}"
        )
    wanted = repository_of(reference)
    found = [
        digest
        for entry in entries
        for name, _, digest in [entry.partition("@")]
        if repository_of(name) == wanted and DIGEST.fullmatch(digest)
    ]
    if not found:
        raise ValueError(
            f"docker's RepoDigests {entries} hold no digest of {wanted}: was {tag_of(reference)} "
            "pushed?"
        )
    if len(set(found)) > 1:
        raise ValueError(f"docker's RepoDigests hold several digests of {wanted}: {found}")
    return found[0]


def pin(text: str, name: str, digest: str) -> str:
    """components/images.env's ``text`` with the reference of ``name`` pinned to ``digest``
    (any digest it had replaced); comments and the other lines kept."""
    if not DIGEST.fullmatch(digest):
        raise ValueError(f"digest {digest!r}: expected sha256:<64 hex>")
    lines, pinned = [], False
    for line in text.splitlines():
        key, sep, reference = line.partition("=")
        if sep and key.strip() == name:
            line = f"{name}={tag_of(reference.strip())}@{digest}"
            pinned = True
        lines.append(line)
    if not pinned:
        raise KeyError(f"no {name}=... line")
    return "\n".join(lines) + "\n"


def reference_of(text: str, name: str) -> str:
    """The reference ``name`` is set to in components/images.env's ``text``."""
    for line in text.splitlines():
        key, sep, reference = line.partition("=")
        if sep and key.strip() == name:
            return reference.strip()
    raise KeyError(f"no {name}=... line")


def record(name: str, digest_file: Path, images_env: Path = IMAGES_ENV) -> str:
    """Pin ``name``'s reference in ``images_env`` to the digest in ``digest_file``; the pinned
    reference."""
    text = images_env.read_text()
    reference = reference_of(text, name)
    if not digest_file.is_file():
        raise FileNotFoundError(f"{digest_file}: missing; the push should have written it")
    digest = parse_digest(digest_file.read_text(), reference)
    images_env.write_text(pin(text, name, digest))
    return f"{tag_of(reference)}@{digest}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    recorder = commands.add_parser("record", help="pin NAME to the digest in DIGEST_FILE")
    recorder.add_argument("name", help="the line of components/images.env: TRACE_IMAGE, ...")
    recorder.add_argument("digest_file", type=Path, help="what the push wrote (see above)")
    recorder.add_argument("--images-env", type=Path, default=IMAGES_ENV)
    args = parser.parse_args()
    try:
        pinned = record(args.name, args.digest_file, args.images_env)
    except (ValueError, KeyError, FileNotFoundError) as err:
        message = err.args[0] if isinstance(err, KeyError) else err
        sys.exit(f"make push: {args.images_env}, {args.name}: {message}")
    print(f"pinned {args.name}={pinned} in {args.images_env} (make manifests writes it everywhere)")
