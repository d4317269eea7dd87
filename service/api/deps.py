"""Dependencies of the routers, as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from steptally.service.auth.grant import Grant
from steptally.service.settings import Settings
from steptally.service.usecase.service import Service


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _grant(request: Request) -> Grant:
    """What the caller may register (set by the auth guard; anything when auth is off)."""
    grant: Grant = getattr(request.state, "grant", Grant.ANY)
    return grant


ServiceDep = Annotated[Service, Depends(_service)]
GrantDep = Annotated[Grant, Depends(_grant)]
SettingsDep = Annotated[Settings, Depends(_settings)]
