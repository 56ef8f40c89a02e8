"""Release session: the exit handler's task; frees what the run holds on the Ray cluster and
deletes its scratch in the store (its session's folder, its Ray jobs' staging)."""

from kfp import dsl

from components.images import image


@dsl.component(base_image=image("TRACE_GPU_IMAGE"), install_kfp_package=False)
def release_session(
    run_name: str,
    ray_address: str,
    ray_jobs_url: str,
    store_uri: str,
    pipeline_run_id: str,
) -> str:
    """Stops the run's Ray jobs still running and kills its trainer and engine actors, found by
    the session name prep gave them (run_name and the KFP run's id: pass
    ``dsl.PIPELINE_JOB_ID_PLACEHOLDER``), and deletes the session's folder and its Ray jobs'
    staging under ``store_uri``; returns what it released and deleted, one line each."""
    from trace_core.rollout.ray_auth import step_errors
    from trace_core.train.contract import session_name
    from trace_core.train.steps.release import release_step

    print(f"session {session_name(run_name, pipeline_run_id)}")
    with step_errors():
        released = release_step(run_name, pipeline_run_id, ray_address, ray_jobs_url, store_uri)
    return "\n".join(released)
