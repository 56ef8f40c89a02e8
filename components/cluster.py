"""The Kubeflow Pipelines releases TRACE deploys beside, and where each keeps its object store.

    DEFAULT_S3_ENDPOINT   # http://seaweedfs.kubeflow.svc.cluster.local:8333, on every release here
    DEFAULT_STORE_URI     # s3://mlpipeline/shared/trace-rl, writable with a profile's keys too

The kfp overlay (``manifests/overlays/kfp``), the pipeline's defaults and docs/deploy.md take the
store's address and the runs' S3 prefix from here. tests/manifests/test_kfp_store.py checks every
value against KFP's own manifests of each release, kept unchanged in tests/data/kfp/.

KFP 2.15 replaced MinIO by SeaweedFS; its Services changed again in 2.16:

- 2.15.0: the Service ``seaweedfs`` serves S3 on 8333 only; ``minio-service`` maps 9000 to the
  same pods' 8333. KFP's ``default-allow-same-namespace`` policy admits every pod of ``kubeflow``.
- 2.16.0: ``minio-service`` is gone; ``seaweedfs`` serves S3 on 8333 and on 9000; the
  same-namespace policy is gone and SeaweedFS's own policy admits pods of ``kubeflow`` on 8333.

So ``seaweedfs:8333`` is the one address both releases serve S3 on (``seaweedfs:9000`` is not
there in 2.15.0, ``minio-service:9000`` not in 2.16.0). In both, SeaweedFS's policy admits
profile namespaces on 8333 and ``istio-system``, no other namespace: the kfp overlay's
``seaweedfs-from-trace-rl`` adds the Ray pods of ``trace-rl``.

In multi-user KFP each profile's S3 keys (the Secret ``mlpipeline-minio-artifact`` in its
namespace) may get, put and list only under four prefixes of the bucket (KFP's profile
controller, ``sync.py``); ``shared/`` is the one that does not depend on the profile, and the
bucket's lifecycle rule expires only ``private-artifacts``. The default store URI is therefore
under ``shared/``, which every profile can read and write: a team that wants its runs private
uses ``s3://mlpipeline/private/<namespace>/trace-rl``.
"""

from __future__ import annotations

from dataclasses import dataclass

KFP_NAMESPACE = "kubeflow"
"""Where KFP runs its store (and, single-user, its pipeline steps)."""

KFP_BUCKET = "mlpipeline"
"""KFP's bucket, which its store creates at start."""


@dataclass(frozen=True)
class StoreWiring:
    """How the Ray pods and the pipeline's steps reach one KFP release's object store."""

    service: str
    """The Service in ``KFP_NAMESPACE`` whose port serves S3."""
    port: int
    """That Service's S3 port."""
    pod_port: int
    """The store container's S3 port, the one a NetworkPolicy names."""
    pod_labels: tuple[tuple[str, str], ...]
    """Labels every store pod carries, by which the kfp overlay's policy selects them."""
    profile_prefixes: tuple[str, ...]
    """The bucket's prefixes a profile's keys may write in multi-user mode (``{namespace}``: the
    profile's namespace)."""

    @property
    def endpoint(self) -> str:
        """The S3 endpoint, by the Service's cluster DNS name."""
        return f"http://{self.service}.{KFP_NAMESPACE}.svc.cluster.local:{self.port}"


SEAWEEDFS = StoreWiring(
    service="seaweedfs",
    port=8333,
    pod_port=8333,
    pod_labels=(("app", "seaweedfs"),),
    profile_prefixes=(
        "artifacts/",
        "private-artifacts/{namespace}/",
        "private/{namespace}/",
        "shared/",
    ),
)
"""KFP's SeaweedFS as 2.15.0 and 2.16.0 both deploy it."""

KFP_VERSIONS: dict[str, StoreWiring] = {"2.15.0": SEAWEEDFS, "2.16.0": SEAWEEDFS}
"""Every KFP release the kfp overlay and the pipeline's defaults are checked against."""

DEFAULT_S3_ENDPOINT = SEAWEEDFS.endpoint
"""The store's S3 endpoint on every release of ``KFP_VERSIONS``."""

DEFAULT_STORE_URI = f"s3://{KFP_BUCKET}/shared/trace-rl"
"""Where runs keep checkpoints and trees by default: writable with KFP's admin keys and, in
multi-user mode, with any profile's."""
