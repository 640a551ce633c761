"""The P/D hand-off: ``PDConnector`` (both sides) and the prefill side's leases."""
