"""Which fields of the parts' configs a deployment sets, and under which key.

Each setting is declared once, in the config of the part that uses it: the plain
dataclasses ``EngineConfig``, ``KVTierConfig``, ``KVConnectorConfig`` (``messages/``) and
``GatewayConfig`` (``gateway/config.py``) give its type, its default, its description (the
docstring under the field, as vLLM's config classes have) and its checks (``__post_init__``).
This table only says which of their fields a deployment sets, and under which key:

    part            key of field f            not settings (the app builder fills them)
    engine          f                         model, hash_seed, engine_id, publish_kv_events,
                                              tensor_parallel_size (one per role:
                                              prefill_/decode_tensor_parallel_size)
    kv tier         kv_tier_f
    kv connector    f (failure_policy:        role, host, port, secret, allow_insecure, tls
                    kv_failure_policy)
    gateway         f (num_replicas:          model, model_name, api_keys, admin_api_keys,
                    num_gateway_replicas)     tls_cert_file, tls_key_file

``PDServeConfig``'s fields, and so its YAML keys and CLI flags, are generated from it
(``settings_fields``), and a part's config is built back by the same names (``build``): a
field added to a part is a setting of every deployment, with its flag, at once.

Why flat keys from a table and not nested sub-models (``engine: {block_size: 32}``): the
keys users have are flat (``block_size``, ``kv_tier_cpu_bytes``, ``--num-kv-blocks``), and
several fields of a part are not settings at all (a connector's role and secret, an
engine's id, the gateway's model name): the builder fills them per worker, and a nested
model would offer them as keys.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from pdserve.gateway.config import GatewayConfig
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.kv_tier_config import KVTierConfig


@dataclass(frozen=True, slots=True)
class PartSettings:
    """The settings of one part: every field of ``config_class`` but ``filled_by_builder``."""

    name: str
    config_class: type
    filled_by_builder: frozenset[str] = frozenset()
    prefix: str = ""
    renamed: Mapping[str, str] = field(default_factory=dict)  # field -> key
    # Stand-ins for the builder-filled fields without a default, to check settings alone.
    placeholders: Mapping[str, Any] = field(default_factory=dict)
    # Builder-filled fields the settings' own checks depend on, read from the deployment's
    # key of the same name (the engine's model: what a simulated one refuses).
    checked_with: frozenset[str] = frozenset()

    def keys(self) -> dict[str, str]:
        """Deployment key -> the part's field, for every setting of this part."""
        return {
            self.renamed.get(f.name, self.prefix + f.name): f.name
            for f in dataclasses.fields(self.config_class)
            if f.name not in self.filled_by_builder
        }

    def build(self, settings: object, **filled: Any) -> Any:
        """This part's config: each setting read from ``settings`` by its key, plus the
        fields the builder fills (``filled``), and checked by the part's own rules."""
        unknown = set(filled) - self.filled_by_builder
        if unknown:
            raise TypeError(f"{sorted(unknown)} are {self.name} settings, not builder-filled")
        values = {name: getattr(settings, key) for key, name in self.keys().items()}
        return self.config_class(**values, **filled)

    def check(self, settings: object) -> None:
        """Raises the part's own error (its ``__post_init__``), naming the part, when
        ``settings`` hold a value it refuses."""
        try:
            same = {name: getattr(settings, name) for name in self.checked_with}
            self.build(settings, **self.placeholders, **same)
        except ValueError as error:
            raise ValueError(f"{self.name} settings: {error}") from None


ENGINE = PartSettings(
    "engine",
    EngineConfig,
    frozenset({"model", "hash_seed", "engine_id", "publish_kv_events", "tensor_parallel_size"}),
    checked_with=frozenset({"model"}),
)
KV_TIER = PartSettings("kv tier (kv_tier_*)", KVTierConfig, prefix="kv_tier_")
KV_CONNECTOR = PartSettings(
    "kv connector",
    KVConnectorConfig,
    frozenset({"role", "host", "port", "secret", "allow_insecure", "tls"}),
    renamed={"failure_policy": "kv_failure_policy"},
    placeholders={"role": "consumer"},
)
GATEWAY = PartSettings(
    "gateway",
    GatewayConfig,
    frozenset(
        {"model", "model_name", "api_keys", "admin_api_keys", "tls_cert_file", "tls_key_file"}
    ),
    renamed={"num_replicas": "num_gateway_replicas"},
    placeholders={"model": "", "model_name": ""},
)
PARTS = (ENGINE, KV_TIER, KV_CONNECTOR, GATEWAY)


def settings_fields() -> dict[str, tuple[Any, Any]]:
    """Every part's settings as pydantic field definitions (``create_model``'s form), keyed
    by deployment key: the part's type, default and docstring."""
    fields: dict[str, tuple[Any, Any]] = {}
    for part in PARTS:
        types = typing.get_type_hints(part.config_class)
        docs = attribute_docstrings(part.config_class)
        by_name = {f.name: f for f in dataclasses.fields(part.config_class)}
        for key, name in part.keys().items():
            if key in fields:
                raise TypeError(f"deployment key {key!r} names two parts' settings")
            declared = by_name[name]
            if declared.default is declared.default_factory is dataclasses.MISSING:
                raise TypeError(f"{part.name} setting {name!r} needs a default")
            if declared.default_factory is not dataclasses.MISSING:
                info = Field(default_factory=declared.default_factory, description=docs.get(name))
            else:
                info = Field(declared.default, description=docs.get(name))
            fields[key] = (types[name], info)
    return fields


def attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under it in ``cls``'s source, one line."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a frozen app): settings without help text
        return {}
    class_node = ast.parse(source).body[0]
    if not isinstance(class_node, ast.ClassDef):
        return {}
    docs = {}
    body = class_node.body
    for statement, after in zip(body, body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[statement.target.id] = " ".join(after.value.value.split())
    return docs
