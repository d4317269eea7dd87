"""The provisioned datasources the dashboards read, and a raw-SQL query target.

The uids are fixed here and in ``deploy/grafana/provisioning/datasources/``, so
the dashboards reference a datasource without looking it up. The SDK ships no
query builder for Grafana's PostgreSQL datasource; :class:`SqlQuery` is that
target: raw SQL in code mode, as a table or as a time series.
"""

from __future__ import annotations

from typing import Literal

from grafana_foundation_sdk.cog import builder, variants
from grafana_foundation_sdk.models.dashboard import DataSourceRef

PROMETHEUS_UID = "steptally-prometheus"
POSTGRES_UID = "steptally-postgres"
PROMETHEUS = DataSourceRef(type_val="prometheus", uid=PROMETHEUS_UID)
POSTGRES = DataSourceRef(type_val="grafana-postgresql-datasource", uid=POSTGRES_UID)

SqlFormat = Literal["table", "time_series"]


class SqlQueryModel(variants.Dataquery):
    """A PostgreSQL panel target: ``rawSql`` with its result format."""

    def __init__(self, ref_id: str, raw_sql: str, format_val: SqlFormat) -> None:
        self.ref_id = ref_id
        self.raw_sql = raw_sql
        self.format_val = format_val

    def to_json(self) -> dict[str, object]:
        return {
            "refId": self.ref_id,
            "datasource": POSTGRES.to_json(),
            "rawSql": self.raw_sql,
            "format": self.format_val,
            "rawQuery": True,
            "editorMode": "code",
        }


class SqlQuery(builder.Builder[variants.Dataquery]):
    """Builds a :class:`SqlQueryModel`; a table unless told ``time_series``."""

    def __init__(self, raw_sql: str, ref_id: str = "A") -> None:
        self._raw_sql = raw_sql
        self._ref_id = ref_id
        self._format: SqlFormat = "table"

    def format(self, format_val: SqlFormat) -> SqlQuery:
        self._format = format_val
        return self

    def build(self) -> variants.Dataquery:
        return SqlQueryModel(self._ref_id, self._raw_sql, self._format)
