"""Settings as TOML text: every key's default with its documentation, or the effective values.

The output is valid TOML that loads back to the same settings (``lbd config defaults`` piped into
``lbd config validate`` is OK), except that ``show`` masks secrets.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from pydantic import SecretStr

from lbd.config.schema import Section, Settings, section_models

MASK = "********"
_WIDTH = 100

HEADER = """\
# lbd settings. Every key is shown with its default; delete what you do not change.
# Precedence, highest first: command-line flags, environment variables LBD_<SECTION>__<KEY>
# (and LBD_PULSAR_URL, LBD_ETCD_ENDPOINTS, LBD_CLUSTER), this file, built-in defaults.
# An empty string ("") leaves an optional key unset. Check a file with `lbd config validate FILE`.
"""


def toml_value(value: object) -> str:
    """``value`` as a TOML literal (Python repr for what TOML cannot express)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # A JSON string is a valid TOML basic string: same quotes, a subset of TOML's escapes.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if value is None:
        return '""'
    return repr(value)


def render_defaults() -> str:
    """Every section and key with its default, each preceded by its documentation."""
    parts = [HEADER]
    for name, model in section_models().items():
        parts.append(_section_comment(name, model))
        for attr, field in model.model_fields.items():
            key = field.alias or attr
            parts.extend(_comment(field.description or ""))
            parts.append(f"{key} = {toml_value(field.get_default(call_default_factory=True))}\n")
            parts.append("\n")
    return "".join(parts).rstrip("\n") + "\n"


def render_values(settings: Settings) -> str:
    """The effective value of every key, secrets masked."""
    parts: list[str] = []
    for name in section_models():
        section: Section = getattr(settings, name)
        parts.append(f"[{name}]\n")
        for attr, field in type(section).model_fields.items():
            parts.append(f"{field.alias or attr} = {_shown(getattr(section, attr))}\n")
        parts.append("\n")
    return "".join(parts).rstrip("\n") + "\n"


def _shown(value: Any) -> str:
    if isinstance(value, SecretStr):
        return toml_value(MASK if value.get_secret_value() else "")
    return toml_value(value)


def _section_comment(name: str, model: type[Section]) -> str:
    # Section docstrings read "``[name]``: what it is"; the part after the colon is the comment.
    _, _, title = " ".join((model.__doc__ or "").split()).partition(": ")
    return "\n" + "".join(_comment(title[:1].upper() + title[1:])) + f"[{name}]\n"


def _comment(text: str) -> list[str]:
    return [f"# {line}\n" for line in textwrap.wrap(" ".join(text.split()), _WIDTH - 2)]
