"""The pipeline's exit handler: what a run holds on the Ray cluster set free when the run ends,
whether it succeeded, failed or was cancelled (``train.release``).

    release_step("calc", "0a1b2c3d-...", ray_address="10.0.0.5:6379")

An exit task receives no other task's output, only the run's parameters and the KFP run's id:
they name the session (``contract.session_name``), as prep named it from the same id.
"""

from __future__ import annotations

from trace_core.train.contract import check_gcs_address, session_name


def release_step(
    run_name: str, pipeline_run_id: str, ray_address: str = "", ray_jobs_url: str = ""
) -> list[str]:
    """Stop the run's Ray jobs still running and kill its trainer and engine actors (a run
    that ended well holds none); one line per thing released, printed."""
    from trace_core.train.release import release_session

    if not pipeline_run_id:
        raise ValueError("pipeline_run_id is empty: the session is named after the KFP run's id")
    check_gcs_address(ray_address, "ray_address")
    session = session_name(run_name, pipeline_run_id)
    return release_session(session, ray_address, ray_jobs_url.rstrip("/"))
