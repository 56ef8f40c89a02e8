"""``python -m trace_core.cli`` is ``trace-rl``."""

from trace_core.cli import app

app()
