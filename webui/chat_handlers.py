"""What the web app's controls do, as plain functions (``app.py`` wires them to gradio).

Everything here can be called and tested without a browser or a server. The chat is stateless
per request: the UI's history (gradio's messages format) is turned into the engine's
``Conversation`` on every reply, so sessions can never see each other's turns.

No ``from __future__ import annotations`` here: ``gr.api`` reads the public endpoint's
signature from real type hints.
"""

import logging
import math
import os
import time
from dataclasses import fields, replace
from pathlib import Path

import gradio as gr

from chat.engine import (
    GENERATION_PRESETS,
    MAX_HISTORY_TURNS,
    Budget,
    ChatEngine,
    Conversation,
    GenerationSettings,
    InputError,
)
from chat.layout import DEFAULT_MODEL, DEMO_DIR, ROOT, is_hub_id
from chat.prompt import KINDS
from finetune.jobs.index import list_runs
from finetune.jobs.paths import runs_root
from finetune.jobs.status import saved_results
from finetune.measure import describe
from webui import server_state
from webui.model_scores import measured, model_bleu, model_label, same_measure, with_bleu

log = logging.getLogger(__name__)

# (label shown, value sent): the API and the chat function always get a value of KINDS.
KIND_CHOICES = list(zip(("Persona", "Emotion", "Task goal", "Topic", "None"), KINDS, strict=True))

PRESET_CHOICES = [("Fast (greedy, streams)", "fast"), ("Faithful (Chat-E: beam 10, min 20 tokens)", "faithful")]

CHAT_E_PERSONA = "My name is Chat-E. I'm helpful, creative, clever, sarcastic and very friendly."
# What the context box holds when the user picks a kind (Chat-E's own examples where it had one).
# Chat-E used "happy" for emotion, which is not one of the 32 EmpatheticDialogues labels the
# model was trained on; "joyful" is the nearest label. "happy" still works (custom value).
KIND_DEFAULTS = {"persona": CHAT_E_PERSONA, "emotion": "joyful", "task": "vacation ideas", "topic": "jazz", "none": ""}
CONTEXT_LABELS = {
    "persona": ("Persona", "Who the bot is, in a sentence or two."),
    "emotion": ("Emotion", "How the bot feels."),
    "task": ("Task goal", "What the bot helps with (a domain)."),
    "topic": ("Topic", "What the conversation is about."),
    "none": ("Context", "No context: the bot chats freely."),
}

# Examples for every kind (message, kind, context), Chat-E's three first.
EXAMPLES = [
    ["Hi! Who are you?", "persona", CHAT_E_PERSONA],
    ["I just got some great news!", "emotion", "joyful"],
    ["Where should I go this summer?", "task", "vacation ideas"],
    ["Who is your favourite musician?", "topic", "jazz"],
    ["Hello! What do you like to do for fun?", "none", ""],
]

# What the chat shows for each example (in the empty chat, above the message box).
_KIND_NAMES = {value: label for label, value in KIND_CHOICES} | {"none": "No context"}
EXAMPLE_LABELS = [f"{_KIND_NAMES[kind]}: {message}" for message, kind, _ in EXAMPLES]
SEED_MAX = 2**31 - 1
NOTICE_KEY = "persona-chat-notice"


def base_model() -> str:
    return os.environ.get("CHAT_MODEL") or DEFAULT_MODEL


# --------------------------------------------------------------------------- conversation


def _text(content) -> str:
    """The text of one message's content: a string, or gradio's list of parts (files skipped)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return content.get("text", "") if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return " ".join(t for t in (_text(part) for part in content) if t)
    return ""


def is_notice(message: dict) -> bool:
    """A note from the app (refused input, empty reply), not something the bot said."""
    metadata = message.get("metadata") or {}
    return bool(metadata.get("title")) or metadata.get("id") == NOTICE_KEY


def model_note(before: str, now: str) -> dict:
    """The chat's note after the first reply of a new model: another page swapped the served model
    during this conversation (the replies above it came from ``before``). An app note: never fed to
    the model, never rated."""
    return {
        "role": "assistant",
        "content": f"The replies before this one came from {model_label(before)}; {model_label(now)} answers from "
        "here on (a trainer loaded it: the model is the same for everyone).",
        "metadata": {"title": f"ℹ️ The model changed: now {model_label(now)}", "id": NOTICE_KEY, "status": "done"},
    }


def notice(text: str) -> dict:
    """A bot-side chat message that tells the user something and is never fed to the model."""
    return {
        "role": "assistant",
        "content": "Nothing was sent to the model.",
        "metadata": {"title": f"⚠️ {text}", "id": NOTICE_KEY, "status": "done"},
    }


def history_to_turns(history) -> list[str]:
    """gradio's messages (``[{"role", "content"}, ...]``) -> ``Conversation.turns``, oldest first.

    Keeps the dialogue alternating: a user message the bot never answered (refused, stopped
    before the first token, failed) is dropped, app notices are dropped with the message they
    answer, consecutive bot messages are joined, and system messages and files are ignored.
    """
    if isinstance(history, (list, tuple)) and len(history) > 2 * MAX_HISTORY_TURNS:  # bounded work up front
        raise InputError(
            f"The conversation is too long ({len(history)} messages; the limit is "
            f"{MAX_HISTORY_TURNS} turns). Start a new chat."
        )
    turns: list[str] = []
    pending: str | None = None  # a user message waiting for its reply
    last_role = None
    for message in history or []:
        if not isinstance(message, dict):
            raise InputError("history must be a list of {'role', 'content'} messages")
        role, text = message.get("role"), " ".join(_text(message.get("content")).split())
        if role == "user":
            if text:
                pending = text  # an unanswered earlier message is replaced
        elif role == "assistant":
            if is_notice(message):
                pending = None
                continue
            if not text:
                continue
            if pending is not None:
                turns += [pending, text]
                pending, last_role = None, "assistant"
            elif last_role == "assistant":
                turns[-1] += " " + text
            else:  # the bot spoke first (a greeting)
                turns.append(text)
                last_role = "assistant"
    return turns


# --------------------------------------------------------------------------- settings


def preset_values(preset: str) -> tuple[int, bool, float, float, int]:
    """The generation-settings controls' values for a preset (beams, sample, temp, top-p, max new)."""
    s = GENERATION_PRESETS.get(preset, GENERATION_PRESETS["fast"])
    return s.num_beams, s.do_sample, s.temperature, s.top_p, s.max_new_tokens


def settings_from_inputs(preset, beams, sample, temperature, top_p, max_new_tokens, seed) -> GenerationSettings:
    """The preset, overridden by the controls. Seed 0 (or empty) means a random seed."""
    if preset not in GENERATION_PRESETS:
        raise InputError(f"Unknown preset {preset!r}; choose one of {', '.join(GENERATION_PRESETS)}.")
    base = GENERATION_PRESETS[preset]
    try:
        max_new = int(max_new_tokens if max_new_tokens is not None else base.max_new_tokens)
        seed = int(seed or 0)
        settings = replace(
            base,
            num_beams=int(beams if beams is not None else base.num_beams),
            do_sample=bool(sample) if sample is not None else base.do_sample,
            temperature=float(temperature if temperature is not None else base.temperature),
            top_p=float(top_p if top_p is not None else base.top_p),
            max_new_tokens=max_new,
            # "faithful" asks for at least 20 tokens; a smaller max wins over that minimum.
            min_new_tokens=max(0, min(base.min_new_tokens, max_new)),
            seed=seed or None,
        )
    except (TypeError, ValueError) as err:
        if isinstance(err, InputError):
            raise
        raise InputError(f"Invalid generation setting: {err}") from None
    if settings.seed is not None and not 0 < settings.seed <= SEED_MAX:
        raise InputError(f"seed must be between 0 (random) and {SEED_MAX}")
    return settings


SETTING_FIELDS = tuple(f.name for f in fields(GenerationSettings))


def _setting_value(name: str, value, kind: type):
    """A JSON value for a GenerationSettings field, checked and converted to the field's type."""
    if name == "seed" and value is None:
        return None
    if kind is bool:
        if not isinstance(value, bool):
            raise InputError(f"Setting {name} must be true or false.")
        return value
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (kind is int and value != int(value))
    ):
        raise InputError(f"Setting {name} must be {'an integer' if kind is int else 'a number'}.")
    return kind(value)


def settings_from_api(preset: str = "fast", overrides: dict | None = None) -> GenerationSettings:
    """The API's settings: a preset plus any GenerationSettings fields by name."""
    if preset not in GENERATION_PRESETS:
        raise InputError(f"Unknown preset {preset!r}; choose one of {', '.join(GENERATION_PRESETS)}.")
    if overrides is not None and not isinstance(overrides, dict):
        raise InputError("settings must be an object of generation settings by name.")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(SETTING_FIELDS))
    if unknown:
        raise InputError(f"Unknown settings {', '.join(unknown)}; known: {', '.join(SETTING_FIELDS)}.")
    for name, value in overrides.items():
        overrides[name] = _setting_value(
            name, value, int if name == "seed" else type(getattr(GENERATION_PRESETS[preset], name))
        )
    if overrides.get("seed") == 0:
        overrides["seed"] = None
    if overrides.get("seed") is not None and not 0 < overrides["seed"] <= SEED_MAX:
        raise InputError(f"seed must be between 0 (random) and {SEED_MAX}")
    if "max_new_tokens" in overrides and "min_new_tokens" not in overrides:
        overrides["min_new_tokens"] = max(
            0, min(GENERATION_PRESETS[preset].min_new_tokens, overrides["max_new_tokens"])
        )
    try:
        return replace(GENERATION_PRESETS[preset], **overrides)
    except InputError:
        raise
    except (TypeError, ValueError) as err:
        raise InputError(f"Invalid generation setting: {err}") from None


def meter_text(budget: Budget | None) -> str:
    """How the encoder's positions were used by the last reply's input."""
    if budget is None:
        return "Token budget: shown after the first reply."
    dropped = budget.dropped_turns
    return (
        f"context {budget.context_tokens} + history {budget.history_tokens} = "
        f"{budget.total_tokens} / {budget.max_tokens} tokens; "
        f"{dropped} old turn{'' if dropped == 1 else 's'} dropped"
    )


# --------------------------------------------------------------------------- chat


def chat_fn(engine: ChatEngine):
    """The ``gr.ChatInterface`` function: yields (reply so far, token meter)."""

    def respond(
        message,
        history,
        kind="none",
        context="",
        preset="fast",
        beams=None,
        sample=None,
        temperature=None,
        top_p=None,
        max_new_tokens=None,
        seed=0,
    ):
        try:
            settings = settings_from_inputs(preset, beams, sample, temperature, top_p, max_new_tokens, seed)
            conv = Conversation(kind or "none", context or "", history_to_turns(history))
            text, budget = "", None
            for text, budget in engine.stream(conv, message if isinstance(message, str) else _text(message), settings):
                yield text, meter_text(budget)
        except InputError as err:  # the engine refused before any model call
            gr.Warning(str(err))
            yield notice(str(err)), gr.skip()
            return
        except Exception as err:
            log.exception("reply failed")
            raise gr.Error(f"The model could not reply ({type(err).__name__}: {err}).") from None
        if not text:
            yield notice("The model gave an empty reply; try again, or change the settings."), meter_text(budget)

    return respond


MAX_MODEL_ID_CHARS = 200


def api_chat_fn(engine: ChatEngine):
    """The public ``/chat`` endpoint: stateless, returns (streams) the reply text and the id of the
    model that wrote it (passed back as ``model``, it keeps the conversation on that model)."""

    def chat(
        message: str,
        kind: str = "none",
        context: str = "",
        preset: str = "fast",
        history: list[str] | None = None,
        settings: dict | None = None,
        model: str = "",
    ) -> tuple[str, str]:
        """Reply to `message` as the bot described by `kind` and `context`.

        Args:
            message: the user's message
            kind: persona, emotion, task, topic or none
            context: the persona sentence(s), emotion label, task goal or topic ("" for none)
            preset: fast (greedy, streams) or faithful (beam 10, as Chat-E)
            history: the conversation so far, oldest first, alternating user and bot (ends with the bot's last reply)
            settings: overrides of the preset's generation settings, e.g. {"num_beams": 4, "seed": 1}
            model: the id of the model to talk to, as an earlier reply returned it ("" = the model serving now)
        Returns:
            the reply, and the id of the model that wrote it: pass it as `model` to continue with that model
        """
        try:
            if history is not None and (not isinstance(history, list) or not all(isinstance(t, str) for t in history)):
                raise InputError("history must be a list of strings (the turns so far, oldest first).")
            if not isinstance(message, str) or not isinstance(context or "", str):
                raise InputError("message and context must be strings.")
            if not isinstance(model or "", str) or len(model or "") > MAX_MODEL_ID_CHARS:
                raise InputError(f"model must be a model id (text of at most {MAX_MODEL_ID_CHARS} characters).")
            conv = Conversation(kind or "none", context or "", list(history or []), model=model or None)
            # The conversation's model, or for a new one the model serving now.
            loaded, stream = engine.open_stream(conv, message, settings_from_api(preset, settings))
            for text, _ in stream:
                yield text, loaded.id
        except InputError as err:
            raise gr.Error(str(err), print_exception=False) from None
        except Exception as err:
            log.exception("reply failed")
            raise gr.Error(f"The model could not reply ({type(err).__name__}: {err}).") from None

    return chat


# --------------------------------------------------------------------------- models


def serving_markdown(engine: ChatEngine, loaded=None) -> str:
    """The serving banner: the engine's current model, or ``loaded`` (the one that wrote a reply)."""
    current = engine.current
    loaded = loaded or current
    detail = f"input: prefix `{loaded.prefix.strip() or '(none)'}`, up to {loaded.max_source_length} tokens"
    if loaded is current and engine.status.startswith("offline"):  # the status describes the current model
        status = engine.status[0].upper() + engine.status[1:]
        return f"⚠️ **{status}.** Its replies show that the pipeline works, not chat quality. ({detail})"
    return f"✅ **Serving {model_label(loaded.name)}** ({detail})"


def _checkpoint_label(final: Path, serving: str | None = None, record=None) -> str:
    label = with_bleu(model_label(str(final)), str(final), serving)
    if record is not None and record.context_hits is not None:
        label += f" · context {record.context_hits:.2f}"
    if record is not None and record.label:  # the name given in the runs view
        label = f"{record.label} · {label}"
    return label + time.strftime(" · %Y-%m-%d %H:%M", time.localtime(final.stat().st_mtime))


def picker_choices(
    root: Path | str | None = None, base: str | None = None, current: str | None = None
) -> list[tuple[str, str]]:
    """The model picker's (label, spec) choices: base model, demo model, finished checkpoints and
    LoRA adapters (newest first), and the model being served if it is none of those."""
    base = base or base_model()
    demo = str(DEMO_DIR)
    choices = [(f"{model_label(base)} (base model)", base), (with_bleu(model_label(demo), demo, current), demo)]
    root = root if root is not None else runs_root()
    # The runs view's index: the finished runs, with their names and scores.
    runs = {r.final_dir: r for r in list_runs(root) if r.final_dir}
    finals = sorted(map(Path, runs), key=lambda p: p.stat().st_mtime, reverse=True)
    choices += [(_checkpoint_label(p, current, runs[str(p)]), str(p)) for p in finals]
    seen, unique = set(), []
    for label, spec in choices:
        key = str(Path(spec).resolve()) if Path(spec).exists() else spec
        if key not in seen:
            seen.add(key)
            unique.append((label, spec))
    if (
        current
        and current not in {spec for _, spec in unique}
        and (not Path(current).exists() or str(Path(current).resolve()) not in seen)
    ):
        unique.insert(0, (f"{model_label(current)} (serving)", current))
    return unique


def current_choice(engine: ChatEngine, choices: list[tuple[str, str]]) -> str | None:
    """The picker value that names the model being served."""
    name = engine.current.name
    for _, spec in choices:
        if spec == name or (
            Path(spec).exists() and Path(name).exists() and Path(spec).resolve() == Path(name).resolve()
        ):
            return spec
    return None


def refresh_models(engine: ChatEngine, root: Path | str | None = None, keep_value: bool = False):
    """The picker with the current choices, showing the served model (or, with ``keep_value``,
    what the user picked: after a Load that asked for confirmation, the model to confirm)."""
    choices = picker_choices(root, current=engine.current.name)
    if keep_value:
        return gr.update(choices=choices)
    return gr.update(choices=choices, value=current_choice(engine, choices))


def spec_to_load(choice: str | None, hub_id: str | None, choices: list[tuple[str, str]]) -> str:
    """The model to load: the Hub id typed by the user if any, else the picker's choice, which
    must be one of ``choices`` (a request can send any string; local folders come only from the list)."""
    hub_id = (hub_id or "").strip()
    if hub_id:
        if not is_hub_id(hub_id, owner=True):
            raise InputError(f"{hub_id!r} is not a Hub model id (expected owner/name).")
        if Path(hub_id).exists() or (ROOT / hub_id).exists():  # "chat/demo_model" would load that folder
            raise InputError(f"{hub_id!r} is a folder on this server, not a Hub id; pick models here from the list.")
        return hub_id
    if not choice:
        raise InputError("Pick a model or type a Hub id first.")
    if choice not in {spec for _, spec in choices}:
        raise InputError("That model is not in the list; press Refresh and pick one.")
    return choice


def load_model(
    engine: ChatEngine, choice: str | None, hub_id: str | None, root: Path | str | None = None, confirmed=None
):
    """Swap the served model; yields (a note for the line under the Load button, the model a
    second Load confirms). On failure the current model keeps serving and the note says why. A
    model whose saved BLEU is below the serving one's is loaded only when asked twice
    (``confirmed`` is the spec the previous Load warned about)."""
    try:
        spec = spec_to_load(choice, hub_id, picker_choices(root, current=engine.current.name))
    except InputError as err:
        yield f"⚠️ {err}", None
        return
    # Only figures measured the same way are compared (finetune.measure): the demo model's 60.0 with a
    # minimum length of 1 against a retrained run's 22.8 with 20 asked for a second Load after every retrain.
    previous = engine.current.name
    target, serving = model_bleu(spec), model_bleu(previous)
    same_way = same_measure(spec, previous)
    if target is not None and serving is not None and same_way and target < serving and confirmed != spec:
        yield (
            f"⚠️ {model_label(spec)} scored BLEU {target:.1f} on its validation data, below the serving model's "
            f"{serving:.1f} (both on {describe(measured(spec), saved_results(spec).get('eval_samples'))}). "
            "Press **Load** again to serve it anyway.",
            spec,
        )
        return
    yield f"⏳ Loading {model_label(spec)} … (the current model keeps serving until it is ready)", None
    try:
        engine.swap(spec)
    except Exception as err:  # noqa: BLE001 - any failure leaves the served model as it was
        log.warning("cannot load %s: %s", spec, err)
        why = str(err).replace(str(Path(spec).resolve()), model_label(spec)).replace(spec, model_label(spec))
        yield f"⚠️ Could not load {model_label(spec)}: {why}", None
        return
    server_state.save_serving(spec)  # a restart serves it again
    unlike = target is not None and serving is not None and not same_way
    yield (
        f"✅ Now serving {model_label(spec)}."
        + (
            f" (Its BLEU {target:.1f} and the previous model's {serving:.1f} were measured differently, "
            "so they were not compared: see the note under the list.)"
            if unlike
            else ""
        ),
        None,
    )
