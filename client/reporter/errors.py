"""Errors of the reporter.

Only programming errors raise, and they raise at once, on the calling thread; a
delivery problem never raises into training (it is logged and counted in
:meth:`Reporter.stats`).

    ReporterError            base of every error the reporter raises
    ├── IdentityError        rank or world size missing, invalid or contradictory
    ├── FragmentError        a log() or commit() call is malformed (unknown metric,
    │                        wrong shape, bool, a count that is not a non-negative integer)
    └── ReporterClosed       log() or commit() after close()
"""

from __future__ import annotations


class ReporterError(Exception):
    """Base of every error raised by :mod:`steptally.client.reporter`."""


class IdentityError(ReporterError, ValueError):
    """The rank or world size is missing, out of range, or contradicts another source."""


class FragmentError(ReporterError, ValueError):
    """A ``log()`` or ``commit()`` call is malformed; the message names the value."""


class ReporterClosed(ReporterError, RuntimeError):
    """The reporter was closed; create a new one to report more."""
