"""Errors of the loss package.

::

    LossError
    ├── ConfigError   an invalid setting or combination of settings (raised at construction)
    └── InputError    inputs whose shapes or presence do not fit the configuration

Both also derive from :class:`ValueError`. Only host-side facts (settings, shapes, which
optional inputs are present) are checked: checking values would need a device sync.
"""

from __future__ import annotations


class LossError(Exception):
    """Base of every error the loss package raises."""


class ConfigError(LossError, ValueError):
    """An invalid setting or combination of settings."""


class InputError(LossError, ValueError):
    """Inputs whose shapes or presence do not fit the configuration."""
