"""NetworkPolicies evaluated as the Kubernetes API defines them (networking.k8s.io/v1), for the
manifest checks (tests/manifests/test_kfp_store.py, test_retriever.py).

A pod that no Ingress policy selects admits every connection; one that some select admits a
connection any of their rules allows. A rule allows a source when one of its peers matches (a
peer's podSelector alone means the policy's own namespace; namespaceSelector with podSelector in
one peer must both match) on one of its ports (none: every port). Egress is the mirror image:
``sends`` asks whether the source's own Egress policies let it open the connection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Manifest = dict[str, Any]
Endpoint = tuple[str, Mapping[str, str], Mapping[str, str]]
"""A pod: its namespace, the namespace's labels, the pod's labels."""


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) against labels; {} selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        match operator:
            case "In":
                ok = key in labels and labels[key] in values
            case "NotIn":
                ok = key not in labels or labels[key] not in values
            case "Exists":
                ok = key in labels
            case "DoesNotExist":
                ok = key not in labels
            case _:
                raise AssertionError(f"unknown operator {operator}")
        if not ok:
            return False
    return True


def namespace_labels(name: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name, **(extra or {})}


def admits(
    policies: list[Manifest],
    target: tuple[str, Mapping[str, str], int],
    source: tuple[str, Mapping[str, str], Mapping[str, str]],
) -> bool:
    """Whether ``policies`` let ``source`` (namespace, its labels, pod labels) reach ``target``
    (namespace, pod labels, container port) over TCP."""
    target_ns, target_labels, port = target
    return _allowed(policies, "Ingress", (target_ns, target_labels), source, port)


def sends(policies: list[Manifest], source: Endpoint, target: Endpoint, port: int) -> bool:
    """Whether the Egress policies of ``source``'s namespace let it reach ``target`` on TCP
    ``port`` (the pod's port: policies see connections after a Service's address is resolved)."""
    source_ns, _, source_labels = source
    return _allowed(policies, "Egress", (source_ns, source_labels), target, port)


def _allowed(
    policies: list[Manifest],
    kind: str,
    pod: tuple[str, Mapping[str, str]],
    peer_pod: Endpoint,
    port: int,
) -> bool:
    """Whether the ``kind`` (Ingress or Egress) policies selecting ``pod`` (namespace, labels)
    allow a TCP connection on ``port`` with ``peer_pod``."""
    namespace, labels = pod
    peer_ns, peer_ns_labels, peer_labels = peer_pod
    rules, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == namespace
        and kind in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get(rules) or []:
            ports = rule.get("ports")
            if ports and not any(
                p.get("protocol", "TCP") == "TCP" and p.get("port") in (None, port) for p in ports
            ):
                continue
            peers = rule.get(peers_key)
            if not peers:
                return True
            for peer in peers:
                if "ipBlock" in peer:
                    continue
                if "namespaceSelector" in peer:
                    ns_ok = selects(peer["namespaceSelector"], peer_ns_labels)
                else:
                    ns_ok = peer_ns == namespace
                if ns_ok and selects(peer.get("podSelector"), peer_labels):
                    return True
    return False
