"""Secrets a recipe pulls from the environment, and how they are kept off screens and disks.

A value is secret when it comes from `${oc.env:NAME}` and NAME looks secret: split on `_`, one of its
segments is in SECRET_SEGMENTS (case-insensitive), or NAME is listed in TRAINKIT_SECRET_VARS
(comma-separated). So MY_API_TOKEN is secret; TOKENIZERS_PARALLELISM and TOKENIZER_PATH are not.
The real value is used at run time; everything trainkit prints or stores goes through `redact`,
and credentials inside URIs (`scheme://user:pass@host`) are masked wherever they appear.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Iterator, Mapping, Optional

SECRET_SEGMENTS = frozenset({"KEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL",
                             "CREDENTIALS", "AUTH", "COOKIE", "PRIVATE"})
EXTRA_NAMES_VAR = "TRAINKIT_SECRET_VARS"
MASK = "***"
MIN_SUBSTRING = 4  # shorter secrets are masked only where they are a whole value, not inside text

_ENV_REF = re.compile(r"oc\.env\s*:\s*['\"]?([^,}'\"\s]*)")
_URI_CREDENTIALS = re.compile(r"\b([A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@'\"]+@")


def looks_secret(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether an environment variable's name says its value is a secret."""
    env = os.environ if environ is None else environ
    extra = {n.strip().upper() for n in env.get(EXTRA_NAMES_VAR, "").split(",") if n.strip()}
    upper = name.upper()
    return upper in extra or any(seg in SECRET_SEGMENTS for seg in upper.split("_"))


def _strings(data: Any) -> Iterator[str]:
    if isinstance(data, str):
        yield data
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(data, list):
        for value in data:
            yield from _strings(value)


def secret_values(raw: Any, environ: Optional[Mapping[str, str]] = None) -> frozenset[str]:
    """Values of the secret-looking variables a recipe (before interpolation) references. A
    reference whose name is itself interpolated (`${oc.env:${x}}`) counts every secret variable."""
    env = os.environ if environ is None else environ
    names: set[str] = set()
    for text in _strings(raw):
        for match in _ENV_REF.finditer(text):
            name = match.group(1)
            if not name or "$" in name:
                names.update(env)
            else:
                names.add(name)
    return frozenset(env[n] for n in names if env.get(n) and looks_secret(n, env))


def mask_uri_credentials(text: str) -> str:
    """`https://user:pass@host/x` -> `https://***@host/x`."""
    return _URI_CREDENTIALS.sub(lambda m: m.group(1) + MASK + "@", text)


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """Text safe to print or store: secret values and URI credentials masked."""
    for secret in sorted(secrets, key=len, reverse=True):
        if text == secret:
            return MASK
        if len(secret) >= MIN_SUBSTRING:
            text = text.replace(secret, MASK)
    return mask_uri_credentials(text)


def redact(data: Any, secrets: Iterable[str]) -> Any:
    """A copy of recipe data (dicts, lists, scalars) with every string passed through redact_text."""
    secrets = tuple(secrets)
    if isinstance(data, str):
        return redact_text(data, secrets)
    if isinstance(data, dict):
        return {k: redact(v, secrets) for k, v in data.items()}
    if isinstance(data, list):
        return [redact(v, secrets) for v in data]
    return data


def redact_environment(env: Mapping[str, str]) -> dict[str, str]:
    """Environment variables as recorded: secret-looking names keep their name, lose their value."""
    return {k: MASK if looks_secret(k, env) else mask_uri_credentials(v) for k, v in env.items()}
