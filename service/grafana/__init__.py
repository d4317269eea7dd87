"""Grafana dashboards as code, built with ``grafana-foundation-sdk``.

``steptally grafana build`` writes one JSON file per dashboard into
``deploy/grafana/dashboards/``, where Grafana's file provider (provisioned from
``deploy/grafana/provisioning/``) loads them; ``--check`` fails when a committed file
differs from a fresh build.

* :mod:`.datasource` — the two provisioned datasources (fixed uids) and the raw-SQL
  query the SDK does not ship;
* :mod:`.variable` — the ``run`` and ``metric`` template variables;
* :mod:`.prometheus_panel` — time-series and stat panels over Prometheus;
* :mod:`.run_diagnostics` — per-step values of a run from PostgreSQL;
* :mod:`.live` — latest values and progress from Prometheus;
* :mod:`.service_health` — requests, ingest and finalisation from Prometheus;
* :mod:`.build` — rendering, writing and checking the JSON.
"""
