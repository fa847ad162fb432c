"""The facts chat/adapters.py holds: peft's file layout and the base-model fingerprint."""

import json

import torch
from peft import LoraConfig, get_peft_model

from chat.adapters import LORA_TARGETS, adapter_config, base_of, fingerprint, is_adapter_dir, model_fingerprint
from chat.model import load_model


def test_a_peft_adapter_saved_by_peft_is_recognised(tmp_path, tiny_path):
    model = get_peft_model(load_model(str(tiny_path)), LoraConfig(r=4, target_modules=list(LORA_TARGETS)))
    model.save_pretrained(tmp_path / "adapter")
    assert is_adapter_dir(tmp_path / "adapter")
    assert adapter_config(tmp_path / "adapter")["r"] == 4
    assert not is_adapter_dir(tiny_path)  # a full model folder is not an adapter
    # every targeted projection of the encoder and decoder got a LoRA pair
    wrapped = {name.split(".lora_A.")[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    assert {name.rsplit(".", 1)[-1] for name in wrapped} == set(LORA_TARGETS)
    assert any(".encoder." in name for name in wrapped) and any(".decoder." in name for name in wrapped)


def test_an_unreadable_adapter_config_names_the_file(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")
    try:
        adapter_config(tmp_path)
    except ValueError as err:
        assert "adapter_config.json" in str(err)
    else:
        raise AssertionError("an unreadable config was accepted")
    (tmp_path / "adapter_config.json").write_text(json.dumps([1, 2]))
    try:
        adapter_config(tmp_path)
    except ValueError as err:
        assert "not a JSON object" in str(err)
    else:
        raise AssertionError("a list was accepted as a config")


def test_fingerprint_tells_bases_apart_and_ignores_the_serving_dtype(tiny_path):
    model = load_model(str(tiny_path))
    before = model_fingerprint(model)
    assert len(before) == 16
    assert fingerprint(model.get_input_embeddings().weight.clone()) == before  # a copy: same id
    other = model.get_input_embeddings().weight.detach().clone()
    other[0, 0] += 1e-3
    assert fingerprint(other) != before  # one changed weight: another base
    assert model_fingerprint(model.to(torch.float64)) == before  # cast back to fp32 before hashing


def test_base_of_reads_peft_config_and_the_recorded_fingerprint(tmp_path, tiny_path):
    model = get_peft_model(load_model(str(tiny_path)), LoraConfig(r=4, target_modules=list(LORA_TARGETS)))
    model.peft_config["default"].base_model_name_or_path = "tiny"
    model.save_pretrained(tmp_path)
    assert base_of(tmp_path) == ("tiny", None)  # an adapter from elsewhere: matched by name only
    (tmp_path / "training_args.json").write_text(json.dumps({"base_fingerprint": "0123456789abcdef"}))
    assert base_of(tmp_path) == ("tiny", "0123456789abcdef")
    (tmp_path / "training_args.json").write_text("[]")  # not an object: no fingerprint, no crash
    assert base_of(tmp_path) == ("tiny", None)
