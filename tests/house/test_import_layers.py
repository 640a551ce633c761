"""The house's import rules, checked where the rules bite: in a fresh interpreter.

``lint-imports`` (run by ``make test``) checks the static graph against the contracts in
pyproject.toml; this checks what importing the gateway really loads, dynamic imports included.
"""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_loaded_by(module: str) -> list[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(m for m in sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_the_gateway_app_loads_no_torch_and_no_engine_or_connector():
    loaded = _modules_loaded_by("pdserve.gateway.http_ingress")
    assert "pdserve.gateway.http_ingress" in loaded  # the import did happen
    assert "torch" not in loaded
    leaked = [
        m
        for m in loaded
        if m.startswith(
            ("pdserve.engine", "pdserve.kvconnector", "pdserve.decode", "pdserve.prefill.worker")
        )
    ]
    assert leaked == []


def test_the_worker_side_does_load_torch():
    """The check above can fail: the same probe sees torch where it is imported."""
    assert "torch" in _modules_loaded_by("pdserve.prefill.worker")
