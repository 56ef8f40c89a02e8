"""The pipeline's exit handler: what a run holds on the Ray cluster set free when the run ends,
whether it succeeded, failed or was cancelled (``train.release``), and the run's scratch in the
store deleted: its session's folder and its Ray jobs' staging (``steps.handoff.remove_scratch``).

    release_step("calc", "0a1b2c3d-...", ray_address="10.0.0.5:6379", store_uri="s3://b/t")

An exit task receives no other task's output, only the run's parameters and the KFP run's id:
they name the session (``contract.session_name``), as prep named it from the same id.
"""

from __future__ import annotations

from trace_core.train.contract import check_gcs_address, session_name


def release_step(
    run_name: str,
    pipeline_run_id: str,
    ray_address: str = "",
    ray_jobs_url: str = "",
    store_uri: str = "",
) -> list[str]:
    """Stop the run's Ray jobs still running and kill its trainer and engine actors (a run
    that ended well holds none), then, with ``store_uri``, delete the session's folder and its
    jobs' staging there (a store that refuses is said, not raised: the actors are free
    already); one line per thing released or deleted, printed."""
    from trace_core.train.release import release_session
    from trace_core.train.steps.handoff import remove_scratch

    if not pipeline_run_id:
        raise ValueError("pipeline_run_id is empty: the session is named after the KFP run's id")
    check_gcs_address(ray_address, "ray_address")
    session = session_name(run_name, pipeline_run_id)
    released = release_session(session, ray_address, ray_jobs_url.rstrip("/"))
    if store_uri:
        released += remove_scratch(store_uri, session)
    return released
