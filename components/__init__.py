"""One lightweight KFP component per pipeline step; each calls one ``trace_core.train.steps``
function (see components/README.md). Their images come from ``components.images``."""

from components.evaluate import evaluate
from components.fit_predictor import fit_predictor
from components.load_policy import load_policy
from components.prep import prep
from components.report import report
from components.rollout import rollout
from components.update_policy import update_policy
from components.warmstart import warmstart

__all__ = [
    "evaluate",
    "fit_predictor",
    "load_policy",
    "prep",
    "report",
    "rollout",
    "update_policy",
    "warmstart",
]
