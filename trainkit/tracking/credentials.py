"""Tracking-server credentials live in the environment, never in a stored URI.

MLflow reads basic-auth credentials from MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD. A URI
written with them (`http://user:pass@host`, in the recipe or in MLFLOW_TRACKING_URI) is split: the
credentials go into this process's environment (unless already set there, MLflow's own precedence)
and only the bare URI is shown, spooled and remembered in state.json.
"""

from __future__ import annotations

import os
from typing import Optional
from urllib.parse import unquote, urlsplit, urlunsplit

USERNAME, PASSWORD = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"


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


def adopt(uri: str) -> str:
    """Move a URI's credentials into the environment MLflow reads; return the bare URI."""
    bare, user, password = split(uri)
    if user is not None:
        os.environ.setdefault(USERNAME, user)
    if password is not None:
        os.environ.setdefault(PASSWORD, password)
    return bare


def from_environment() -> Optional[str]:
    """MLFLOW_TRACKING_URI without its credentials (adopted into the environment), or None."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    return adopt(uri) if uri else None
