"""Every file in configs/ (found by globbing, so a new one is covered) and TrainConfig's YAML/CLI loading."""

import json
import re
from pathlib import Path

import pytest
import yaml

from chat.layout import ROOT
from finetune.config import TrainConfig, parse_args

CONFIGS = ROOT / "configs"
ACCELERATE = CONFIGS / "accelerate"
YAML_SUFFIXES = (".yaml", ".yml")

ALL_FILES = sorted(p for p in CONFIGS.rglob("*") if p.is_file())
DS_JSONS = [p for p in ALL_FILES if p.suffix == ".json"]
ACCELERATE_YAMLS = [p for p in ALL_FILES if p.suffix in YAML_SUFFIXES and p.parent == ACCELERATE]
TRAIN_YAMLS = [p for p in ALL_FILES if p.suffix in YAML_SUFFIXES and p.parent != ACCELERATE]


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


# accelerate refuses these accelerate-config fields when a deepspeed_config_file is given
# (accelerate.utils.dataclasses.DeepSpeedPlugin._deepspeed_config_checks): they belong in the JSON.
DS_FIELDS_REFUSED_WITH_FILE = {
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
    "mixed_precision",
}


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    assert not duplicates, f"duplicate keys {duplicates}"  # json.loads would silently keep the last one
    return dict(pairs)


def load_json(path: Path) -> dict:
    return json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys)


# --------------------------------------------------------------------------- discovery


def test_every_config_file_is_of_a_known_kind():
    assert ALL_FILES, "configs/ is empty?"
    for path in ALL_FILES:
        known = path.suffix == ".json" or path.suffix in YAML_SUFFIXES
        assert known, f"{rel(path)}: unknown kind of config file (add a check for it to tests/test_configs.py)"
    covered = set(DS_JSONS) | set(ACCELERATE_YAMLS) | set(TRAIN_YAMLS)
    assert covered == set(ALL_FILES)
    for path in TRAIN_YAMLS:  # a YAML outside configs/accelerate/ is a training config (--config)
        assert isinstance(parse_args(["--config", str(path)]), TrainConfig), rel(path)


def test_the_shipped_configs_are_discovered():
    assert {"ds_zero2.json", "ds_zero2_seed.json", "ds_zero3_offload.json"} <= {p.name for p in DS_JSONS}
    assert {
        "cpu_zero2.yaml",
        "ddp.yaml",
        "two_machines.yaml",
        "zero2.yaml",
        "zero2_seed.yaml",
        "zero3_offload.yaml",
    } <= {p.name for p in ACCELERATE_YAMLS}


# --------------------------------------------------------------------------- DeepSpeed JSONs


@pytest.mark.parametrize("path", DS_JSONS, ids=rel)
def test_deepspeed_json_is_well_formed(path):
    cfg = load_json(path)
    stage = cfg["zero_optimization"]["stage"]
    assert stage in (0, 1, 2, 3)
    named = re.search(r"zero(\d)", path.name)
    if named:
        assert stage == int(named.group(1)), f"{path.name} says ZeRO-{named.group(1)} but sets stage {stage}"
    # Precision comes from `accelerate launch --mixed_precision`, so both sections must be "auto".
    assert cfg["fp16"]["enabled"] == "auto" and cfg["bf16"]["enabled"] == "auto"
    # Values the training flags own are left to accelerate to fill in.
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert cfg[key] == "auto", key
    assert cfg.get("train_batch_size", "auto") == "auto"
    if "optimizer" in cfg:
        assert cfg["optimizer"]["params"]["lr"] == "auto"
        assert cfg["optimizer"]["params"]["weight_decay"] == "auto"
    if "scheduler" in cfg:
        assert all(v == "auto" for v in cfg["scheduler"]["params"].values())


@pytest.mark.parametrize("path", DS_JSONS, ids=rel)
def test_deepspeed_accepts_the_zero_section(path):
    """DeepSpeed's own (pydantic, extra keys forbidden) model of zero_optimization: catches typos."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = {k: (10**6 if v == "auto" else v) for k, v in load_json(path)["zero_optimization"].items()}
    parsed = DeepSpeedZeroConfig(**zero)
    assert int(parsed.stage) == zero["stage"]


@pytest.mark.parametrize("path", DS_JSONS, ids=rel)
def test_accelerate_builds_a_deepspeed_plugin_from_the_json(path, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    monkeypatch.delenv("ACCELERATE_CONFIG_DS_FIELDS", raising=False)
    try:
        plugin = DeepSpeedPlugin(hf_ds_config=str(path))
        assert plugin.zero_stage == load_json(path)["zero_optimization"]["stage"]
    finally:
        unset_hf_deepspeed_config()
    assert not is_deepspeed_zero3_enabled()  # no global DeepSpeed state leaks into other tests


def test_zero2_seed_keeps_the_seed_values():
    cfg = load_json(CONFIGS / "ds_zero2_seed.json")
    assert cfg["fp16"] == {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 15,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    assert cfg["optimizer"]["type"] == "AdamW"
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert cfg["scheduler"]["type"] == "WarmupDecayLR"
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 2
    assert zero["allgather_bucket_size"] == 2e8 and zero["reduce_bucket_size"] == 2e8
    for flag in ("overlap_comm", "reduce_scatter", "contiguous_gradients", "allgather_partitions"):
        assert zero[flag] is True, flag


def test_zero2_default_is_the_tuned_recipe():
    # The optimizer and schedule come from the training script (fused torch AdamW), so the JSON
    # must not define them; ZeRO-2 with overlap and larger buckets than the seed's.
    cfg = load_json(CONFIGS / "ds_zero2.json")
    assert "optimizer" not in cfg and "scheduler" not in cfg
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 2 and zero["overlap_comm"] is True
    assert zero["reduce_bucket_size"] >= 2e8
    seed_yaml = yaml.safe_load((CONFIGS / "accelerate" / "zero2_seed.yaml").read_text())
    assert seed_yaml["deepspeed_config"]["deepspeed_config_file"] == "configs/ds_zero2_seed.json"


def test_zero3_offloads_to_cpu():
    zero = load_json(CONFIGS / "ds_zero3_offload.json")["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["device"] == "cpu"
    # accelerator.get_state_dict (the final save) needs the gathered 16-bit weights under ZeRO-3.
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True


# --------------------------------------------------------------------------- accelerate YAMLs


@pytest.mark.parametrize("path", ACCELERATE_YAMLS, ids=rel)
def test_accelerate_yaml_loads_with_accelerates_own_class(path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    cfg = ClusterConfig.from_yaml_file(str(path))
    assert isinstance(load_config_from_file(str(path)), ClusterConfig)
    assert cfg.num_processes >= 1 and cfg.num_machines >= 1
    assert 0 <= cfg.machine_rank < cfg.num_machines
    if cfg.num_machines > 1:
        assert cfg.main_process_ip and cfg.main_process_port
        assert cfg.num_processes % cfg.num_machines == 0  # num_processes counts all machines


@pytest.mark.parametrize("path", ACCELERATE_YAMLS, ids=rel)
def test_accelerate_yaml_deepspeed_settings(path, monkeypatch):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DeepSpeedPlugin, DistributedType
    from transformers.integrations import unset_hf_deepspeed_config

    raw = yaml.safe_load(path.read_text())
    cfg = ClusterConfig.from_yaml_file(str(path))
    ds = raw.get("deepspeed_config") or {}
    if cfg.distributed_type != DistributedType.DEEPSPEED:
        assert not ds, f"{rel(path)}: deepspeed_config without distributed_type DEEPSPEED"
        return
    file = ds.get("deepspeed_config_file")
    assert file, f"{rel(path)}: DeepSpeed settings live in a JSON in configs/ (deepspeed_config_file)"
    json_path = ROOT / file
    assert json_path.is_file(), f"{rel(path)}: {file} does not exist (paths are relative to the repo root)"
    assert json_path in DS_JSONS
    refused = sorted(DS_FIELDS_REFUSED_WITH_FILE & (set(raw) | set(ds)))
    assert not refused, f"{rel(path)}: accelerate refuses {refused} together with deepspeed_config_file"
    stage = load_json(json_path)["zero_optimization"]["stage"]
    if ds.get("zero3_init_flag"):
        assert stage == 3, f"{rel(path)}: zero3_init_flag with a stage-{stage} JSON"
    # What `accelerate launch` does with this file, then accelerate's own check of the combination.
    fields = list(ds) + (["mixed_precision"] if raw.get("mixed_precision") is not None else [])
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(fields).lower())
    try:
        plugin = DeepSpeedPlugin(hf_ds_config=str(json_path), zero3_init_flag=bool(ds.get("zero3_init_flag")))
        assert plugin.zero_stage == stage
    finally:
        unset_hf_deepspeed_config()


# --------------------------------------------------------------------------- TrainConfig


def write_yaml(tmp_path, data) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def test_yaml_rejects_unknown_keys(tmp_path, capsys):
    path = write_yaml(tmp_path, {"learning_rate": 1e-4, "learning_rat": 1e-4, "batch_size": 8})
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", path])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown keys" in err and "learning_rat" in err and "batch_size" in err
    assert "Traceback" not in err


def test_cli_overrides_yaml(tmp_path):
    path = write_yaml(
        tmp_path,
        {
            "learning_rate": 1e-4,
            "n_train": 10,
            "per_device_train_batch_size": 4,
            "pad_to_max_length": True,
            "output_dir": "from-yaml",
        },
    )
    cfg = parse_args(
        ["--config", path, "--learning_rate", "3e-5", "--pad_to_max_length", "false", "--output_dir", "from-cli"]
    )
    assert cfg.learning_rate == 3e-5
    assert cfg.pad_to_max_length is False
    assert cfg.output_dir == "from-cli"
    assert cfg.n_train == 10 and cfg.per_device_train_batch_size == 4  # from the YAML
    assert cfg.max_source_length == 128  # untouched default


def test_yaml_values_get_the_field_types(tmp_path):
    """YAML reads `5e-5` as a string; it must still mean the float, as on the command line."""
    path = write_yaml(
        tmp_path,
        "learning_rate: 5e-5\nmax_grad_norm: 1\nn_train: 100\npad_to_max_length: yes\nval_max_target_length: null\n",
    )
    cfg = parse_args(["--config", path])
    assert cfg.learning_rate == 5e-5 and isinstance(cfg.learning_rate, float)
    assert cfg.max_grad_norm == 1.0 and cfg.n_train == 100 and cfg.pad_to_max_length is True
    assert cfg.val_max_target_length == cfg.max_target_length


@pytest.mark.parametrize(
    "text, needle",
    [
        ("n_train: abc\n", "n_train"),
        ("per_device_train_batch_size: 2.5\n", "per_device_train_batch_size"),
        ("per_device_train_batch_size: true\n", "per_device_train_batch_size"),
        ("learning_rate: [1]\n", "learning_rate"),
        ("- learning_rate\n", "mapping"),
        ("learning_rate: [unclosed\n", "cannot read config"),
    ],
)
def test_yaml_bad_values_are_reported(text, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", write_yaml(tmp_path, text)])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_missing_yaml_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml" in capsys.readouterr().err


def test_bool_flags_seed_style():
    assert parse_args(["--pad_to_max_length"]).pad_to_max_length is True
    assert parse_args(["--pad_to_max_length", "true"]).pad_to_max_length is True
    assert parse_args(["--pad_to_max_length", "no"]).pad_to_max_length is False
    assert parse_args([]).pad_to_max_length is False


def test_defaults_are_valid():
    cfg = TrainConfig()
    assert cfg.val_max_target_length == cfg.max_target_length
    assert parse_args([]).to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "kwargs, argv, needle",
    [
        ({"per_device_train_batch_size": 0}, ["--per_device_train_batch_size", "0"], "per_device_train_batch_size"),
        ({"per_device_eval_batch_size": -1}, ["--per_device_eval_batch_size", "-1"], "per_device_eval_batch_size"),
        ({"gradient_accumulation_steps": 0}, ["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps"),
        ({"max_source_length": 0}, ["--max_source_length", "0"], "max_source_length"),
        ({"n_train": 0}, ["--n_train", "0"], "n_train"),
        ({"max_train_steps": 0}, ["--max_train_steps", "0"], "max_train_steps"),
        ({"learning_rate": 0.0}, ["--learning_rate", "0"], "learning_rate"),
        ({"push_to_hub": True}, ["--push_to_hub"], "hub_model_id"),
        ({"hub_model_id": "no-slash"}, ["--hub_model_id", "no-slash"], "hub_model_id"),
        ({"report_to": "mlflow"}, ["--report_to", "mlflow"], "report_to"),
        ({"train_file": "t.jsonl"}, ["--train_file", "t.jsonl"], "go together"),
        ({"dataset_name": None}, None, "dataset_name"),  # None cannot be typed on the command line
        ({"feedback_ratio": 0.0}, ["--feedback_ratio", "0"], "feedback_ratio must be > 0 and <= 1"),
        ({"feedback_ratio": 1.5}, ["--feedback_ratio", "1.5"], "feedback_ratio must be > 0 and <= 1"),
        ({"feedback_ratio": float("nan")}, ["--feedback_ratio", "nan"], "feedback_ratio must be > 0 and <= 1"),
        ({"feedback_validation_file": "h.jsonl"}, ["--feedback_validation_file", "h.jsonl"], "needs --feedback_file"),
        (
            {"val_min_target_length": 30, "max_target_length": 20},
            ["--val_min_target_length", "30", "--max_target_length", "20"],
            "val_min_target_length",
        ),
    ],
)
def test_post_init_rejects_bad_values(kwargs, argv, needle, capsys):
    with pytest.raises(ValueError, match=needle):
        TrainConfig(**kwargs)
    if argv is None:
        return
    # The same through the CLI: a usage error (exit 2) with the message, not a traceback.
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_feedback_flags():
    cfg = parse_args(["--feedback_file", "fb.jsonl", "--feedback_ratio", "1", "--feedback_validation_file", "h.jsonl"])
    assert (cfg.feedback_file, cfg.feedback_ratio, cfg.feedback_validation_file) == ("fb.jsonl", 1.0, "h.jsonl")
    assert (TrainConfig().feedback_file, TrainConfig().feedback_ratio) == (None, 0.5)


def test_valid_hub_and_tracker_settings_pass():
    cfg = TrainConfig(push_to_hub=True, hub_model_id="me/my-bot", report_to="all", with_tracking=True)
    assert cfg.hub_model_id == "me/my-bot"


def test_attention_choices_are_checked():
    from chat import model

    assert model.AUTO_ATTENTION in model.ATTENTION[1:]
    with pytest.raises(SystemExit):
        parse_args(["--attention", "flash_attention_2"])
    assert model.configure_attention("eager") == "eager"


# --------------------------------------------------------------------------- LoRA adapters


def test_adapter_flags_default_to_full_fine_tuning_and_parse():
    from chat.adapters import LORA_TARGETS

    cfg = TrainConfig()
    assert (cfg.adapter, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == ("none", 8, 16, 0.05)
    assert cfg.lora_target_modules == LORA_TARGETS
    flags = "--adapter lora --lora_r 16 --lora_alpha 32 --lora_dropout 0 --lora_target_modules q_proj,v_proj,,q_proj"
    cfg = parse_args(flags.split())
    assert (cfg.adapter, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == ("lora", 16, 32, 0.0)
    assert cfg.lora_target_modules == ("q_proj", "v_proj")  # order kept, blanks and repeats dropped
    assert json.loads(json.dumps(cfg.to_dict()))["lora_target_modules"] == ["q_proj", "v_proj"]
    assert TrainConfig(adapter="lora", lora_target_modules=["fc1", "fc2"]).lora_target_modules == ("fc1", "fc2")


def test_adapter_settings_from_yaml(tmp_path):
    path = write_yaml(tmp_path, "adapter: lora\nlora_r: 4\nlora_dropout: 1e-1\nlora_target_modules: [q_proj, fc2]\n")
    cfg = parse_args(["--config", path])
    assert (cfg.lora_r, cfg.lora_dropout, cfg.lora_target_modules) == (4, 0.1, ("q_proj", "fc2"))
    path = write_yaml(tmp_path, "adapter: lora\nlora_target_modules: q_proj, k_proj\n")  # text works too
    assert parse_args(["--config", path]).lora_target_modules == ("q_proj", "k_proj")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--adapter", "qlora"], "--adapter must be one of none, lora, got 'qlora'"),
        (["--adapter", "lora", "--lora_r", "0"], "--lora_r must be >= 1, got 0"),
        (["--adapter", "lora", "--lora_alpha", "0"], "--lora_alpha must be >= 1, got 0"),
        (["--adapter", "lora", "--lora_dropout", "1"], "--lora_dropout must be >= 0 and < 1, got 1.0"),
        (["--adapter", "lora", "--lora_dropout", "-0.1"], "--lora_dropout must be >= 0 and < 1"),
        (["--adapter", "lora", "--lora_dropout", "nan"], "--lora_dropout must be >= 0 and < 1"),
        (["--adapter", "lora", "--lora_r", "2.5"], "invalid int value"),
        (
            ["--adapter", "lora", "--lora_target_modules", "q_proj,query,lm_head"],
            "unknown module(s) query, lm_head; BlenderBot's are q_proj, k_proj, v_proj, out_proj, fc1, fc2",
        ),
        (["--adapter", "lora", "--lora_target_modules", ","], "--lora_target_modules needs at least one of"),
        (["--lora_r", "16"], "--lora_r needs --adapter lora"),
        (["--lora_target_modules", "q_proj"], "--lora_target_modules needs --adapter lora"),
    ],
)
def test_bad_adapter_settings_are_refused(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    "text, needle",
    [
        ("adapter: lora\nlora_target_modules: [q_proj, 3]\n", "must be module names"),
        ("adapter: lora\nlora_target_modules: {q_proj: 1}\n", "must be module names"),
        ("adapter: lora\nlora_target_modules: [attn]\n", "unknown module(s) attn"),
        ("adapter: lora\nlora_r: [1]\n", "lora_r"),
    ],
)
def test_bad_adapter_settings_in_yaml(text, needle, tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", write_yaml(tmp_path, text)])
    assert needle in capsys.readouterr().err
