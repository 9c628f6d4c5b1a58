"""An unknown model name suggests only the same model spelled another way (kvlab.model_names), and `kvlab calc`
takes a config.json or a model folder as `kvlab swapin --model` does (issue 25, item 7)."""

from __future__ import annotations

import json

import pytest

from kvlab import cli, model_names, models


@pytest.mark.parametrize("typed, meant", [
    ("llama-3.1-8", "llama-3.1-8b"),       # the size's "b" left off
    ("qwen2.5-7", "qwen2.5-7b"),
    ("llama-2-7", "llama-2-7b"),
    ("lama-3.1-8b", "llama-3.1-8b"),       # a typo in the family
    ("mistral-8x7b", "mixtral-8x7b"),
    ("gemma2-9", "gemma-2-9b"),            # another separator, no "b"
    ("llama-31-8b", "llama-3.1-8b"),       # the version without its dot
    ("qwen2.5-7b-chat", "qwen2.5-7b"),     # a tune of the same shape
    ("kvlab-tinny", "kvlab-tiny"),
])
def test_the_same_model_spelled_another_way_is_suggested(typed, meant):
    with pytest.raises(ValueError, match=f"did you mean '{meant}'") as err:
        models.get(typed)
    assert "known models: llama-2-7b" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("typed", [
    "llama-3.2-1b",      # the case: three characters from llama-3.1-8b, another model
    "llama-3-8b",        # Llama 3, not 3.1
    "llama-3.1-7b",      # a size Llama 3.1 does not come in
    "qwen2-7b",          # Qwen2, not Qwen2.5
    "qwen-7b",
    "mistral-7b-v0.2",   # another Mistral 7B release (no sliding window)
    "gemma-2-27b",
    "deepseek-v2",
    "llama-9",
    "gpt-7",
])
def test_a_different_model_gets_no_suggestion(typed):
    with pytest.raises(ValueError) as err:
        models.get(typed)
    text = str(err.value)
    assert "did you mean" not in text, text
    assert f"unknown model {typed!r}; no known model has that family, version and size; known models: " in text


def test_names_are_read_as_family_version_and_size():
    assert model_names.readings("llama-3.2-1b") == [model_names.NameParts("llama", "32", "1b")]
    assert model_names.readings("mixtral-8x7b-instruct-v0.1") == [model_names.NameParts("mixtral", "01", "8x7b")]
    assert model_names.readings("deepseek-v3") == [model_names.NameParts("deepseek", "3", "")]
    # a bare last number after a version is the size; without one it may be either
    assert model_names.readings("llama-3.1-8") == [model_names.NameParts("llama", "31", "8b")]
    assert model_names.readings("mistral-7") == [model_names.NameParts("mistral", "7", ""),
                                                 model_names.NameParts("mistral", "", "7b")]
    assert model_names.close_names("mistral-7", models.aliases()) == ["mistral-7b"]


def test_model_ref_takes_a_hub_id_a_path_or_a_folder_and_names_what_is_missing(tmp_path):
    assert models.model_ref("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"  # a hub id with its "/"
    (tmp_path / "config.json").write_text(json.dumps(models.get("qwen2.5-7b").hf_config))
    assert models.model_ref(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match=r"^model = '/no/such/config.json': no such file"):
        models.model_ref("/no/such/config.json")
    with pytest.raises(ValueError, match=r"no known model .* \(or give a config.json path or a model folder\)$"):
        models.model_ref("llama-3.2-1b")


def _rows(out: str) -> dict:
    return dict(line.split(None, 1) for line in out.splitlines())


def test_calc_takes_a_config_json_or_a_model_folder(tmp_path, capsys):
    # Llama 3.2 1B's published shape (meta-llama/Llama-3.2-1B config.json): 16 layers, 8 KV heads of 64
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
           "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64,
           "model_type": "llama", "vocab_size": 128256, "max_position_embeddings": 131072,
           "tie_word_embeddings": True}
    folder = tmp_path / "Llama-3.2-1B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    for ref in (folder, folder / "config.json"):
        assert cli.main(["calc", str(ref), "--tokens", "8k", "--link", "100G"]) == 0
        rows = _rows(capsys.readouterr().out)
        assert rows["model"] == "Llama-3.2-1B"
        assert rows["kv_bytes_per_token"] == f"{16 * 2 * 8 * 64 * 2:,} (32 KiB) at this prompt"
        assert rows["kv_bytes"] == f"{16 * 2 * 8 * 64 * 2 * 8192:,} (256 MiB)"
    # a registry model's own config gives the registry model's numbers
    same = tmp_path / "mine"
    same.mkdir()
    (same / "config.json").write_text(json.dumps(models.get("llama-3.1-8b").hf_config))
    assert cli.main(["calc", str(same), "--tokens", "8192"]) == 0
    mine = _rows(capsys.readouterr().out)
    assert cli.main(["calc", "llama-3.1-8b", "--tokens", "8192"]) == 0
    registry = _rows(capsys.readouterr().out)
    assert mine.pop("model") == "mine" and registry.pop("model") == "llama-3.1-8b"
    assert mine == registry


@pytest.mark.parametrize("ref, says", [
    ("/no/such/dir/config.json", "MODEL = '/no/such/dir/config.json': no such file"),
    ("llama-3.2-1b", "unknown model 'llama-3.2-1b'; no known model has that family, version and size"),
    ("llama-3.1-8", "did you mean 'llama-3.1-8b'?"),
])
def test_calc_refuses_a_model_it_cannot_read_in_one_line(ref, says, capsys):
    assert cli.main(["calc", ref, "--tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab calc: error: ") and says in err and err.count("\n") == 1
