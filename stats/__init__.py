"""Statistics, defined once: the registry every view is derived from, and latency helpers.

``/stats`` (JSON), ``/metrics`` (Prometheus) and ``pdserve stats`` (a table) all read the
registry in ``registry.py``; no view lists the statistics again. Imports nothing of ours.
"""
