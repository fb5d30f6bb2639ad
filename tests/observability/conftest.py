"""A real Prometheus scraping real components (local processes), for the observability
tests: the chart's dashboard and rules are checked through Prometheus's HTTP API."""

from __future__ import annotations

import pytest

from asyncgrpo.testing import prometheus

needs_prometheus = pytest.mark.skipif(not prometheus.available(),
                                      reason="Debian package prometheus not installed")
