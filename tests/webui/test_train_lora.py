"""The Train tab's LoRA choice (webui/train_lora.py, webui/train_handlers.py, webui/train_preflight.py),
without a browser: the exact flags Show command prints, the pre-flight line's trainable weights and
memory, a finished adapter as the base, the CPU rules, and pushing the adapter or the merged model."""

import re
import shlex
import sys
from pathlib import Path

import gradio as gr
import pytest
from test_train_handlers import H200, form, gpu_tab, logged_in, preflight, tab  # noqa: F401 (fixture)

from chat.adapters import LORA_TARGETS
from chat.engine import DEFAULT_MODEL
from finetune import memory
from finetune.config import parse_args
from webui import train_handlers, train_lora

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "finetune"))
from test_lora import random_adapter, save_adapter  # noqa: E402


def lora_form(tab, **changes):  # noqa: F811 (tab: the fixture)
    lora = {"adapter": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": ["q_proj", "v_proj"]}
    return form(tab, **{**lora, **changes})


def shown_flags(tab, values) -> list[str]:  # noqa: F811
    """The training flags of the command Show command prints (one flag a line, comments first)."""
    shown = train_handlers.show_command(tab, None, values)
    command = " ".join(line.rstrip("\\") for line in shown.splitlines() if not line.startswith("#"))
    words = shlex.split(command)
    return words[words.index("finetune") + 1 :]


def test_the_form_starts_with_full_fine_tuning_and_every_module(tab):  # noqa: F811
    values = train_handlers.default_form(tab)
    assert (values["adapter"], values["lora_r"], values["lora_alpha"]) == ("none", 8, 16)
    assert tuple(values["lora_target_modules"]) == LORA_TARGETS
    assert [value for _, value in train_lora.MODULE_CHOICES] == list(LORA_TARGETS)


def test_show_command_prints_the_lora_flags_start_would_run(tab):  # noqa: F811
    flags = shown_flags(tab, lora_form(tab))
    at = flags.index("--adapter")
    assert flags[at : at + 10] == ["--adapter", "lora", "--lora_r", "16", "--lora_alpha", "32"] + [
        *("--lora_dropout", "0.05", "--lora_target_modules", "q_proj,v_proj")
    ]
    cfg = parse_args(flags)
    assert (cfg.adapter, cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules) == ("lora", 16, 32, ("q_proj", "v_proj"))
    # full fine-tuning says so, and the hidden LoRA fields do not reach the command
    full = shown_flags(tab, form(tab, lora_r=64, lora_target_modules=["fc1"]))
    cfg = parse_args(full)
    assert (cfg.adapter, cfg.lora_r, cfg.lora_target_modules) == ("none", 8, LORA_TARGETS)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"lora_target_modules": []}, "pick at least one module"),
        ({"lora_r": 0}, "--lora_r must be >= 1"),
        ({"lora_r": 2.5}, "lora_r must be a whole number"),
        ({"lora_alpha": None}, "lora_alpha is required"),
        ({"lora_target_modules": ["q_proj", "lm_head"]}, "unknown module(s) lm_head"),
        ({"adapter": "qlora"}, "what to train must be 'none' or 'lora'"),
    ],
)
def test_bad_lora_fields_are_refused_with_a_message(tab, changes, message):  # noqa: F811
    with pytest.raises(ValueError, match=re.escape(message)):
        train_handlers.spec_from_form(tab, lora_form(tab, **changes), None)
    assert train_handlers.show_command(tab, None, lora_form(tab, **changes)).startswith("# no command: ")


def test_on_the_cpu_lora_trains_any_base_and_full_fine_tuning_only_small_ones(tab):  # noqa: F811
    spec = train_handlers.spec_from_form(tab, lora_form(tab, model_name_or_path=DEFAULT_MODEL), None)
    assert spec.config.adapter == "lora" and spec.num_gpus == 0
    with pytest.raises(ValueError, match="fully fine-tuning .* needs a GPU"):
        train_handlers.spec_from_form(tab, form(tab, model_name_or_path=DEFAULT_MODEL), None)


def test_a_finished_adapter_run_as_base_is_trained_further_as_it_is(tab):  # noqa: F811
    final = tab.manager.root / "20250101-000000-abcdef" / "final"
    save_adapter(random_adapter(), final)
    (final.parent / "run.json").write_text("{}")
    assert (f"continue from run {final.parent.name} (LoRA adapter)", str(final)) in train_handlers.base_model_choices(
        tab
    )
    # whatever the form's LoRA fields say (or full fine-tuning), the adapter keeps its own settings
    for values in (lora_form(tab, model_name_or_path=str(final)), form(tab, model_name_or_path=str(final))):
        spec = train_handlers.spec_from_form(tab, values, None)
        assert (spec.config.adapter, spec.config.lora_r, spec.config.lora_alpha) == ("lora", 4, 8)
    flags = shown_flags(tab, form(tab, model_name_or_path=str(final)))
    assert parse_args(flags).adapter == "lora"  # the command says it too


def test_preflight_counts_the_trainable_weights_and_the_memory_of_a_frozen_base(tab, monkeypatch):  # noqa: F811
    monkeypatch.setenv("PERSONA_CHAT_CACHE", str(tab.data_root.parent / "no-presets"))  # the 400M recipe, not built
    gpu = gpu_tab(tab)
    run = {
        "model_name_or_path": "random-400M",
        "num_gpus": 1,
        "precision": "bf16",
        "per_device_train_batch_size": "800",
    }
    shape = memory.ModelShape.local("random-400M")
    trained = shape.lora_params(8, LORA_TARGETS)
    assert trained == 8 * sum(i + o for _, i, o, _ in shape.projections())
    line = preflight(gpu, **run, adapter="lora")
    share = f"{100 * trained / shape.params:.2f}%"
    assert line.startswith(f"🧮 **Pre-flight:** LoRA trains {trained / 1e6:.1f}M of {shape.params / 1e6:.1f}M weights")
    assert share in line
    full = memory.estimate(shape, 800, memory.Setup("zero2", "bf16", 1), H200[1])
    fused = memory.Setup("zero2", "bf16", 1, lora_r=8, lora_targets=LORA_TARGETS)  # the default, fused layers
    lora = memory.estimate(shape, 800, fused, H200[1])
    assert memory.preflight_line(lora) in line
    # no fp32 copy or Adam state for the frozen base (12 bytes a weight, ZeRO-2 on one GPU), the adapter's 2 + 12 more
    saved = 12 * (shape.params - trained) - 2 * trained
    assert full.static_gib - lora.static_gib == pytest.approx(saved / 2**30, rel=1e-6)
    assert lora.peak_gib < full.peak_gib
    # peft's own layer keeps a dropped copy of each wrapped projection's input: more memory than full fine-tuning
    stock = memory.Setup("zero2", "bf16", 1, lora_r=8, lora_targets=LORA_TARGETS, lora_dropout=0.05)
    assert memory.estimate(shape, 800, stock, H200[1]).per_row_gib > full.per_row_gib
    # on the CPU the line says what trains too
    assert "LoRA trains " in preflight(tab, adapter="lora") and "CPU run" in preflight(tab, adapter="lora")


def test_push_sends_the_adapter_or_on_request_the_merged_model(tab, monkeypatch):  # noqa: F811
    run = tab.manager.root / "20250101-000000-abcdef"
    save_adapter(random_adapter(), run / "final")
    (run / "run.json").write_text('{"run_id": "20250101-000000-abcdef", "spec": {}, "argv": []}')
    (run / "metrics.jsonl").write_text('{"event": "start"}\n{"event": "done", "step": 1}\n')
    sent = []
    monkeypatch.setattr("finetune.hub.push", lambda folder, repo, private=False: sent.append(folder) or f"hf/{repo}")
    assert tab.manager.status().state == "finished"
    session = logged_in(tab)
    assert train_handlers.push_run(tab, session, None, "me/bot", False) == f"⬆️ Pushed run **{run.name}** to hf/me/bot"
    assert sent[-1] == run / "final"
    said = train_handlers.push_run(tab, session, None, "me/bot-full", False, merged=True)
    assert said == f"⬆️ Pushed run **{run.name}** (merged into its base) to hf/me/bot-full"
    assert sent[-1] == run / "merged" and (run / "merged" / "model.safetensors").is_file()
    with pytest.raises(gr.Error, match="log in first"):
        train_handlers.push_run(tab, None, None, "me/bot", False, merged=True)
