"""The sampling defaults a model ships in its folder's ``generation_config.json``, applied to
the fields a request leaves out, as vLLM's ``--generation-config auto`` does: Qwen2.5's
``repetition_penalty`` 1.05 and ``temperature`` 0.7, Llama 3's ``top_p`` 0.9. Without them
pdserve's answers on such a model are not vLLM's.

    generation_config.json   {"temperature": 0.7, "top_p": 0.8, "top_k": 20, ...}
    a request                {"temperature": 0.2}            (no top_p, no top_k)
    sampled with             temperature 0.2, top_p 0.8, top_k 20

Only these keys are read (vLLM's list, less ``max_new_tokens``); a value the API would
refuse is dropped with a warning, never a start that fails. A GGUF and ``tiny`` carry none.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pdserve.checkpoint.model_source import resolve_model
from pdserve.messages.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model: str) -> dict[str, Any]:
    """The defaults ``model``'s folder gives (empty: none, or not a folder)."""
    source = resolve_model(model).stand_in
    if source.kind != "hf_dir":
        return {}
    path = Path(source.file_path()) / "generation_config.json"
    if not path.is_file():
        return {}
    shipped = json.loads(path.read_text())
    defaults: dict[str, Any] = {}
    for name in DEFAULTED_FIELDS:
        value = shipped.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or (name == "top_k" and value == -1):  # -1: no top-k
            continue
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError) as error:
            logger.warning("%s: %s=%r is not used as a default: %s", path, name, value, error)
            continue
        defaults[name] = value
    if defaults:
        logger.info("sampling defaults from %s: %s", path, defaults)
    return defaults
