"""Loading a model: the built-in ``tiny``, a local Hugging Face directory, or a GGUF file
(a ``.gguf`` path or a built-in name such as ``smollm2``; see ``gguf_loader.py``).

A directory needs ``config.json``, its weights as ``*.safetensors`` (sharded with
``model.safetensors.index.json``, or any number of files found by globbing) and
``tokenizer.json``; ``generation_config.json`` is read for end-of-sequence ids when
present. Nothing is ever downloaded: a name that is not built in and not a local
directory or ``.gguf`` file is an error.

The model is built on the ``meta`` device and the checkpoint tensors are assigned
into it, so a large model is never initialised with random weights first.
``check_model`` and ``check_tensor_parallel`` run the same steps short of the weights, so
``pdserve up`` refuses what a worker would refuse before it deploys one.
"""

from __future__ import annotations

import json
from collections.abc import Set
from pathlib import Path
from typing import cast

import gguf
import torch
from safetensors import safe_open
from torch import nn

from pdserve.checkpoint.gguf_file import gguf_metadata, open_gguf
from pdserve.checkpoint.model_source import ModelSource, hf_eos_token_ids, resolve_model
from pdserve.checkpoint.weights_digest import parameters_digest, weights_digest
from pdserve.messages.engine_config import Quantization
from pdserve.model.architectures import CausalLM, build_model
from pdserve.model.gguf_loader import (
    check_gguf_tensors,
    gguf_has_output_head,
    gguf_quantized_types,
    gguf_state_dict,
)
from pdserve.model.model_config import DTYPES, ModelConfig, resolve_device, resolve_dtype
from pdserve.model.quantization import QuantizedWeight, int8_weight
from pdserve.model.quantization.checkpoint_format import (
    CheckpointQuantization,
    checkpoint_quantization,
)
from pdserve.model.quantization.quantized_weight import attach_packed_weight
from pdserve.model.sim_model import SimulatedCausalLM, placeholder_config
from pdserve.model.tensor_parallel import TensorParallel
from pdserve.model.tiny_model import build_tiny_model, tiny_model_config
from pdserve.stats.start_phases import start_phase
from pdserve.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from pdserve.tokenizer.loading import load_tokenizer
from pdserve.tokenizer.tokenizer import Tokenizer

# Checkpoint entries that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The packed formats a CUDA worker runs (``model/quantization/packed_matmul_triton.py``).
CUDA_SCHEMES = frozenset({"AWQ", "GPTQ", "fp8"})


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    quantization: Quantization = "none",
    sim_time_scale: float = 1.0,
) -> tuple[CausalLM, ModelConfig, Tokenizer]:
    """``(model, model_config, tokenizer)`` for any ``--model`` value; model in eval mode.
    ``quantization`` (``EngineConfig.quantization``): ``auto`` keeps a GGUF's quantized
    tensors and an AWQ or GPTQ folder's linears packed (``model/quantization/``), ``int8``
    also packs every float linear weight, ``none`` dequantizes. ``sim_time_scale``: a
    simulated model's clock (``EngineConfig.sim_time_scale``)."""
    torch_dtype = resolve_dtype(dtype)
    source = resolve_model(name_or_path)
    if source.profile is not None:  # simulated: no weights (model/sim_model.py)
        real = check_model(source.profile.stands_for)
        simulated = SimulatedCausalLM(source.profile, real, sim_time_scale)
        # What a runner asks of a model (forward, compute_logits), the simulated one answers.
        stand_in = cast(CausalLM, simulated)
        return stand_in, placeholder_config(real, source.profile), load_tokenizer(source)
    if source.kind == "tiny":
        config = tiny_model_config()
        config.dtype = _dtype_name(torch_dtype)
        model = build_tiny_model(torch_dtype, device)
        config.weights_digest = parameters_digest(model)
        if quantization == "int8":
            model = _repacked_int8(model, config, device)
        return model, config, load_tokenizer(source)
    if source.kind == "gguf":
        return load_gguf_model(source, torch_dtype, device, quantization)
    config = load_model_config(source.file_path())
    config.dtype = _dtype_name(torch_dtype)
    with start_phase("weights"):
        config.weights_digest = weights_digest(_weight_files(source.file_path()))
    model = load_weights(config, source.file_path(), torch_dtype, device, quantization)
    return model, config, load_tokenizer(source)


def load_gguf_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: str | torch.device,
    quantization: Quantization = "none",
    sim_time_scale: float = 1.0,
) -> tuple[CausalLM, ModelConfig, Tokenizer]:
    """One pass over the file: its metadata gives the config and the tokenizer, its tensors
    the weights."""
    reader = open_gguf(source.file_path())
    config, tokenizer = _gguf_config_and_tokenizer(reader)
    config.dtype = _dtype_name(dtype)
    model = _build_on_meta(config)
    keep_packed = model.packable_weights() if quantization != "none" else set()
    with start_phase("weights"):
        config.weights_digest = weights_digest([source.file_path()])
        state, packed = gguf_state_dict(config, reader, dtype, device, keep_packed)
    if quantization == "int8":
        packed |= _int8_weights(state, keep_packed)
    origin = f"the tensors of {source.path}"
    return fill_weights(model, config, state, packed, device, origin), config, tokenizer


def check_packed_device(schemes: Set[str], device: str | torch.device) -> None:
    """Refuses packed weights on a device whose kernels are not built, naming the formats
    and what would serve: GGUF's types and int8 run on CPU only; AWQ, GPTQ and fp8
    checkpoints on CPU (fp8: dequantized) and on CUDA (``packed_matmul_triton.py``)."""
    kind = torch.device(device).type
    refused = schemes - CUDA_SCHEMES if kind == "cuda" else schemes if kind != "cpu" else set()
    if refused:
        raise ValueError(
            f"weights packed as {'+'.join(sorted(refused))} run on CPU only, not on {kind} "
            f"(on CUDA: {', '.join(sorted(CUDA_SCHEMES))} checkpoints): use --quantization "
            "none (weights dequantized to the dtype) or --device cpu"
        )


def _gguf_config_and_tokenizer(reader: gguf.GGUFReader) -> tuple[ModelConfig, Tokenizer]:
    """The config and the tokenizer a GGUF's metadata describes (every end id the tokenizer
    declares stops generation), refused where the architecture or the tokenizer is not
    supported."""
    metadata = gguf_metadata(reader)
    config = ModelConfig.from_gguf_metadata(
        metadata, tie_word_embeddings=not gguf_has_output_head(reader)
    )
    tokenizer = tokenizer_from_gguf(metadata)
    config.eos_token_ids = list(tokenizer.eos_token_ids)
    return config, tokenizer


def check_model(
    name_or_path: str,
    dtype: str | torch.dtype = "float32",
    quantization: Quantization = "none",
    device: str = "auto",
) -> ModelConfig:
    """The shape of the model ``load_model`` would load, refused where the load would refuse
    it, without reading a weight; its ``quantization`` names the formats the load would
    pack, refused on a ``device`` (unless ``auto``) that cannot run them.

    ``pdserve up`` runs it before it deploys (``deploy/preflight.py``): a model a worker
    cannot load used to fail only inside the deployed worker, after Serve's retries. It runs
    the load's own steps short of the weights: the dtype, the source, the config
    (architecture, RoPE, heads), the tokenizer, a GGUF's tensor types and names, a
    directory's weight files and quantized format (``quantization_config``: one the
    ``auto`` load would refuse, fp8, is refused here), and the architecture built on the
    ``meta`` device.
    """
    resolve_dtype(dtype)
    source = resolve_model(name_or_path)
    if source.profile is not None:  # simulated: the real model's shape, placeholder pages
        return placeholder_config(check_model(source.profile.stands_for), source.profile)
    gguf_types: dict[str, str] = {}  # a GGUF's quantized tensors: our name -> type
    schemes: set[str] = set()  # the formats the load packs
    if source.kind == "tiny":
        config = tiny_model_config()
    elif source.kind == "gguf":
        reader = open_gguf(source.file_path())
        config, _ = _gguf_config_and_tokenizer(reader)
        check_gguf_tensors(reader)
        gguf_types = gguf_quantized_types(reader)
    else:
        config = load_model_config(source.file_path())
        _weight_files(source.file_path())
        load_tokenizer(source)
        stored = checkpoint_quantization(source.file_path())
        if stored is not None and quantization != "none":
            kind = torch.device(resolve_device(device)).type
            if stored.runs_packed_on(kind):
                schemes.add(stored.scheme)
            elif quantization == "auto":
                raise ValueError(stored.refusal(kind))
    packable = _build_on_meta(config).packable_weights()
    if quantization != "none":
        schemes |= {scheme for name, scheme in gguf_types.items() if name in packable}
    if quantization == "int8" and packable - gguf_types.keys():
        schemes.add("int8")
    if device != "auto":
        check_packed_device(schemes, device)
    config.quantization = "+".join(sorted(schemes)) or "none"
    return config


def check_tensor_parallel(config: ModelConfig, tensor_parallel_size: int) -> None:
    """Refuses a split over ``tensor_parallel_size`` ranks that the model's heads, features
    or layers do not allow: the model's own ``shard``, run on the ``meta`` device (no
    memory, no weights) as rank 0, whose split is refused as every rank's is."""
    if tensor_parallel_size == 1:  # an unsplit model is not sharded at all
        return
    if set(config.quantization.split("+")) - {"none", "int8"}:
        # A row-parallel rank's inputs (its heads' features, its intermediate features) must
        # be whole groups of 32 of the int4 planes (QuantizedWeight.take_columns).
        for what, width in (
            ("attention features", config.num_heads // tensor_parallel_size * config.head_dim),
            ("intermediate features", config.intermediate_size // tensor_parallel_size),
        ):
            if width % 32:
                raise ValueError(
                    f"weights packed as {config.quantization} split only at multiples of 32 "
                    f"inputs, and a rank of {tensor_parallel_size} would hold {width} {what}: "
                    "run it with --quantization none, or at another tensor parallel size"
                )
    with torch.device("meta"):
        model = build_model(config)
    model.shard(TensorParallel.layout_only(tensor_parallel_size))


def tensor_parallel_sizes(config: ModelConfig) -> list[int]:
    """Every degree ``check_tensor_parallel`` accepts for ``config``: among the divisors of
    its query heads (each rank holds a whole number of them), those the rest allows."""
    sizes = []
    for size in range(1, config.num_heads + 1):
        if config.num_heads % size:
            continue
        try:
            check_tensor_parallel(config, size)
        except ValueError:
            continue
        sizes.append(size)
    return sizes


def load_model_config(directory: str | Path) -> ModelConfig:
    """Parse ``config.json``, taking end-of-sequence ids from ``generation_config.json`` when it has them."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{directory} has no config.json; expected a Hugging Face model directory"
        )
    config = ModelConfig.from_hf_config(json.loads(config_path.read_text()))
    config.eos_token_ids = hf_eos_token_ids(directory)
    return config


def load_weights(
    config: ModelConfig,
    directory: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    quantization: Quantization = "none",
) -> CausalLM:
    """Build ``config``'s architecture and fill it from the directory's safetensors."""
    directory = Path(directory)
    stored = checkpoint_quantization(directory)
    model = _build_on_meta(config)
    state: dict[str, torch.Tensor] = {}
    with start_phase("weights"):
        for shard in _weight_files(directory):
            with safe_open(str(shard), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (stored and stored.read_past(name)):
                        continue
                    tensor = reader.get_tensor(name)
                    state[name] = tensor if stored else tensor.to(device=device, dtype=dtype)
        packed: dict[str, QuantizedWeight] = {}
        if stored is not None:
            packable = model.packable_weights()
            packed = _stored_linears(stored, state, packable, quantization, torch.device(device))
            for name in list(state):  # one at a time: the stored and cast copies never all coexist
                state[name] = state[name].to(device=device, dtype=dtype)
    if quantization == "int8":
        packed |= _int8_weights(state, model.packable_weights())
    return fill_weights(model, config, state, packed, device, f"the weights in {directory}")


def _stored_linears(
    stored: CheckpointQuantization,
    state: dict[str, torch.Tensor],
    packable: Set[str],
    quantization: Quantization,
    device: torch.device,
) -> dict[str, QuantizedWeight]:
    """A quantized checkpoint's linears taken out of ``state``: packed for ``device`` where
    the architecture packs them and ``quantization`` keeps the checkpoint's format, else
    put back dequantized as ``<module>.weight``."""
    packed: dict[str, QuantizedWeight] = {}
    runs_packed = stored.runs_packed_on(device.type)
    for module in stored.linears(list(state)):
        name = f"{module}.weight"
        pack = quantization != "none" and runs_packed and name in packable
        if quantization == "auto" and not runs_packed and name in packable:
            raise ValueError(stored.refusal(device.type))
        weight = stored.take_linear(state, module, pack, device)
        if isinstance(weight, QuantizedWeight):
            packed[name] = weight
        else:
            state[name] = weight
    return packed


def _build_on_meta(config: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        return build_model(config)


def _int8_weights(state: dict[str, torch.Tensor], names: Set[str]) -> dict[str, QuantizedWeight]:
    """The float linear weights of ``names`` in ``state``, taken out and packed as int8 per
    output channel (``--quantization int8``)."""
    return {name: int8_weight(state.pop(name)) for name in sorted(names & state.keys())}


def _repacked_int8(model: CausalLM, config: ModelConfig, device: str | torch.device) -> CausalLM:
    """``tiny`` (built with its weights, not loaded) with its linears packed as int8."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    packed = _int8_weights(state, model.packable_weights())
    return fill_weights(_build_on_meta(config), config, state, packed, device, "tiny's weights")


def fill_weights(
    model: CausalLM,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    packed: dict[str, QuantizedWeight],
    device: str | torch.device,
    origin: str,
) -> CausalLM:
    """``model`` (built on ``meta``) given exactly the tensors of ``state`` and the packed
    weights of ``packed`` (a tied LM head comes from the embedding); ``origin`` names them
    in the error. A packed weight's module keeps an empty ``weight`` and the packed one as
    ``packed_weight`` (``model/architectures/layers.py``); ``config.quantization`` records
    the formats."""
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        packed.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    given = state.keys() | packed.keys()
    missing, unexpected = expected - given, given - expected
    if missing or unexpected:
        raise ValueError(
            f"{origin} do not match {config.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    dtype = resolve_dtype(config.dtype)
    check_packed_device({weight.scheme for weight in packed.values()}, device)
    model.load_state_dict(state, strict=False, assign=True)
    for name, weight in packed.items():
        module = model.get_submodule(name.removesuffix(".weight"))
        module.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device), False)
        attach_packed_weight(module, weight)
    model.tie_weights()
    config.quantization = "+".join(sorted({w.scheme for w in packed.values()})) or "none"
    return model.to(device).eval()


def _weight_files(directory: Path) -> list[Path]:
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        files = [directory / name for name in shard_names]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index_path} names {file.name}, which is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights")
    return files


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)
