"""The pipeline's steps as plain functions on folders: what each KFP component calls, what
``trace-rl step`` runs in an Argo container or a Ray job. Tested without KFP
(tests/train/test_steps.py).

    prep ─► warmstart | load ─► [ rollout ─► fit_predictor ─┐            ] × K ─► evaluate ─► report
                                         update ────────┴─► next rollout

- ``start``: prep, warmstart, load
- ``cycle``: rollout, fit_predictor, update (one training iteration)
- ``finish``: evaluate, report

The folders each step reads and writes, and the config they all receive, are the contract in
``train.contract``; running a step here, as a Ray job or from the command line is
``train.dispatch``.
"""
