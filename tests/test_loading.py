"""Loading: every bad input gets a clear LoadError/InputError naming the problem and the fix."""

import json
import shutil
import warnings

import mlx.core as mx
import pytest

from dspark_lab import InputError, LoadError, SlowDtypeWarning, greedy_generate, load_target
from dspark_lab.engine.text import encode_prompt


@pytest.fixture
def model_copy(tiny_dirs, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_dirs["qwen2"], dst)
    return dst


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_missing_path(tmp_path):
    with pytest.raises(LoadError, match="not found: no such directory"):
        load_target(tmp_path / "nope" / "nothing")


def test_file_instead_of_directory(model_copy):
    with pytest.raises(LoadError, match="is a file; pass the directory"):
        load_target(model_copy / "config.json")


def test_no_config_json(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(LoadError, match="no config.json in"):
        load_target(model_copy)


def test_unknown_model_type(model_copy):
    edit_json(model_copy / "config.json", model_type="made_up_arch")
    with pytest.raises(LoadError, match="unknown model_type 'made_up_arch'"):
        load_target(model_copy)


def test_unsupported_quantization_bits(model_copy):
    edit_json(model_copy / "config.json", quantization={"group_size": 64, "bits": 7})
    with pytest.raises(LoadError, match="unsupported quantization: 7 bits"):
        load_target(model_copy)


def test_safetensors_that_do_not_match_the_config(model_copy):
    edit_json(model_copy / "config.json", hidden_size=128)
    with pytest.raises(LoadError, match="do not match its config.json"):
        load_target(model_copy)


def test_missing_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="no model.*safetensors weights"):
        load_target(model_copy)


def test_missing_tensor(model_copy):
    weights = mx.load(str(model_copy / "model.safetensors"))
    weights.pop("model.layers.0.mlp.up_proj.weight")
    mx.save_safetensors(str(model_copy / "model.safetensors"), weights)
    with pytest.raises(LoadError, match="do not match its config.json"):
        load_target(model_copy)


@pytest.mark.parametrize("file, payload, marker", [
    ("config.json", {"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}, "config.json: auto_map"),
    ("config.json", {"model_file": "my_model.py"}, "config.json: model_file"),
    ("config.json", {"text_config": {"auto_map": {"AutoConfig": "c.C"}}}, "config.json: text_config.auto_map"),
    ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["t.T", None]}}, "tokenizer_config.json: auto_map"),
    ("generation_config.json", {"auto_map": {"x": "y.Z"}}, "generation_config.json: auto_map"),
])
def test_remote_code_is_refused_and_named(model_copy, file, payload, marker, monkeypatch):
    monkeypatch.delenv("DSPARK_LAB_TRUST_REMOTE_CODE", raising=False)
    edit_json(model_copy / file, **payload)
    with pytest.raises(LoadError, match=f"asks to import its own Python code \\({marker}.*--trust-remote-code"):
        load_target(model_copy)


def test_remote_code_marker_allowed_when_trusted(model_copy, monkeypatch):
    # auto_map only matters to transformers' Auto classes: with trust, mlx-lm loads normally.
    edit_json(model_copy / "tokenizer_config.json", auto_map={"AutoTokenizer": ["t.T", None]})
    target, _ = load_target(model_copy, trust_remote_code=True)
    assert target.model_type == "qwen2"
    monkeypatch.setenv("DSPARK_LAB_TRUST_REMOTE_CODE", "1")
    target, _ = load_target(model_copy)
    assert target.model_type == "qwen2"


def test_offline_repo_id_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(LoadError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE=1"):
        load_target("someone/some-model")


def test_bad_kv_bits_and_dtype(tiny_dirs):
    with pytest.raises(LoadError, match="kv_bits=7 is not supported"):
        load_target(tiny_dirs["qwen3"], kv_bits=7)
    with pytest.raises(LoadError, match="dtype 'float8' is not supported"):
        load_target(tiny_dirs["qwen3"], dtype="float8")
    with pytest.raises(LoadError, match="kv_bits needs a head_dim divisible by 32"):
        load_target(tiny_dirs["qwen3"], kv_bits=4)  # head_dim 16


def test_dtype_cast(tiny_dirs):
    target, _ = load_target(tiny_dirs["qwen3"], dtype="float16")
    assert target.model.model.embed_tokens.weight.dtype == mx.float16


def test_half_precision_on_the_cpu_backend_comes_with_advice_to_cast(tiny_dirs, tiny_bf16_dir, monkeypatch):
    # MLX's CPU backend computes bfloat16 slowly: a 4-bit bfloat16 Qwen 0.5B decoded 10.1x faster
    # cast to float32 (benchmarks/cpu_dtype.py). A user who did not choose a dtype is told how.
    assert mx.default_device().type == mx.cpu  # CI and this machine: MLX's CPU backend
    with pytest.warns(SlowDtypeWarning, match=r"has bfloat16 weights and MLX runs on its CPU backend.*--dtype float32"):
        target, _ = load_target(tiny_bf16_dir)
    assert target.model.model.embed_tokens.weight.dtype == mx.bfloat16  # advice only: nothing cast
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowDtypeWarning)
        load_target(tiny_bf16_dir, dtype="float32")  # the fix
        load_target(tiny_bf16_dir, dtype="bfloat16")  # a dtype chosen on purpose
        load_target(tiny_dirs["qwen3"])  # float32 as stored
        monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))  # on a GPU half precision is fast
        load_target(tiny_bf16_dir)


@pytest.mark.parametrize("prompt, match", [("", "the prompt is empty"), ("   \n", "the prompt is empty"), ([], "the prompt is empty")])
def test_empty_prompt(qwen3, prompt, match):
    target, tok = qwen3
    with pytest.raises(InputError, match=match):
        greedy_generate(target, tok, prompt, max_new_tokens=3)


def test_untokenizable_prompt():
    class NoVocab:
        chat_template = None

        def encode(self, text):
            return []

    with pytest.raises(InputError, match="tokenizes to no tokens"):
        encode_prompt(NoVocab(), "zzz")


@pytest.mark.parametrize("n", [0, -5])
def test_max_new_tokens_must_be_positive(qwen3, n):
    target, tok = qwen3
    with pytest.raises(InputError, match="max_new_tokens must be a positive integer"):
        greedy_generate(target, tok, "hi", max_new_tokens=n)


def test_errors_are_one_type():
    assert issubclass(LoadError, Exception) and issubclass(InputError, ValueError)


def test_chat_messages_for_a_base_model_become_plain_text():
    class BaseTokenizer:  # no chat template, like Gemma-3-270M base
        chat_template = None

        def encode(self, text):
            return [ord(c) for c in text]

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert encode_prompt(BaseTokenizer(), msgs) == [ord(c) for c in "Be brief.\n\nHi"]
