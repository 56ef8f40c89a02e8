"""One lightweight KFP component per pipeline step; each calls one ``trace_core.train.steps``
function (see components/README.md). Their images come from ``components.images``."""

from components.close_session import close_session
from components.iterate import iterate
from components.load import load
from components.open_session import open_session
from components.prep import prep
from components.release_session import release_session
from components.report import report
from components.schedule import schedule
from components.warmstart import warmstart

__all__ = [
    "close_session",
    "iterate",
    "load",
    "open_session",
    "prep",
    "release_session",
    "report",
    "schedule",
    "warmstart",
]
