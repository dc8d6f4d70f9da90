"""Tracking-server credentials live in the environment, never in a stored URI, and go only to their server.

MLflow sends MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (basic auth) or MLFLOW_TRACKING_TOKEN
(bearer) to whatever server it talks to. The shell's credentials -- those variables, and a `user:pass@`
in MLFLOW_TRACKING_URI -- belong to the origin (scheme, host, port) of the shell's MLFLOW_TRACKING_URI,
as a browser or git's credential helpers scope them. `use(uri)` makes this process's environment hold
exactly the credentials that belong to `uri`: the shell's when `uri` has the same origin, else none;
plus `uri`'s own `user:pass@` (below the variables: MLflow's precedence). It returns the bare URI, which
alone is shown, spooled and remembered in state.json. What this process starts afterwards (torchrun's
workers, tune trials, the MLflow UI) inherits that environment: for another server, MLFLOW_TRACKING_URI
there is that server's bare URI, so a child never pairs one server's credentials with another's URI.

Without MLFLOW_TRACKING_URI the variables name no server, and go to whichever one is used (MLflow's own
rule, as for its ~/.mlflow/credentials file, which trainkit does not read).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import unquote, urlsplit, urlunsplit

URI = "MLFLOW_TRACKING_URI"
USERNAME, PASSWORD, TOKEN = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"
VARIABLES = (USERNAME, PASSWORD, TOKEN)
DEFAULT_PORTS = {"http": 80, "https": 443}


def split(uri: str) -> tuple[str, Optional[str], Optional[str]]:
    """(the URI without credentials, user or None, password or None)."""
    if "://" not in uri or "@" not in uri.split("://", 1)[1].split("/", 1)[0]:
        return uri, None, None
    parts = urlsplit(uri)
    host = parts.netloc.rpartition("@")[2]
    bare = urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    return bare, user, password


def origin(uri: str) -> tuple[str, str, Optional[int]]:
    """(scheme, host, port) of a URI: lowercased, the scheme's default port filled in; the path does not count."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    try:
        host, port = (parts.hostname or "").lower(), parts.port
    except ValueError:  # a port that is not a number: the address as written
        return scheme, parts.netloc.rpartition("@")[2].lower(), None
    return scheme, host, port if port is not None else DEFAULT_PORTS.get(scheme)


@dataclass(frozen=True)
class Shell:
    """The credentials this process was given and the origin they belong to (None: no MLFLOW_TRACKING_URI)."""

    uri: Optional[str] = None  # MLFLOW_TRACKING_URI as given (with its user:pass@, if any)
    bare: Optional[str] = None
    origin: Optional[tuple] = None
    values: dict = field(default_factory=dict)  # USERNAME / PASSWORD / TOKEN -> value
    sources: tuple = ()  # where they came from, for messages (names, never values)


def _read(env) -> Shell:
    values = {name: env[name] for name in VARIABLES if env.get(name)}
    sources = tuple(values)
    uri = env.get(URI) or None
    if uri is None:
        return Shell(values=values, sources=sources)
    bare, user, password = split(uri)
    if user is not None or password is not None:
        sources += ("the user:pass@ of MLFLOW_TRACKING_URI",)
    if user is not None:
        values.setdefault(USERNAME, user)
    if password is not None:
        values.setdefault(PASSWORD, password)
    return Shell(uri, bare, origin(bare), values, sources)


_lock = threading.RLock()
_shell: Optional[Shell] = None
_written: Optional[tuple] = None  # the watched variables as use() last left them


def _watched() -> tuple:
    return tuple(os.environ.get(name) for name in (URI, *VARIABLES))


def shell() -> Shell:
    """The shell's credentials: read from the environment, unless it holds just what use() last wrote
    there (then they are still those it was read from)."""
    global _shell
    with _lock:
        if _shell is None or _watched() != _written:
            _shell = _read(os.environ)
        return _shell


def use(uri: str) -> str:
    """Make the environment MLflow reads (and children inherit) hold the credentials that belong to `uri`,
    and nothing meant for another server; return the bare URI."""
    global _written
    bare, user, password = split(uri)
    with _lock:
        given = shell()
        same = given.origin is None or origin(bare) == given.origin
        values = dict(given.values) if same else {}
        if user is not None:
            values.setdefault(USERNAME, user)
        if password is not None:
            values.setdefault(PASSWORD, password)
        for name in VARIABLES:
            if name in values:
                os.environ[name] = values[name]
            else:
                os.environ.pop(name, None)
        if given.uri is not None:
            os.environ[URI] = given.uri if same else bare
        _written = _watched()
    return bare


def from_environment() -> Optional[str]:
    """The shell's MLFLOW_TRACKING_URI without its credentials (its credentials in use), or None."""
    given = shell()
    return use(given.uri) if given.uri else None


def withheld(uri: str) -> Optional[str]:
    """A sentence when the environment holds MLflow credentials that belong to another server than `uri`
    (so they are not sent to it), else None."""
    given = shell()
    if given.origin is None or not given.values or origin(split(uri)[0]) == given.origin:
        return None
    return (f"{split(uri)[0]} is not the server MLFLOW_TRACKING_URI names ({given.bare}): the MLflow credentials "
            f"in the environment ({', '.join(given.sources)}) belong to that server and are not sent to this one; "
            "to authenticate here, point MLFLOW_TRACKING_URI and its credentials at this server, or put this "
            "server's user:pass@ before the host in tracking.uri, each an ${oc.env:NAME} reference")


def withheld_note(uri: str) -> str:
    """'' or a clause for a message about `uri`: the environment's credentials were not sent to it."""
    return f" (the environment's MLflow credentials belong to {shell().bare} and are not sent here)" \
        if withheld(uri) else ""
