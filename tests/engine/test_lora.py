"""LoRA adapters beside the base model in one engine (``model/lora/``): rows of three PEFT
adapters (different ranks, alphas, rsLoRA and target modules) and of the base model in one
batch equal transformers + peft token for token, on Llama, Qwen3 and Gemma 3; an adapter is named in block hashes by its
weights; bad adapters are refused naming them.

The adapters are written by peft itself over a random Llama saved here; ``init_lora_weights
=False`` makes their B random, so each adapter changes the model's output."""

from __future__ import annotations

import json

import peft
import pytest
import safetensors.torch
import torch
import transformers

from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams
from pdserve.model.loader import load_model
from pdserve.model.lora.peft_adapter import LoRAAdapter
from tests.engine.hf_models import GEMMA3, hf_greedy, save_hf_model
from tests.model.test_loader import save_llama

ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "everything": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "mlp": dict(
        r=2,
        lora_alpha=4,
        target_modules=["gate_proj", "down_proj", "o_proj"],
        rank_pattern={"down_proj": 6},
        alpha_pattern={"o_proj": 3},
    ),
}
PROMPTS = [[5, 9, 2, 17, 30, 4, 11], [6, 7, 8, 9, 10, 12, 14, 20, 21], [1, 2, 3], [29, 28, 27, 26]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return write_folders(tmp_path_factory)


def write_folders(tmp_path_factory):
    """The base Llama's folder and each adapter's, written by peft."""
    base = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    save_llama(
        base,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    adapters = {}
    for name, settings in ADAPTERS.items():
        torch.manual_seed(len(adapters) + 1)
        model = transformers.LlamaForCausalLM.from_pretrained(base)
        config = peft.LoraConfig(init_lora_weights=False, **settings)
        adapted = peft.get_peft_model(model, config)
        adapters[name] = tmp_path_factory.mktemp(name)
        adapted.save_pretrained(adapters[name])
    return base, adapters


def peft_tokens(base, adapter, prompt: list[int]) -> list[int]:
    """Greedy tokens of transformers' Llama with the adapter (None: the base) applied by peft."""
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )
    return out[0, len(prompt) :].tolist()


def test_rows_of_three_adapters_and_the_base_in_one_batch_equal_peft(folders):
    base, adapters = folders
    engine = LLMEngine.from_pretrained(
        str(base), lora_modules={n: str(p) for n, p in adapters.items()}, num_kv_blocks=64
    )
    names = ["qv", None, "everything", "mlp"]
    outputs = engine.generate(PROMPTS, GREEDY, lora_names=names)
    for prompt, name, output in zip(PROMPTS, names, outputs):
        want = peft_tokens(base, adapters[name] if name else None, prompt)
        assert output.output_token_ids == want, (name, output.output_token_ids, want)
    # The same prompts again, each under another adapter: their blocks are cached by now,
    # under other adapters' hashes, and none may be reused.
    shifted = names[1:] + names[:1]
    again = engine.generate(PROMPTS, GREEDY, lora_names=shifted)
    for prompt, name, output in zip(PROMPTS, shifted, again):
        assert output.output_token_ids == peft_tokens(
            base, adapters[name] if name else None, prompt
        )
    # Two adapters of two rows each and no base row: decode steps without a padded slot.
    pairs = ["qv", "everything", "everything", "qv"]
    for prompt, name, output in zip(PROMPTS, pairs, engine.generate(PROMPTS, GREEDY, pairs)):
        assert output.output_token_ids == peft_tokens(base, adapters[name], prompt)


def test_an_adapter_is_named_by_its_weights(folders, tmp_path):
    """Two loads of one file agree; the same name over other weights differs, and so do the
    hashes of a prompt's blocks under each."""
    base, adapters = folders
    model, _, _ = load_model(str(base))
    first = LoRAAdapter.load("a", adapters["qv"], model, 16)
    assert LoRAAdapter.load("other name", adapters["qv"], model, 16).digest == first.digest
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "adapter_config.json").write_text(
        (adapters["qv"] / "adapter_config.json").read_text()
    )
    tensors = safetensors.torch.load_file(str(adapters["qv"] / "adapter_model.safetensors"))
    name = next(n for n in tensors if "lora_B" in n)
    tensors[name] = tensors[name] + 1
    safetensors.torch.save_file(tensors, str(changed / "adapter_model.safetensors"))
    assert LoRAAdapter.load("a", changed, model, 16).digest != first.digest
    engine = LLMEngine.from_pretrained(str(base), lora_modules={"a": str(adapters["qv"])})
    hasher = engine.block_hasher
    tokens = list(range(40))
    under = [hasher.hash_request_blocks(tokens, 16, lora_id=d) for d in (None, first.digest, "x")]
    assert not set(under[0]) & set(under[1]) and not set(under[1]) & set(under[2])


def write_adapter(folder, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    safetensors.torch.save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def write_q_proj_adapter(folder, layer: int, rank: int, width: int) -> str:
    """An adapter of layer ``layer``'s q_proj alone, of rank ``rank`` over ``width``-wide
    hidden states, all zeros (what a refusal reads does not depend on the values)."""
    prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    tensors = {
        f"{prefix}.lora_A.weight": torch.zeros(rank, width),
        f"{prefix}.lora_B.weight": torch.zeros(width, rank),
    }
    return write_adapter(folder, {"r": rank, "lora_alpha": rank}, tensors)


def test_bad_adapters_and_names_are_refused_naming_them(folders, tmp_path):
    base, adapters = folders
    model, _, _ = load_model(str(base))
    with pytest.raises(ValueError, match="'everything' has rank 8 .* above max_lora_rank 4"):
        LoRAAdapter.load("everything", adapters["everything"], model, 4)
    missing_layer = write_q_proj_adapter(tmp_path / "layer9", layer=9, rank=2, width=64)
    with pytest.raises(ValueError, match="targets q_proj of layer 9, which the model does not"):
        LoRAAdapter.load("layer9", missing_layer, model, 16)
    embedding = write_adapter(
        tmp_path / "embedding",
        {"r": 2},
        {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(2, 32)},
    )
    with pytest.raises(ValueError, match="holds 'base_model.model.model.embed_tokens"):
        LoRAAdapter.load("embedding", embedding, model, 16)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text("{}")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00not json")
    with pytest.raises(ValueError, match="'corrupt' at .* cannot be read"):
        LoRAAdapter.load("corrupt", corrupt, model, 16)
    engine = LLMEngine.from_pretrained(
        str(base), lora_modules={"qv": str(adapters["qv"])}, load_lora_on_demand=False
    )
    with pytest.raises(
        ValueError, match="unknown LoRA adapter 'nope'; this worker serves \\['qv'\\]$"
    ):
        engine.add_request("r", [1, 2, 3], GREEDY, lora_name="nope")
    with pytest.raises(ValueError, match="'mlp'; .* does not load adapters on demand"):
        engine.add_request("r", [1, 2, 3], GREEDY, lora_name="mlp", lora_path=str(adapters["mlp"]))
    with pytest.raises(ValueError, match="max_loras must be >= 1"):
        LLMEngine.from_pretrained(str(base), max_loras=0)


def test_more_adapters_than_max_loras_serve_least_recently_used_in_memory(folders):
    """Three adapters registered, two in memory (``max_loras``): a request for the third
    reads it again and evicts the least recently used idle one; an adapter a request runs
    is never evicted, and a request that would need a third in memory while both run
    requests is refused; unloading a running adapter lets its requests end on its weights;
    a name registered again over other files decodes as those, never from the old blocks;
    an adapter that is not registered is loaded from a request's path on demand."""
    base, adapters = folders
    modules = {name: str(folder) for name, folder in adapters.items() if name != "qv"}
    engine = LLMEngine.from_pretrained(
        str(base), lora_modules=modules, max_loras=2, num_kv_blocks=64
    )
    assert engine.lora.names() == ["everything", "mlp"]
    # "qv" is not registered: a request that brings its folder loads it (on demand).
    engine.add_request("qv", PROMPTS[0], GREEDY, lora_name="qv", lora_path=str(adapters["qv"]))
    with pytest.raises(ValueError, match="'qv' is loaded already"):
        engine.load_lora_adapter("qv", str(adapters["qv"]))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.lora.names() == ["everything", "mlp", "qv"]
    assert [a.name for a in engine.lora.resident.values()] == ["mlp", "qv"]  # everything: LRU
    [output] = engine.generate(PROMPTS[1:2], GREEDY, lora_names=["everything"])  # read again
    assert output.output_token_ids == peft_tokens(base, adapters["everything"], PROMPTS[1])
    assert [a.name for a in engine.lora.resident.values()] == ["qv", "everything"]

    engine.add_request("busy", PROMPTS[2], GREEDY, lora_name="qv")
    engine.add_request("busy too", PROMPTS[3], GREEDY, lora_name="mlp")  # evicts everything
    with pytest.raises(ValueError, match="'everything' cannot be loaded now: all 2 adapters"):
        engine.add_request("third", PROMPTS[1], GREEDY, lora_name="everything")
    engine.unload_lora_adapter("qv")  # "busy" ends on qv's weights
    engine.load_lora_adapter("qv", str(adapters["mlp"]))  # "qv" again, over mlp's weights
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    assert finished["busy"].output_token_ids == peft_tokens(base, adapters["qv"], PROMPTS[2])
    assert finished["busy too"].output_token_ids == peft_tokens(base, adapters["mlp"], PROMPTS[3])
    # The new "qv"'s prompt: its blocks under the old "qv" are cached, and never reused.
    [output] = engine.generate(PROMPTS[2:3], GREEDY, lora_names=["qv"])
    assert output.output_token_ids == peft_tokens(base, adapters["mlp"], PROMPTS[2])
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        engine.unload_lora_adapter("nope")


@pytest.mark.parametrize(
    "config_class, overrides",
    [(transformers.Qwen3Config, {}), (transformers.Gemma3TextConfig, GEMMA3)],
    ids=["qwen3", "gemma3"],
)
def test_adapters_over_other_families_equal_peft(tmp_path, config_class, overrides):
    """Qwen3 (q/k norms after the adapted projections) and Gemma 3 (GeGLU, windows, four
    norms a layer): two adapters and the base in one batch, as transformers + peft."""
    base = tmp_path / "base"
    save_hf_model(base, config_class, seed=3, **overrides)
    adapters = {}
    for index, name in enumerate(("qv", "everything")):
        torch.manual_seed(10 + index)
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
        adapted = peft.get_peft_model(
            model, peft.LoraConfig(init_lora_weights=False, **ADAPTERS[name])
        )
        adapters[name] = tmp_path / name
        adapted.save_pretrained(adapters[name])
    engine = LLMEngine.from_pretrained(
        str(base), lora_modules={n: str(p) for n, p in adapters.items()}, num_kv_blocks=64
    )
    prompts = [[5, 9, 2, 17, 30, 4, 11, 40, 41, 42, 43, 44, 45, 46], [6, 7, 8], [60, 61, 62, 63]]
    names = ["everything", None, "qv"]
    outputs = engine.generate(prompts, GREEDY, lora_names=names)
    for prompt, name, output in zip(prompts, names, outputs):
        model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[name]).eval()
        assert output.output_token_ids == hf_greedy(model, prompt, 8), name


def test_tensor_parallel_ranks_run_their_slices_of_each_adapter_as_one_rank_does(folders):
    """At tensor_parallel_size 2, each rank holds its slice of every adapter in memory (A
    whole and B's rows on q/k/v/gate/up, A's columns and B whole on o/down), read by the
    peer from the adapter's folder when rank 0's set changes: mixed rows equal TP=1, an
    adapter loaded while serving included."""
    base, adapters = folders
    modules = {name: str(adapters[name]) for name in ("qv", "mlp")}
    names = ["qv", None, "mlp", "qv"]
    one = LLMEngine.from_pretrained(str(base), lora_modules=modules, num_kv_blocks=64)
    two = LLMEngine.from_pretrained(
        str(base), lora_modules=modules, num_kv_blocks=64, tensor_parallel_size=2
    )
    try:
        expected = one.generate(PROMPTS, GREEDY, lora_names=names)
        outputs = two.generate(PROMPTS, GREEDY, lora_names=names)
        assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in expected]
        two.load_lora_adapter("everything", str(adapters["everything"]))
        [output] = two.generate(PROMPTS[1:2], GREEDY, lora_names=["everything"])
        assert output.output_token_ids == peft_tokens(base, adapters["everything"], PROMPTS[1])
    finally:
        two.shutdown()
