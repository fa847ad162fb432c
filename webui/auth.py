"""Who may do what in the app.

Chatting is open to everyone. Starting, stopping and resuming training runs, uploading data,
pushing to the Hub and swapping the served model (it changes the model for everyone) need a
login when one is configured, and are refused when none is. Every such handler calls
``require()`` itself: hiding a button, or marking an endpoint private, only changes what a
well-behaved browser shows, not what a crafted request can call.

Two ways to log in:

- ``TRAIN_PASSWORD``: a password typed in the Train tab's login box. The "logged in" flag lives
  in the session's ``gr.State``, which gradio keeps on the server (a request cannot set it).
  The password is compared with ``hmac.compare_digest`` and never logged, shown or stored.
- Hugging Face OAuth on a Space (``hf_oauth: true`` in the README front matter, and
  ``TRAIN_USERS=alice,bob``): gradio injects the signed-in ``gr.OAuthProfile`` from its signed
  session cookie, and the username must be listed. Outside a Space gradio *mocks* OAuth (any
  visitor becomes the machine's own HF account), so OAuth is honoured only on a Space.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PASSWORD_ENV = "TRAIN_PASSWORD"
USERS_ENV = "TRAIN_USERS"
# A failed password costs this long; logins run one at a time (app.py), so guessing is slow.
FAILED_LOGIN_DELAY = 1.0
MAX_PASSWORD_CHARS = 1024

SETUP_HELP = f"""**Training from this tab is off**: no login is configured, so anyone could start runs.
To turn it on, set `{PASSWORD_ENV}` (on a Hugging Face Space: **Settings → Variables and secrets → New secret**)
and restart the app; this tab then asks for that password. On a Space you can instead let Hugging Face
accounts in: add `hf_oauth: true` to the README front matter and set `{USERS_ENV}` to a comma-separated
list of usernames. Until then, train from the command line (README, section **Train**)."""


class AuthError(PermissionError):
    """The caller may not do this (not logged in, or no login configured)."""


@dataclass(frozen=True)
class AuthConfig:
    """How this server lets people in; read once at start-up from the environment."""

    password: str | None = field(default=None, repr=False)  # never in a repr or a log line
    users: frozenset[str] = frozenset()  # Hugging Face usernames allowed through OAuth (lower case)
    oauth: bool = False  # OAuth is usable: on a Space with hf_oauth enabled and TRAIN_USERS set
    problem: str | None = None  # a setting that was ignored, and why (shown in the Train tab)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AuthConfig:
        env = os.environ if env is None else env
        password = env.get(PASSWORD_ENV) or None
        users = frozenset(u.lower() for u in re.split(r"[,\s]+", env.get(USERS_ENV, "")) if u)
        on_space = env.get("SYSTEM") == "spaces" and bool(env.get("SPACE_ID"))
        oauth = bool(users) and on_space and bool(env.get("OAUTH_CLIENT_ID"))
        problem = None
        if users and not on_space:
            problem = (f"`{USERS_ENV}` is ignored: Hugging Face login only works on a Space (elsewhere gradio "
                       f"mocks it); use `{PASSWORD_ENV}` here.")
        elif users and not oauth:
            problem = f"`{USERS_ENV}` is ignored: add `hf_oauth: true` to the README front matter to enable OAuth."
        if problem:
            log.warning(problem.replace("`", ""))
        return cls(password=password, users=users, oauth=oauth, problem=problem)

    @property
    def enabled(self) -> bool:
        return bool(self.password) or self.oauth


@dataclass
class Session:
    """One browser session's login, kept server-side in ``gr.State``."""

    password_ok: bool = False


def _username(profile) -> str | None:
    """The username of a ``gr.OAuthProfile`` (a dict subclass), if any."""
    if profile is None:
        return None
    name = getattr(profile, "username", None) or (profile.get("preferred_username") if isinstance(profile, Mapping)
                                                  else None)
    return name if isinstance(name, str) and name else None


def who(config: AuthConfig, session: Session | None, profile=None) -> str | None:
    """Who is logged in in this session ("password" or "@username"), or None."""
    if config.password and session is not None and session.password_ok:
        return "password"
    name = _username(profile)
    if config.oauth and name and name.lower() in config.users:
        return f"@{name}"
    return None


def require(config: AuthConfig, session: Session | None, profile=None, action: str = "do this") -> str:
    """Who may ``action`` in this session; ``AuthError`` with what to do otherwise."""
    if not config.enabled:
        raise AuthError(f"Cannot {action}: no login is configured on this server, so training actions are off. "
                        f"Set {PASSWORD_ENV} (a Space secret) and restart the app.")
    user = who(config, session, profile)
    if user is None:
        name = _username(profile)
        if name and config.oauth:
            raise AuthError(f"Cannot {action}: @{name} is not in {USERS_ENV}.")
        how = "enter the password" if config.password else ""
        how += (" or " if how and config.oauth else "") + ("sign in with Hugging Face" if config.oauth else "")
        raise AuthError(f"Cannot {action}: log in first (Train tab: {how}).")
    return user


def login(config: AuthConfig, session: Session | None, password: str | None) -> tuple[Session, str]:
    """Check a typed password; returns the new session state and a message for the user."""
    if not config.password:
        raise AuthError("Password login is not configured on this server." + (
            " Sign in with Hugging Face instead." if config.oauth else f" Set {PASSWORD_ENV} to enable it."))
    attempt = password if isinstance(password, str) else ""
    if attempt and len(attempt) <= MAX_PASSWORD_CHARS and hmac.compare_digest(
            attempt.encode(), config.password.encode()):
        log.info("training login (password) succeeded")
        return Session(password_ok=True), "✅ Logged in: you can start, stop, resume and push runs, upload data " \
                                          "and switch the served model."
    time.sleep(FAILED_LOGIN_DELAY)
    log.warning("training login failed (wrong password)")
    raise AuthError("Wrong password.")


def logout(session: Session | None) -> tuple[Session, str]:
    return Session(), "Logged out."


def login_markdown(config: AuthConfig, session: Session | None, profile=None) -> str:
    """The Train tab's line about logging in."""
    if not config.enabled:
        return SETUP_HELP + (f"\n\n⚠️ {config.problem}" if config.problem else "")
    user = who(config, session, profile)
    if user == "password":
        text = "🔓 **Logged in** (password)."
    elif user:
        text = f"🔓 **Logged in** as {user}."
    else:
        ways = ["the password"] if config.password else []
        ways += ["a Hugging Face account listed in " + USERS_ENV] if config.oauth else []
        text = f"🔒 **Log in** with {' or '.join(ways)} to start, stop or push runs (watching is open to everyone)."
    return text + (f"\n\n⚠️ {config.problem}" if config.problem else "")
