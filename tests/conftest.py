"""Shared fixtures: everything offline, the tiny preset built once per session."""

import os
from pathlib import Path

import pytest

try:  # a test requirement; a GPU host running only `-m gpu` tests may lack it
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover
    settings = None
if settings is not None:
    # Property tests check values, not speed: on a busy 2-core CI machine a slow example or a slow
    # data draw is noise, not a failure.
    settings.register_profile("project", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("project")

# Offline and isolated before any Hugging Face library is imported by a test module.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """The suite is the CPU's on any machine; ``pytest -m gpu`` runs the GPU's tests.

    Most tests check what the CPU serves (int8, rows quantized apart, a step loop's reply token for
    token generate()'s alone): on a GPU host they would load their models onto the GPU (the
    engine's default there) and check a path they were not written for. So unless the run selects
    the ``gpu`` tests alone, CUDA is hidden before anything initializes it, for the tests and the
    training runs they start (they inherit the environment)."""
    if (config.getoption("markexpr") or "").strip() == "gpu":
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if torch.cuda.is_available():  # initialized before this hook: the CPU tests would run on the GPU
        raise pytest.UsageError("CUDA was initialized before the tests; run the GPU's tests with -m gpu")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Build presets into a fresh cache so the tests exercise the build itself."""
    cache = tmp_path_factory.mktemp("persona-chat-cache")
    os.environ["PERSONA_CHAT_CACHE"] = str(cache)
    # The app's state (browser-state key, the served model's choice: webui/server_state.py), not the user's.
    os.environ["PERSONA_CHAT_STATE"] = str(tmp_path_factory.mktemp("persona-chat-state"))
    yield cache


@pytest.fixture(scope="session", autouse=True)
def _deepspeed_cpu_ops_built():
    """DeepSpeed's CPU ops built before any test starts a run: a test's time limit that killed a run
    while it built one left torch's lock file, and every later run in the session waited on it (CI
    timed out). setup.sh builds them; this covers a cache emptied since (or another venv's build)."""
    from finetune import cpu_ops

    if os.environ.get("CUDA_VISIBLE_DEVICES") != "":  # pytest_configure hides CUDA but for `-m gpu`
        return  # the GPU's tests use no CPU op
    if cpu_ops.unbuilt():
        cpu_ops.build()


@pytest.fixture(scope="module", autouse=True)
def _own_manager_roots():
    """Each test module sees only the runs roots of its own RunManagers: the process-wide set
    (finetune.jobs.paths.allow_root) would otherwise carry other tests' roots, and one of them with a
    corrupt run.json (the runs view's tests) rightly stops the upload cleaner from removing anything."""
    from finetune.jobs import paths

    before = set(paths._MANAGER_ROOTS)
    yield
    paths._MANAGER_ROOTS.intersection_update(before)


@pytest.fixture(scope="session")
def tiny_path(_isolated_cache):
    from chat.model import resolve

    return Path(resolve("tiny"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from chat.model import load_tokenizer

    return load_tokenizer(str(tiny_path))


# Tests that launch real training processes, servers or a browser (seconds to a minute each).
# `make fast` (pytest -m "not slow") skips them for development; CI runs everything.
SLOW_MODULES = {
    "test_train.py",
    "test_context_eval.py",  # evaluations of the demo model, a CLI run with a tracker
    "test_checkpoints.py",
    "test_lora_training.py",  # LoRA adapters: ZeRO-2 on 2 processes, resume, merge, continue
    "test_preference_training.py",  # DPO/KTO from the demo model: ZeRO-2 on 2 processes, LoRA, resume
    "test_faults.py",
    "test_write_failures.py",  # runs under a file-size limit and into a read-only folder
    "test_jobs_manager.py",
    "test_jobs_ranks.py",
    "test_app_train.py",
    "test_browser.py",
    "test_browser_train.py",  # the Train tab in a browser, desktop and phone, two tiny runs
    "test_browser_runs.py",  # the runs view: three CLI runs, listed, overlaid, served, deleted
    "test_browser_lora.py",  # a LoRA adapter trained from the Train tab, desktop and phone
    "test_browser_loop.py",  # issue 13's loop: chat, correct, accept, retrain, compare, vote
    "test_browser_chat.py",  # the Chat tab at desktop and phone sizes
    "test_browser_chat_state.py",  # saved chats' settings, the banner across two pages
    "test_browser_journeys.py",  # issue 28's journeys (items 7-15), desktop and phone
    "test_browser_adapters.py",  # two LoRA adapters on one base: picker, chat, Compare
    "test_attacks.py",
    "test_forged_addresses.py",  # two app start-ups, forged X-Forwarded-For (issue 28 item 1)
    "test_body_limits.py",  # 150 MB bodies against the running app (issue 28 item 2)
    "test_openai_api.py",  # the OpenAI-compatible API through the openai client (issue 26)
    "test_api_access.py",  # keys, fair share, 32 API streams at once
    "test_cpu_variants.py",
    "test_upload_limits.py",
    "test_text_hygiene.py",  # the app launched, every text endpoint attacked
    "test_browser_export.py",  # the review panel's export in Chromium
    "test_browser_preferences.py",  # issue 27's loop: like, dislike, correct, vote, accept, DPO, accuracy
}
SLOW_TESTS = {
    "test_python_app_py_without_the_hub_serves_the_demo_model_at_once",  # two app start-ups
    "test_smoke_run_measures_both_recipes",  # a CPU benchmark run
    "test_smoke_run_measures_lora_against_full",  # bench.train_lora's CPU smoke run
    "test_preference_bench_smoke",  # bench.train_preference's CPU smoke run (three CLI runs)
    "test_bench_smoke",
    "test_api_bench_smoke",  # starts python app.py
    "test_serve_smoke_engine_and_app",  # starts python app.py (bench.chat_serve)
    "test_served_app_rates_and_corrects_through_the_chat_events",  # an app start-up (test_feedback_chat.py)
    "test_32_clients_rating_at_once_each_find_their_row_exactly_once",
    "test_compare_through_the_launched_app",  # an app start-up
    "test_rescoring_with_the_runs_own_settings_gives_back_its_figure",  # an evaluation of the demo model
    "test_rescoring_with_the_apps_settings_records_the_figure_and_its_measure",  # (~40 s each on 2 cores)
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
