"""The worker reporter: batches a rank's fragments and posts them in the background.

Never imports torch; a CUDA tensor passed to ``log()`` is handled through the torch
module the caller already imported.
"""

from steptally.client.reporter.errors import (
    FragmentError,
    IdentityError,
    ReporterClosed,
    ReporterError,
)
from steptally.client.reporter.options import ReporterOptions
from steptally.client.reporter.reporter import Reporter
from steptally.client.reporter.stats import Closed, Stats

__all__ = [
    "Closed",
    "FragmentError",
    "IdentityError",
    "Reporter",
    "ReporterClosed",
    "ReporterError",
    "ReporterOptions",
    "Stats",
]
