"""What ``pdserve up`` checks before it deploys: a config that cannot start fails at once,
with the fix named, instead of Serve restarting replicas that fail in their constructors
until the deploy gives up.

    settings         each field's type and range, each part's own checks (``PDServeConfig``:
                     ``validation_problems`` words pydantic's errors as flags)
    nixl transport   the nixl package imports here (the workers need it)
    model            what a worker's load would refuse, by the loader's and the engine's
                     own checks run without the weights: the name or path (nothing is
                     downloaded), the architecture, a GGUF's architecture and tensor types,
                     the tokenizer, packed weights the device cannot run, the split over
                     each role's tensor-parallel degree, a draft model's vocabulary and KV
                     groups, each LoRA adapter of --lora-modules (its files, rank, targets),
                     and (an embedded cluster) whether the workers' weights and KV pools fit
                     this machine's memory
    ports            nothing listens on the HTTP, gRPC and KV transfer ports (an embedded
                     cluster runs on this machine; a joined cluster's ports are elsewhere)

Each problem names the flag (a ``--config`` file's key of the same name) and what it
accepts. ``pdserve scale`` runs the same checks but the ports (the running app holds them).
"""

from __future__ import annotations

import importlib
import os
import socket
from typing import TYPE_CHECKING, Literal

from pydantic import ValidationError

from pdserve.deploy.config import PDServeConfig

if TYPE_CHECKING:
    from pdserve.messages.engine_config import EngineConfig
    from pdserve.model.model_config import ModelConfig


def validation_problems(error: ValidationError) -> list[str]:
    """pydantic's errors about a config, one line each, naming the flag, the value given
    and what the field accepts (instead of a traceback)."""
    problems = []
    for entry in error.errors():
        message = entry["msg"].removeprefix("Value error, ")
        if entry["loc"]:  # a field's own check
            flag = "--" + str(entry["loc"][0]).replace("_", "-")
            problems.append(f"{flag} {entry['input']!r}: {message}")
        else:  # a check across fields: its message names them
            problems.append(message)
    return problems


def preflight_problems(config: PDServeConfig, check_ports: bool = True) -> list[str]:
    """Every reason ``config`` cannot start on this machine, each naming its fix.
    ``check_ports``: False for a running app, whose own servers hold them."""
    problems = []
    if config.transport == "nixl" and not config.colocated:
        try:
            importlib.import_module("nixl._api")
        except ImportError as error:
            problems.append(
                f"--transport nixl needs the nixl package, which does not import "
                f"here ({error}): pip install 'pdserve[nixl]', or use "
                f"--transport grpc"
            )
    problems += _model_problems(config)
    if check_ports and not config.ray_address:
        problems += [
            f"{what} {host}:{port} is in use: stop what listens there, or choose "
            f"another with {flag}"
            for what, host, port, flag in _ports(config)
            if not _is_free(host, port)
        ]
    return problems


def _model_problems(config: PDServeConfig) -> list[str]:
    """What a worker would refuse about its model, its split and its draft: the checks its
    load runs, on the engine config each worker gets, without reading a weight.

    Imported here, not at the top: they load torch, which only ``up`` and ``scale`` need
    (``pdserve stats`` imports this module too)."""
    from pdserve.engine.spec_decode import check_draft_model
    from pdserve.model.loader import check_model, check_tensor_parallel, tensor_parallel_sizes

    try:  # worker_spec needs the app's seed and secret
        resolved = config.resolve_deployment_secrets()
    except ValueError as error:  # a secret or key from the environment: its message names it
        return [str(error)]
    roles: list[tuple[Literal["producer", "consumer"], str]] = [
        ("producer", "--prefill-tensor-parallel-size")
    ]
    if not config.colocated:
        roles.append(("consumer", "--decode-tensor-parallel-size"))
    try:
        engine = resolved.worker_spec("producer", 0).engine
    except ValueError as error:  # the prefill role's engine, by its own rules
        return [f"--prefill-tensor-parallel-size: {error}"]
    try:
        model = check_model(engine.model, engine.dtype, engine.quantization, engine.device)
    except (OSError, ValueError) as error:
        return [f"--model {engine.model!r}: {error}"]
    problems = []
    for role, flag in roles:
        try:  # the role's engine, checked by its own rules (a simulated model is not split)
            degree = resolved.worker_spec(role, 0).engine.tensor_parallel_size
        except ValueError as error:
            problems.append(f"{flag}: {error}")
            continue
        try:
            check_tensor_parallel(model, degree)
        except ValueError as error:
            sizes = ", ".join(str(size) for size in tensor_parallel_sizes(model))
            problems.append(f"{flag} {degree}: {error}; supported for this model: {sizes}")
    problems += _lora_problems(engine, model)
    if not config.ray_address:  # an embedded cluster: every worker runs on this machine
        problems += _memory_problems(resolved, model)
    if engine.speculative_model is not None:
        try:
            draft = check_model(
                engine.speculative_model, engine.dtype, engine.quantization, engine.device
            )
            check_draft_model(engine, draft, model)
        except (OSError, ValueError) as error:
            problems.append(f"--speculative-model {engine.speculative_model!r}: {error}")
    return problems


def _lora_problems(engine: EngineConfig, model: ModelConfig) -> list[str]:
    """Each adapter of ``lora_modules`` a worker would refuse (unreadable files, a rank above
    ``max_lora_rank``, a target the model lacks): read against the model built on the meta
    device, no weight loaded."""
    if not engine.lora_modules:
        return []
    import torch

    from pdserve.model.architectures import build_model
    from pdserve.model.lora.peft_adapter import LoRAAdapter

    with torch.device("meta"):
        skeleton = build_model(model)
    problems = []
    for name, path in engine.lora_modules.items():
        try:
            LoRAAdapter.load(name, path, skeleton, engine.max_lora_rank)
        except ValueError as error:
            problems.append(f"--lora-modules {name}={path}: {error}")
    return problems


def _memory_problems(config: PDServeConfig, model: ModelConfig) -> list[str]:
    """A model whose workers' weights and KV pools exceed this machine's memory: loaded, it
    would be killed inside a Ray worker (``model/memory_estimate.py``)."""
    import torch

    from pdserve.cache.kv_cache_spec import KVCacheConfig
    from pdserve.engine.kv_cache_groups import kv_cache_groups
    from pdserve.model.architectures import build_model
    from pdserve.model.memory_estimate import kv_pool_bytes, weights_bytes

    engine = config.worker_spec("producer", 0).engine
    with torch.device("meta"):
        packable = build_model(model).packable_weights()
    weights = weights_bytes(engine, model, packable)
    block_bytes = KVCacheConfig(2, kv_cache_groups(model, engine)).bytes_per_block
    kv_pool = kv_pool_bytes(engine, block_bytes)
    workers = config.num_prefill + (0 if config.colocated else config.num_decode)
    needed = workers * (weights + kv_pool)
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed <= machine:
        return []
    return [
        f"--model {engine.model!r}: {workers} workers need {needed / 2**30:.1f} GiB "
        f"(each: weights {weights / 2**30:.2f} GiB as --quantization {engine.quantization} "
        f"runs them in {engine.dtype}, plus a KV pool of {kv_pool / 2**30:.2f} GiB), and this "
        f"machine has {machine / 2**30:.1f} GiB: keep the weights packed (--quantization "
        "auto for a quantized GGUF, int8 for float weights), fewer workers, or a smaller "
        "--kv-cache-memory-bytes"
    ]


def _ports(config: PDServeConfig) -> list[tuple[str, str, int, str]]:
    """(what, host, port, flag) of each fixed port the app will listen on."""
    ports = [("the HTTP port", config.host, config.port, "--port")]
    if config.grpc_port:
        ports.append(("the gRPC port", config.host, config.grpc_port, "--grpc-port"))
    if config.kv_transfer_port and not config.colocated:
        host = config.kv_transfer_host or "127.0.0.1"
        ports += [
            (
                f"prefill-{i}'s KV transfer port",
                host,
                config.kv_transfer_port + i,
                "--kv-transfer-port",
            )
            for i in range(config.num_prefill)
        ]
    return [entry for entry in ports if entry[2]]


def _is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now. The probe binds the way the
    servers do (uvicorn and gRPC set ``SO_REUSEADDR``): a port whose last server stopped a
    moment ago still has its connections in TIME_WAIT, which refuses a plain bind for about
    a minute but not a server's; a port something listens on refuses both."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
