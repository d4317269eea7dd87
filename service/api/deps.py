"""Dependencies of the routers, as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from steptally.service.settings import Settings
from steptally.service.usecase.service import Service


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


ServiceDep = Annotated[Service, Depends(_service)]
SettingsDep = Annotated[Settings, Depends(_settings)]
