"""The pipeline's steps as plain functions on folders: what each KFP component calls, what
``trace-rl step`` runs in an Argo container or a Ray job. Tested without KFP
(tests/train/test_steps.py, tests/train/test_session.py).

    prep ─► warmstart | load ─► open-session ─► iterate × K ─► close-session ─► report

- ``start``: prep (the prompts, the run's config, where it starts), warmstart, load (a base
  model or the run's newest checkpoint)
- ``session``: open-session (the run's trainer and engine actors), iterate (rollout, predictor
  fit ∥ update, weights to the engines, evaluation), close-session (the last checkpoint)
- ``finish``: report (every iteration's trees, the summary)
- ``release``: the exit handler's (whatever the run ended with): its Ray jobs still running
  stopped, its trainer and engine actors killed (``train.release``)

The folders each step reads and writes, and the config they all receive, are the contract in
``train.contract``; running a step here, as a Ray job or from the command line is
``train.dispatch``.
"""
