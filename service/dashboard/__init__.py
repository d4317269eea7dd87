"""The built-in dashboard: HTML pages over the public REST API and the event stream.

* ``router`` — ``GET /`` (the runs list) and ``GET /runs/{run}`` (one run's charts,
  completeness heat map and step detail; a 404 page for an unknown run);
* ``assets`` — the page files and the vendored uPlot, served with ``Cache-Control``;
* ``page`` — fills the HTML templates.

The pages read everything through ``/v1/...`` from the browser; the Python side only
serves files and says whether a run exists.
"""
