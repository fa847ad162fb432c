"""An OpenAI chat-completions request -> the chat's own terms (``Completion``), or a refusal.

- ``messages``: ``system`` (or ``developer``) messages first: the context (persona sentences, an
  emotion label, a task goal or a topic; several are joined); then ``user`` and ``assistant``
  turns, alternating, ending with the user's. Text only: a string, or text parts.
- ``kind`` (an extra body field, ``extra_body`` in the openai client): persona, emotion, task,
  topic or none; without it a system message means persona and none means none.
- ``preset`` (extra field): fast (greedy, streams) or faithful (beam 10, as Chat-E); the request's
  own parameters override it: ``max_tokens`` / ``max_completion_tokens`` (1-128), ``temperature``
  (0: the preset's deterministic decoding; 0.05-2: sampling), ``top_p`` (0.05-1: sampling, at the
  preset's temperature unless one is given), ``seed``, ``stop`` (up to 4 strings), ``stream``,
  ``stream_options.include_usage``, ``n`` = 1, ``user`` (accepted, unused).
- Anything else the bot cannot honour is refused (400, or 404 for an unknown model), never
  silently ignored; fields a client sends empty (null, [], {}, false, 0, as SDKs echo a previous
  reply's message) ask for nothing and pass.

All of this is checked before any work: the body is already bounded (``api.limits``); the message
count and every length are bounded here, the rest by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from api.errors import APIError, bad_request
from chat.engine import (
    GENERATION_PRESETS,
    MAX_CONTEXT_CHARS,
    MAX_HISTORY_TURNS,
    MAX_MESSAGE_CHARS,
    Conversation,
    GenerationSettings,
    InputError,
)
from chat.prompt import KINDS

MAX_SYSTEM_MESSAGES = 8
MAX_MESSAGES = MAX_HISTORY_TURNS + 1 + MAX_SYSTEM_MESSAGES  # the turns so far, the new one, the context
MAX_STOPS, MAX_STOP_CHARS = 4, 64
MAX_USER_CHARS = 256
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts
MAX_NEW_TOKENS = 128  # GenerationSettings' bound: BlenderBot's replies are short
OURS = {"kind", "preset"}  # the app's extra fields
SUPPORTED = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
}
# What the bot cannot do, and why: refused unless the field asks for nothing (see ``_asks``).
UNSUPPORTED = {
    "tools": "this bot has no tools",
    "tool_choice": "this bot has no tools",
    "parallel_tool_calls": "this bot has no tools",
    "functions": "this bot has no functions",
    "function_call": "this bot has no functions",
    "logprobs": "log probabilities are not returned",
    "top_logprobs": "log probabilities are not returned",
    "logit_bias": "token biases are not supported",
    "presence_penalty": "use the preset's n-gram blocking instead",
    "frequency_penalty": "use the preset's n-gram blocking instead",
    "response_format": "replies are plain text",
    "modalities": "replies are text only",
    "audio": "replies are text only",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this is not a reasoning model",
    "verbosity": "reply length is set by max_tokens and the preset",
    "web_search_options": "this bot does not search the web",
    "store": "completions are not stored",
    "metadata": "completions are not stored",
    "service_tier": "there is one service tier",
    "prompt_cache_key": "prompts are not cached",
    "safety_identifier": "not used by this server",
}
# Values that ask for nothing: what SDKs send by default or echo from a previous reply's message.
NOTHING = (False, 0, 0.0, "", "none", "auto", "default", [], {}, ["text"], {"type": "text"})
CONTEXT_NAMES = {"persona": "persona sentences", "emotion": "emotion label", "task": "task goal", "topic": "topic"}


@dataclass(frozen=True)
class Completion:
    """A request in the chat's terms: what ``ChatEngine.replies`` takes, and how to answer."""

    model: str
    conversation: Conversation
    message: str
    settings: GenerationSettings
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()


def _asks(value) -> bool:
    """Does a field's value ask for something (not null, false, 0, empty, "none"/"auto", text)?"""
    return value is not None and not any(type(value) is type(n) and value == n for n in NOTHING)


def _text(content, where: str) -> str:
    """A message's text: a string, or a list of text parts (anything else is refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts.", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}.content[{j}]: {kind or 'this'} content is not supported; this bot reads text only.",
                f"{where}.content[{j}]",
                "unsupported_content",
            )
        texts.append(part["text"])
    return " ".join(texts)


def _conversation(messages, kind) -> tuple[Conversation, str]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} messages.", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(
            f"Too many messages ({len(messages)}; the limit is {MAX_MESSAGES}). The model reads only the "
            "newest turns: send those.",
            "messages",
            "too_many_messages",
        )
    system, turns, roles = [], [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with a role and content.", where)
        role = message.get("role")
        if role in ("tool", "function"):
            raise bad_request(f"{where}: {role} messages are not supported; this bot has no tools.", f"{where}.role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad_request(f"{where}.role must be system, user or assistant, not {role!r}.", f"{where}.role")
        for key, value in message.items():
            if key not in ("role", "content") and _asks(value):
                raise bad_request(f"{where}.{key} is not supported by this server.", f"{where}.{key}")
        text = _text(message.get("content"), where)
        if role in ("system", "developer"):
            if turns:
                raise bad_request(f"{where}: system messages come first, before the conversation.", f"{where}.role")
            if len(system) == MAX_SYSTEM_MESSAGES:
                raise bad_request(f"At most {MAX_SYSTEM_MESSAGES} system messages.", f"{where}.role")
            system.append(text.strip())
        else:
            if roles and roles[-1] == role:
                raise bad_request(f"{where}: user and assistant messages must alternate.", f"{where}.role")
            if len(text) > MAX_MESSAGE_CHARS:
                raise bad_request(
                    f"{where}.content is too long ({len(text)} characters; the limit is {MAX_MESSAGE_CHARS}).",
                    f"{where}.content",
                    "message_too_long",
                )
            turns.append(text)
            roles.append(role)
    if not roles or roles[-1] != "user":
        raise bad_request("The last message must be the user's: the bot replies to it.", "messages")
    context = " ".join(t for t in system if t)
    if len(context) > MAX_CONTEXT_CHARS:
        raise bad_request(
            f"The system messages are too long ({len(context)} characters; the limit is {MAX_CONTEXT_CHARS}).",
            "messages",
            "context_too_long",
        )
    if kind is None:
        kind = "persona" if context else "none"
    elif kind not in KINDS:
        raise bad_request(f"kind must be one of {', '.join(KINDS)}, not {kind!r}.", "kind")
    if kind == "none" and context:
        raise bad_request("kind none takes no context: leave out the system message, or pick another kind.", "kind")
    if kind != "none" and not context:
        raise bad_request(f"kind {kind} needs a system message: the {CONTEXT_NAMES[kind]}.", "messages")
    return Conversation(kind, context, turns[:-1]), turns[-1]


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request(f"{name} must be an integer from {low} to {high}.", name)
    return value


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number.", name)
    return float(value)


def _settings(body: dict) -> GenerationSettings:
    preset = body.get("preset", "fast")
    if preset not in GENERATION_PRESETS:
        raise bad_request(f"preset must be one of {', '.join(GENERATION_PRESETS)}, not {preset!r}.", "preset")
    base, changes = GENERATION_PRESETS[preset], {}
    most = _integer(body, "max_completion_tokens", 1, MAX_NEW_TOKENS)
    tokens = _integer(body, "max_tokens", 1, MAX_NEW_TOKENS)
    if most is not None and tokens is not None and most != tokens:
        raise bad_request("max_tokens and max_completion_tokens differ: send one.", "max_tokens")
    most = most if most is not None else tokens
    if most is not None:  # "faithful" asks for at least 20 tokens; a smaller max wins, as in the chat
        changes.update(max_new_tokens=most, min_new_tokens=min(base.min_new_tokens, most))
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    if temperature is not None:
        if temperature == 0:
            changes["do_sample"] = False
        elif 0.05 <= temperature <= 2:
            changes.update(do_sample=True, temperature=temperature)
        else:
            why = "temperature must be 0 (the preset's deterministic decoding) or from 0.05 to 2."
            raise bad_request(why, "temperature")
    if top_p is not None:
        if not 0.05 <= top_p <= 1:
            raise bad_request("top_p must be from 0.05 to 1.", "top_p")
        changes["top_p"] = top_p
        if temperature is None:
            changes["do_sample"] = True
    seed = _integer(body, "seed", *SEED_RANGE)
    if seed is not None:
        changes["seed"] = seed
    try:
        return replace(base, **changes)
    except InputError as err:
        raise bad_request(str(err)) from None


def _stops(stop) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return ()
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        why = f"stop must be a string or a list of up to {MAX_STOPS} strings of 1-{MAX_STOP_CHARS} characters."
        raise bad_request(why, "stop")
    return tuple(stops)


def parse(body, models: list[str]) -> Completion:
    """The request ``body`` (parsed JSON) as a ``Completion``; ``models``: the servable ids."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    for name in body:
        if name not in SUPPORTED | OURS | UNSUPPORTED.keys():
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
        if name in UNSUPPORTED and _asks(body[name]):
            raise bad_request(f"{name} is not supported: {UNSUPPORTED[name]}.", name, "unsupported_parameter")
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise bad_request("n must be 1: this server returns one choice per request.", "n", "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("You must provide a model parameter (GET /v1/models lists them).", "model")
    if model not in models:
        raise APIError(
            404,
            f"The model `{model}` does not exist here; this server serves: {', '.join(models)}.",
            param="model",
            code="model_not_found",
        )
    conversation, message = _conversation(body.get("messages"), body.get("kind"))
    stream, options = body.get("stream"), body.get("stream_options")
    if stream not in (None, True, False):
        raise bad_request("stream must be true or false.", "stream")
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
        if not isinstance(options, dict) or not set(options) <= {"include_usage"}:
            raise bad_request("stream_options supports include_usage only.", "stream_options")
    include_usage = bool((options or {}).get("include_usage"))
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise bad_request(f"user must be a string of at most {MAX_USER_CHARS} characters.", "user")
    conversation.model = model  # answered by the model named (an adapter on the shared base, too)
    return Completion(
        model, conversation, message, _settings(body), bool(stream), include_usage, _stops(body.get("stop"))
    )
