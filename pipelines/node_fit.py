"""Whether a pod fits a node, by Kubernetes' own rules, as far as a node's JSON tells: its
allocatable resources against the pod's requests (limits where a container has none), the pod's
nodeSelector and required node affinity against the node's labels, and the node's NoSchedule and
NoExecute taints against the pod's tolerations.

    nodes = read_nodes(json.loads(text), "--nodes nodes.json")   # ValueError naming the source
    pod = PodShape.of("worker group gpu", template["spec"], [])
    lines = node_lines(pod, nodes[0])       # (fits, check, detail): resources, affinity, taints

What a node's JSON does not tell is left out: the pods already on it, its daemonsets' share of
the allocatable, preferred affinities, pod (anti-)affinity and topology spread.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from components.images import DRIVER_LABELS, GPU_DRIVER_MAJOR

GPU = "nvidia.com/gpu"
RESOURCES = (GPU, "cpu", "memory", "ephemeral-storage")
GIB = 2**30

_SUFFIXES = {
    **{s: Decimal(2) ** (10 * (n + 1)) for n, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    **{s: Decimal(10) ** (3 * (n + 1)) for n, s in enumerate(("k", "M", "G", "T", "P", "E"))},
}
"""Kubernetes' quantity suffixes: binary (Ki = 2^10 …), decimal (k = 10^3 …) and n, u, m."""


def quantity(text: object, where: str) -> Decimal:
    """A Kubernetes quantity (``1536Gi``, ``207410m``, ``8``, ``1e3``) as a number."""
    raw = str(text).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if raw.endswith(suffix) and raw[: -len(suffix)]:
            number, scale = raw[: -len(suffix)], Decimal(_SUFFIXES[suffix])
            break
    else:
        number, scale = raw, Decimal(1)
    try:
        value = Decimal(number) * scale
    except InvalidOperation:
        raise ValueError(f"{where}: {raw!r} is not a Kubernetes quantity") from None
    if not value.is_finite() or value < 0:
        raise ValueError(f"{where}: {raw!r} is not a Kubernetes quantity")
    return value


def show(resource: str, value: Decimal) -> str:
    """``value`` as a person reads it: bytes in Gi, CPUs and GPUs as numbers."""
    if resource in ("memory", "ephemeral-storage"):
        gib = value / GIB
        return f"{gib:.0f}Gi" if gib == gib.to_integral_value() else f"{gib:.1f}Gi"
    return f"{value.normalize():f}"


@dataclass(frozen=True)
class Node:
    name: str
    allocatable: dict[str, Decimal]
    labels: dict[str, str]
    taints: tuple[dict[str, str], ...]


def read_nodes(data: object, source: str) -> list[Node]:
    """The nodes of ``kubectl get nodes -o json`` (a List of Nodes) or of one Node's JSON."""
    if isinstance(data, dict) and data.get("kind") == "Node":
        data = {"kind": "List", "items": [data]}
    items = data.get("items") if isinstance(data, dict) else None
    if not isinstance(items, list) or any(
        not isinstance(i, dict) or i.get("kind", "Node") != "Node" for i in items
    ):
        raise ValueError(
            f"{source}: not the JSON of `kubectl get nodes -o json` (a List whose items are Nodes)"
        )
    nodes = []
    for n, item in enumerate(items):
        meta, status = item.get("metadata") or {}, item.get("status") or {}
        name = str(meta.get("name") or f"item {n}")
        allocatable = status.get("allocatable")
        if not isinstance(allocatable, dict):
            raise ValueError(f"{source}: node {name} has no status.allocatable")
        where = f"{source}: node {name}"
        amounts = {r: quantity(allocatable.get(r, 0), f"{where}, {r}") for r in RESOURCES}
        taints = tuple((item.get("spec") or {}).get("taints") or ())
        nodes.append(Node(name, amounts, dict(meta.get("labels") or {}), taints))
    return nodes


@dataclass(frozen=True)
class PodShape:
    """What a pod asks of its node, read from a pod template."""

    source: str
    requests: dict[str, Decimal]
    node_selector: dict[str, str]
    terms: tuple[dict[str, Any], ...]
    """requiredDuringScheduling nodeSelectorTerms: any one must match."""
    tolerations: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, source: str, spec: dict[str, Any], extra: list[dict[str, Any]]) -> PodShape:
        """``spec``'s containers and ``extra`` containers: requests, limits where none."""
        requests = dict.fromkeys(RESOURCES, Decimal(0))
        for container in [*spec.get("containers", []), *extra]:
            resources = container.get("resources") or {}
            asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            for resource in RESOURCES:
                requests[resource] += quantity(asked.get(resource, 0), source)
        affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
        required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
        return cls(
            source,
            requests,
            dict(spec.get("nodeSelector") or {}),
            tuple(required.get("nodeSelectorTerms") or ()),
            tuple(spec.get("tolerations") or ()),
        )


def tolerates(pod: PodShape, taint: dict[str, str]) -> bool:
    """Kubernetes' toleration rule for one taint (an empty key with Exists tolerates all)."""
    for t in pod.tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def matches(op: str, have: str | None, values: list[str]) -> bool:
    """Kubernetes' node selector operators on one label value (None: the node lacks it)."""
    number = have is not None and have.lstrip("-").isdigit()
    match op:
        case "In":
            return have in values
        case "NotIn":
            return have not in values
        case "Exists":
            return have is not None
        case "DoesNotExist":
            return have is None
        case "Gt":
            return number and int(str(have)) > int(values[0])
        case "Lt":
            return number and int(str(have)) < int(values[0])
    return False


def _expression(expression: dict[str, Any], node: Node) -> str | None:
    """Why ``node`` fails one matchExpression; None when it matches."""
    key, op = expression["key"], expression["operator"]
    values = [str(v) for v in expression.get("values") or ()]
    have = node.labels.get(key)
    if matches(op, have, values):
        return None
    shown = f"{key}={have}" if have is not None else f"no label {key}"
    needs = {"Gt": "above", "Lt": "below", "In": "one of", "NotIn": "none of"}.get(op, op)
    return f"{shown}, needs {needs} {', '.join(values)}".rstrip()


def affinity(pod: PodShape, node: Node) -> tuple[bool, str]:
    """Whether ``node`` matches the pod's nodeSelector and required node affinity, and why."""
    for key, value in pod.node_selector.items():
        if node.labels.get(key) != value:
            return False, f"node {node.name} lacks the nodeSelector label {key}={value}"
    if not pod.terms:
        return True, f"node {node.name}: the pod sets no node affinity"
    reasons = []
    for term in pod.terms:
        misses = [_expression(e, node) for e in term.get("matchExpressions") or ()]
        if not any(misses):
            keys = [e["key"] for e in term.get("matchExpressions") or ()]
            labels = ", ".join(f"{k}={node.labels[k]}" for k in keys if k in node.labels)
            return True, f"node {node.name} has {labels or 'what the term asks'}"
        reasons.append(next(m for m in misses if m))
    why = f"node {node.name}: " + "; or ".join(dict.fromkeys(reasons))
    if any(label in why for label in DRIVER_LABELS):
        why += f" (the GPU image's CUDA needs an R{GPU_DRIVER_MAJOR}+ NVIDIA driver)"
    return False, why


def taint_text(taint: dict[str, str]) -> str:
    """A taint as kubectl writes it: ``key=value:Effect``."""
    value = f"={taint['value']}" if taint.get("value") else ""
    return f"{taint.get('key')}{value}:{taint.get('effect')}"


def node_lines(pod: PodShape, node: Node) -> list[tuple[bool, str, str]]:
    """(fits, check, detail) of ``pod`` on ``node``, one per resource, affinity and taints."""
    lines = []
    for resource in RESOURCES:
        asked, have = pod.requests[resource], node.allocatable[resource]
        head = f"pod requests {show(resource, asked)}, node {node.name} has {show(resource, have)}"
        if have >= asked:
            spare = show(resource, have - asked)
            lines.append((True, resource, f"{head} allocatable: {spare} to spare"))
        else:
            short = show(resource, asked - have)
            lines.append((False, resource, f"{head} allocatable: short by {short}"))
    fits, why = affinity(pod, node)
    lines.append((fits, "node-affinity", why))
    blocking = [t for t in node.taints if t.get("effect") in ("NoSchedule", "NoExecute")]
    untolerated = [t for t in blocking if not tolerates(pod, t)]
    shown = ", ".join(taint_text(t) for t in untolerated or blocking)
    if untolerated:
        lines.append((False, "taints", f"node {node.name} has {shown}, untolerated"))
    elif blocking:
        lines.append((True, "taints", f"node {node.name} has {shown}, tolerated"))
    else:
        lines.append((True, "taints", f"node {node.name} has no NoSchedule taint"))
    return lines
