"""The multi-node suite; a package so that its one cluster (``conftest.cluster``, scope
``package``) goes down after its last module, before the service suite starts its own."""
