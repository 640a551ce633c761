"""The weights' digest in the model's fingerprint: one config with other weights is
another model; the same weights anywhere, at any dtype, are one."""

from __future__ import annotations

import shutil

import transformers

from pdserve.model.loader import load_model
from tests.engine.hf_models import save_hf_model


def test_one_config_with_other_weights_has_another_fingerprint_and_a_copy_the_same(tmp_path):
    for name, seed in (("a", 0), ("b", 1)):
        save_hf_model(tmp_path / name, transformers.LlamaConfig, seed=seed)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    a, b, copy = (load_model(str(tmp_path / name))[1] for name in ("a", "b", "copy"))
    assert a.weights_digest and a.weights_digest != b.weights_digest
    assert a.fingerprint != b.fingerprint
    assert copy.weights_digest == a.weights_digest and copy.fingerprint == a.fingerprint
    as_bf16 = load_model(str(tmp_path / "a"), "bfloat16")[1]
    assert as_bf16.weights_digest == a.weights_digest  # the files', not the loaded tensors'


def test_the_built_in_models_have_a_digest_that_is_the_same_at_every_load():
    for name in ("tiny", "smollm2"):
        first, second = (load_model(name)[1] for _ in range(2))
        assert len(first.weights_digest) == 32 and first.weights_digest == second.weights_digest
