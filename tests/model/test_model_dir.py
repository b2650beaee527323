"""`check_model_dir`: a bad HF model directory is one error naming the path and the problem (before: a Hugging
Face "Repo id" message, a sentencepiece/tiktoken error, a safetensors error without a path, or a 2-layer
model training silently from 3-layer weights)."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_tail.model.directory import check_model_dir
from megatron_tail.utils.errors import UserError


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    from megatron_tail.demo.model import new_tiny_qwen3, save_hf

    model, tokenizer = new_tiny_qwen3(
        0, hidden_size=32, intermediate_size=64, num_hidden_layers=3, head_dim=8, max_position_embeddings=32
    )
    return save_hf(model, tokenizer, tmp_path_factory.mktemp("model_dir") / "tiny")


@pytest.fixture
def model_dir(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "tiny")


def _edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_good_directory_passes(model_dir):
    assert check_model_dir(model_dir).num_layers == 3


def test_a_missing_directory_is_not_found(tmp_path):
    with pytest.raises(UserError, match=rf"model.hf_path: model directory '{tmp_path / 'nope'}' not found"):
        check_model_dir(tmp_path / "nope")


def test_a_directory_without_a_tokenizer_says_so(model_dir):
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=rf"{model_dir} has no tokenizer \(none of tokenizer.json"):
        check_model_dir(model_dir)


def test_a_truncated_safetensors_file_is_named(model_dir):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(
        UserError, match=rf"{weights} is truncated: its header describes \d+ bytes, the file has"
    ):
        check_model_dir(model_dir)
    weights.write_bytes(b"\x00" * 4)
    with pytest.raises(UserError, match=rf"{weights} is not a readable safetensors file"):
        check_model_dir(model_dir)


def test_weights_with_more_layers_than_config_json_are_refused_naming_the_tensors(model_dir):
    _edit_config(model_dir, num_hidden_layers=2)
    with pytest.raises(UserError, match=r"tensors 11 unexpected \(model.layers.2.input_layernorm.weight, "):
        check_model_dir(model_dir)


def test_weights_with_fewer_layers_than_config_json_are_refused_naming_the_tensors(model_dir):
    _edit_config(model_dir, num_hidden_layers=4)
    with pytest.raises(UserError, match=r"tensors 11 missing \(model.layers.3.input_layernorm.weight, "):
        check_model_dir(model_dir)


def test_a_tensor_of_the_wrong_shape_is_named(model_dir):
    _edit_config(model_dir, intermediate_size=32)
    with pytest.raises(
        UserError, match=r"tensor model.layers.0.mlp.gate_proj.weight .* has shape \(64, 32\), "
    ):
        check_model_dir(model_dir)


@pytest.mark.parametrize(
    ("text", "kind"), [("[]", "array"), ("null", "null"), ('"x"', "string"), ("3", "number")]
)
def test_a_config_json_that_is_not_an_object_is_named(model_dir, text, kind):
    """Before: AttributeError: 'list' object has no attribute 'get' (a traceback, in `plan` and `train`)."""
    (model_dir / "config.json").write_text(text)
    with pytest.raises(UserError) as info:
        check_model_dir(model_dir)
    assert str(info.value) == (
        f"model.hf_path: {model_dir}/config.json holds a JSON {kind}; expected a JSON object (the model's "
        "config: architectures, hidden_size, ...)"
    )
