"""bench/cpu_variants.py and its probes (bench/cpu_probes.py): the settings are the engine's, and the
smallest study runs end to end on the bundled demo model."""

import json

import pytest
import torch

from bench import cpu_probes as probes
from bench import cpu_variants as cv
from chat.engine import BASE_PREFIX, GENERATION_PRESETS, load_checkpoint
from chat.layout import DEMO_DIR
from chat.model import load_tokenizer


def test_decoding_is_the_engines_presets():
    assert probes.FAITHFUL is GENERATION_PRESETS["faithful"]
    beam = probes.decoding(probes.FAITHFUL, 24)
    assert beam == {**GENERATION_PRESETS["faithful"].generate_kwargs(), "min_new_tokens": 24, "max_new_tokens": 24}
    greedy = probes.decoding(probes.GREEDY, 24, forced=False)
    fast = GENERATION_PRESETS["fast"].generate_kwargs()
    assert (greedy["num_beams"], greedy["do_sample"]) == (fast["num_beams"], fast["do_sample"]) == (1, False)
    # plain greedy: the model's cost without the engine's n-gram blocking and repetition penalty
    assert greedy["no_repeat_ngram_size"] == greedy["encoder_no_repeat_ngram_size"] == 0
    assert greedy["repetition_penalty"] == 1.0 and (greedy["min_new_tokens"], greedy["max_new_tokens"]) == (0, 24)


def test_models_load_as_the_engine_serves_them():
    model, _ = probes.load(str(DEMO_DIR), "int8")
    engine = load_checkpoint(str(DEMO_DIR), optimize="int8").model
    assert model.generation_config.to_dict() == engine.generation_config.to_dict()
    assert type(model.model.encoder.layers[0].fc1) is type(engine.model.encoder.layers[0].fc1)  # quantized alike


def test_prompts_have_the_prefix_and_the_exact_length():
    tokenizer = load_tokenizer(str(DEMO_DIR))
    prefix = tokenizer(BASE_PREFIX, add_special_tokens=False).input_ids
    prompts = probes.build_prompts(tokenizer, 3, 64)
    assert len(prompts) == 3 and len({tuple(p[0].tolist()) for p in prompts}) == 3
    for ids in prompts:
        assert ids.shape == (1, 64) and ids[0, : len(prefix)].tolist() == prefix
        assert ids[0, -1].item() == tokenizer.eos_token_id


def test_smallest_study_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "cv.json"
    threads = torch.get_num_threads()
    study = ["--model", str(DEMO_DIR), "--variants", "none,int8@1", "--prompts", "2", "--reply_tokens", "4"]
    assert cv.main([*study, "--no_rss", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the study gives the thread count back
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert set(rows) == {f"none@{threads}", "int8@1"}
    ref = rows[f"none@{threads}"]
    assert ref["greedy_agree"] == ref["beam_agree"] == ref["teacher_forced_top1"] == 1.0
    for r in rows.values():
        assert 0 < r["first_token_p50"] <= r["greedy_p95"] and 0 < r["beam_p50"] <= r["beam_p95"]
        assert len(data["samples"][r["variant"]]["greedy"][0]["tokens"]) == 4  # forced to --reply_tokens
    assert set(data["demo_check"]) == {"none", "int8"} and data["demo_check"]["none"]["beam_identical"] == 1.0
    assert data["header"]["command"].startswith("python -m bench.cpu_variants --model")
    assert "| int8@1 |" in capsys.readouterr().out


def test_a_decoder_step_splits_into_linear_layers_other_operators_and_python():
    weights = {}
    for mode in ("none", "int8"):
        model, tokenizer = probes.load(str(DEMO_DIR), mode)
        split = probes.decoder_step_split(model, probes.build_prompts(tokenizer, 1, 32)[0], steps=3)
        assert min(split["step_ms"], split["linear_ms"], split["other_ops_ms"], split["outside_ops_ms"]) > 0
        assert split["linear_ms"] + split["other_ops_ms"] < split["profiled_step_ms"]
        weights[mode] = split["weight_mb_per_step"]
        if mode == "none":
            count = sum(p.numel() for p in [*model.get_decoder().layers.parameters(), *model.lm_head.parameters()])
            assert weights[mode] == pytest.approx(4 * count / 1e6)
    assert weights["int8"] == pytest.approx(weights["none"] / 4, rel=0.05)  # int8 linear weights: a byte each


def test_read_bandwidth_is_measured():
    assert 0.1 < probes.read_bandwidth_gbs(megabytes=16, repeats=2) < 10_000
