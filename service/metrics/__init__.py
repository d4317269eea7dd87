"""All that ``/metrics`` shows: the service's own instruments, the run values, one registry.

* :mod:`.instruments` — counters and histograms of requests, ingest and finalisation;
* :mod:`.run_values` — the collector of every run's latest values, read per scrape;
* :mod:`.registry` — :func:`~.registry.build_registry` puts both on a fresh registry,
  and :func:`~.registry.expose` encodes it as the Prometheus text format.
"""
