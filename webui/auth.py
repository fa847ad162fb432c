"""Who may do what in the app.

Chatting is open to everyone. Starting, stopping and resuming training runs, uploading data,
pushing to the Hub and swapping the served model (it changes the model for everyone) need a
login when one is configured, and are refused when none is. Every such handler calls
``require()`` itself: hiding a button, or marking an endpoint private, only changes what a
well-behaved browser shows, not what a crafted request can call.

Two ways to log in:

- ``TRAIN_PASSWORD``: a password typed in the Train tab's login box. A right password gets a
  random login token; the browser keeps it (``gr.BrowserState``: encrypted in its local
  storage) and sends it with every action, and the server keeps only the token's hash and its
  last use. So a login is worth nothing without the token (gradio's session hash, which the
  client chooses and sends in the clear, is not a login), survives a page reload, ends after
  ``IDLE_SECONDS`` without use or at Log out, and is not lost when other visitors' sessions
  push this one out of gradio's session memory. Wrong passwords are counted per client
  address: after ``MAX_FAILURES`` in a row that client is refused at once for a while, without
  holding any worker, and every failure is logged with the address.
- Hugging Face OAuth on a Space (``hf_oauth: true`` in the README front matter, and
  ``TRAIN_USERS=alice,bob``): gradio injects the signed-in ``gr.OAuthProfile`` from its signed
  session cookie, and the username must be listed. Outside a Space gradio *mocks* OAuth (any
  visitor becomes the machine's own HF account), so OAuth is honoured only on a Space.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from chat import clients

log = logging.getLogger(__name__)

PASSWORD_ENV = "TRAIN_PASSWORD"
USERS_ENV = "TRAIN_USERS"
PROXY_ENV = clients.PROXY_ENV  # 1: trust the proxy's X-Forwarded-For (automatic on a Space)
MAX_PASSWORD_CHARS = 1024
IDLE_SECONDS = 30 * 60  # a login unused this long has ended
MAX_LOGINS = 32  # live logins kept (one trainer, a few browsers); the least recently used goes first
MAX_FAILURES = 5  # wrong passwords in a row from one client address before it must wait
LOCKOUT_SECONDS = 60.0  # the wait, doubled for every further failure (at most an hour)

SETUP_HELP = f"""**Training from this tab is off**: no login is configured, so anyone could start runs.
To turn it on, set `{PASSWORD_ENV}` (on a Hugging Face Space: **Settings → Variables and secrets → New secret**)
and restart the app; this tab then asks for that password. On a Space you can instead let Hugging Face
accounts in: add `hf_oauth: true` to the README front matter and set `{USERS_ENV}` to a comma-separated
list of usernames. Until then, train from the command line (README, section **Train**)."""


class AuthError(PermissionError):
    """The caller may not do this (not logged in, or no login configured)."""


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Logins:
    """Live password logins: token hash -> last use (thread-safe, bounded, idle ones expire)."""

    def __init__(self, idle_seconds: float = IDLE_SECONDS, capacity: int = MAX_LOGINS):
        self.idle_seconds, self.capacity = idle_seconds, capacity
        self._last_use: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def issue(self) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._last_use[_digest(token)] = time.monotonic()
            while len(self._last_use) > self.capacity:
                self._last_use.popitem(last=False)
        return token

    def check(self, token, touch: bool = True) -> bool:
        """Is ``token`` a live login? With ``touch`` a yes counts as a use (the idle clock restarts);
        a page's polling asks without it, so an open tab alone does not keep a login alive."""
        if not isinstance(token, str) or not token:
            return False
        key, now = _digest(token), time.monotonic()
        with self._lock:
            last = self._last_use.get(key)
            if last is None:
                return False
            if now - last > self.idle_seconds:
                del self._last_use[key]
                return False
            if touch:
                self._last_use[key] = now
                self._last_use.move_to_end(key)
            return True

    def revoke(self, token) -> None:
        if isinstance(token, str):
            with self._lock:
                self._last_use.pop(_digest(token), None)


class Throttle:
    """Wrong passwords per client address. After ``MAX_FAILURES`` in a row a client is refused
    at once (nothing sleeps, so nobody else waits) until its lockout ends; a right password
    clears its count. At most ``capacity`` addresses are remembered."""

    def __init__(self, max_failures: int = MAX_FAILURES, lockout: float = LOCKOUT_SECONDS, capacity: int = 10_000):
        self.max_failures, self.lockout, self.capacity = max_failures, lockout, capacity
        self._clients: OrderedDict[str, tuple[int, float]] = OrderedDict()  # address -> (failures, locked until)
        self._lock = threading.Lock()

    def wait_seconds(self, client: str) -> float:
        with self._lock:
            _, until = self._clients.get(client, (0, 0.0))
        return max(0.0, until - time.monotonic())

    def admit(self, client: str) -> float:
        """Seconds ``client`` must still wait (refused, not counted), or 0: the attempt may go on
        and counts as a failure until ``succeeded``. One step under the lock, so concurrent
        attempts from one address cannot all pass the check before any of them is counted."""
        with self._lock:
            failures, until = self._clients.pop(client, (0, 0.0))
            now = time.monotonic()
            if until > now:
                self._clients[client] = (failures, until)
                return until - now
            failures += 1
            over = failures - self.max_failures
            until = now + min(3600.0, self.lockout * 2**over) if over >= 0 else 0.0
            self._clients[client] = (failures, until)
            while len(self._clients) > self.capacity:
                self._clients.popitem(last=False)
        return 0.0

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._clients.pop(client, None)


@dataclass(frozen=True)
class AuthConfig:
    """How this server lets people in (read once at start-up), and its live logins."""

    password: str | None = field(default=None, repr=False)  # never in a repr or a log line
    users: frozenset[str] = frozenset()  # Hugging Face usernames allowed through OAuth (lower case)
    oauth: bool = False  # OAuth is usable: on a Space with hf_oauth enabled and TRAIN_USERS set
    problem: str | None = None  # a setting that was ignored, and why (shown in the Train tab)
    # Behind a proxy (a Space), every request comes from the proxy: the client is the address the
    # proxy appended to X-Forwarded-For. Off a proxy that header is the client's to forge: ignored.
    behind_proxy: bool = False
    logins: Logins = field(default_factory=Logins, repr=False, compare=False)
    throttle: Throttle = field(default_factory=Throttle, repr=False, compare=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AuthConfig:
        env = os.environ if env is None else env
        password = env.get(PASSWORD_ENV) or None
        users = frozenset(u.lower() for u in re.split(r"[,\s]+", env.get(USERS_ENV, "")) if u)
        on_space = clients.on_space(env)
        oauth = bool(users) and on_space and bool(env.get("OAUTH_CLIENT_ID"))
        problem = None
        if users and not on_space:
            problem = (
                f"`{USERS_ENV}` is ignored: Hugging Face login only works on a Space (elsewhere gradio "
                f"mocks it); use `{PASSWORD_ENV}` here."
            )
        elif users and not oauth:
            problem = f"`{USERS_ENV}` is ignored: add `hf_oauth: true` to the README front matter to enable OAuth."
        if problem:
            log.warning(problem.replace("`", ""))
        behind_proxy = clients.behind_proxy(env)
        return cls(password=password, users=users, oauth=oauth, problem=problem, behind_proxy=behind_proxy)

    def client(self, request) -> str:
        """The address a request comes from (``gr.Request``), for the login throttle and the
        feedback and vote caps: ``chat.clients.client_address``."""
        return clients.client_address(request, self.behind_proxy)

    @property
    def enabled(self) -> bool:
        return bool(self.password) or self.oauth


def _username(profile) -> str | None:
    """The username of a ``gr.OAuthProfile`` (a dict subclass), if any."""
    if profile is None:
        return None
    name = getattr(profile, "username", None) or (
        profile.get("preferred_username") if isinstance(profile, Mapping) else None
    )
    return name if isinstance(name, str) and name else None


def who(config: AuthConfig, token: str | None, profile=None, touch: bool = True) -> str | None:
    """Who is logged in with this login token / profile ("password" or "@username"), or None
    (``touch``: whether this counts as a use of the login, see ``Logins.check``)."""
    if config.password and config.logins.check(token, touch):
        return "password"
    name = _username(profile)
    if config.oauth and name and name.lower() in config.users:
        return f"@{name}"
    return None


def require(config: AuthConfig, token: str | None, profile=None, action: str = "do this") -> str:
    """Who may ``action`` with this login; ``AuthError`` with what to do otherwise."""
    if not config.enabled:
        raise AuthError(
            f"Cannot {action}: no login is configured on this server, so training actions are off. "
            f"Set {PASSWORD_ENV} (a Space secret) and restart the app."
        )
    user = who(config, token, profile)
    if user is None:
        name = _username(profile)
        if name and config.oauth:
            raise AuthError(f"Cannot {action}: @{name} is not in {USERS_ENV}.")
        how = "enter the password" if config.password else ""
        how += (" or " if how and config.oauth else "") + ("sign in with Hugging Face" if config.oauth else "")
        raise AuthError(f"Cannot {action}: log in first (Train tab: {how}).")
    return user


def login(config: AuthConfig, password: str | None, client: str) -> tuple[str, str]:
    """Check a typed password from ``client`` (its address); returns a new login token and a
    message for the user."""
    if not config.password:
        raise AuthError(
            "Password login is not configured on this server."
            + (" Sign in with Hugging Face instead." if config.oauth else f" Set {PASSWORD_ENV} to enable it.")
        )
    wait = config.throttle.admit(client)  # (counted as wrong until it proves right)
    if wait > 0:
        log.warning("training login refused for %s: locked out for %.0f s more", client, wait)
        raise AuthError(f"Too many wrong passwords from your address: try again in {wait:.0f} s.")
    attempt = password if isinstance(password, str) else ""
    if (
        attempt
        and len(attempt) <= MAX_PASSWORD_CHARS
        and hmac.compare_digest(attempt.encode(), config.password.encode())
    ):
        config.throttle.succeeded(client)
        log.info("training login (password) from %s", client)
        return config.logins.issue(), (
            "✅ Logged in: you can start, stop, resume and push runs, upload data and switch the served model."
        )
    log.warning("training login failed from %s (wrong password)", client)
    raise AuthError("Wrong password.")


def logout(config: AuthConfig, token: str | None) -> str:
    """End this login (the token stops working everywhere)."""
    config.logins.revoke(token)
    return "Logged out."


def login_markdown(config: AuthConfig, token: str | None, profile=None) -> str:
    """The Train tab's line about logging in."""
    if not config.enabled:
        return SETUP_HELP + (f"\n\n⚠️ {config.problem}" if config.problem else "")
    user = who(config, token, profile)
    if user == "password":
        text = "🔓 **Logged in** (password)."
    elif user:
        text = f"🔓 **Logged in** as {user}."
    else:
        ways = ["the password"] if config.password else []
        ways += ["a Hugging Face account listed in " + USERS_ENV] if config.oauth else []
        text = f"🔒 **Log in** with {' or '.join(ways)} to start, stop or push runs (watching is open to everyone)."
        if config.password and isinstance(token, str) and token:  # this browser had a login: say it ended
            text = (
                "🔒 **Your login has ended** (unused for 30 minutes, logged out on another page, or the server "
                "restarted): log in again to start, stop or push runs."
            )
    return text + (f"\n\n⚠️ {config.problem}" if config.problem else "")
