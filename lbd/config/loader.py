"""Loading settings: the TOML file, then ``LBD_*`` environment variables, then flags.

Precedence, highest first: overrides (command-line flags) > environment > file > defaults. The
environment names a key as ``LBD_<SECTION>__<KEY>`` (``LBD_ETCD__LEASE_TTL_S``), plus the short
aliases of DESIGN §9: ``LBD_PULSAR_URL``, ``LBD_ETCD_ENDPOINTS`` and ``LBD_CLUSTER``. A string
given for a list key (from the environment or a flag) is split on commas.

Every problem is reported at once, one line each, naming where the value came from and its
``section.key``; never a pydantic traceback.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import SecretStr, ValidationError
from pydantic_core import ErrorDetails

from lbd.config.invariants import Problem, check_invariants
from lbd.config.render import toml_value
from lbd.config.schema import Section, Settings, section_models, toml_keys
from lbd.core.errors import InvalidInputError

ENV_PREFIX = "LBD_"
ENV_NESTED_DELIMITER = "__"
ENV_ALIASES: Mapping[str, tuple[str, str]] = {
    "LBD_PULSAR_URL": ("pulsar", "service_url"),
    "LBD_ETCD_ENDPOINTS": ("etcd", "endpoints"),
    "LBD_CLUSTER": ("cluster", "name"),
}
"""Short environment names of DESIGN §9 -> (section, key)."""

OVERRIDES_ORIGIN = "command line"

_Key = tuple[str, str]


class SettingsError(InvalidInputError):
    """Settings that cannot be used; ``problems`` has one line per problem, each naming where
    the value came from (file, environment variable or command line) and its ``section.key``."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  {p}" for p in self.problems)
            message = f"{len(self.problems)} problems in the settings:\n{lines}"
        super().__init__(message)


def load_settings(
    path: Path | None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Settings:
    """Settings from the TOML file at ``path`` (None: no file), the ``LBD_*`` variables of
    ``env`` (None: the process environment) and ``overrides`` (dotted ``section.key`` -> value;
    None values are ignored, so unset flags can be passed as they are).

    Raises :class:`SettingsError` (an InvalidInputError) listing every problem.
    """
    file_label = str(path) if path is not None else "defaults"
    file_data = _read_toml(path) if path is not None else {}
    merged = _Merged(file_label)
    merged.add_file(file_data)
    merged.add_env(os.environ if env is None else env)
    merged.add_overrides(overrides or {})
    return merged.validate()


class _Merged:
    """The layered raw values, where each came from, and the problems found so far."""

    def __init__(self, file_label: str) -> None:
        self.file_label = file_label
        self.models = section_models()
        self.data: dict[str, dict[str, Any]] = {}
        self.origins: dict[_Key, str] = {}
        self.problems: list[str] = []
        self.broken_sections: set[str] = set()

    def add_file(self, data: Mapping[str, Any]) -> None:
        for name, value in data.items():
            if name not in self.models:
                where = "unknown section" if isinstance(value, dict) else "unknown top-level key"
                hint = _did_you_mean(name, self.models)
                self.problems.append(f"{self.file_label}: {name}: {where}{hint}")
            elif not isinstance(value, dict):
                self.broken_sections.add(name)
                self.problems.append(
                    f"{self.file_label}: {name}: must be a table [{name}] (got {toml_value(value)})"
                )
            else:
                self.data[name] = dict(value)
                for key in value:
                    self.origins[(name, key)] = self.file_label

    def add_env(self, env: Mapping[str, str]) -> None:
        chosen: dict[_Key, tuple[str, str]] = {}
        for var in sorted(env):
            if var in ENV_ALIASES:
                key: _Key | None = ENV_ALIASES[var]
            elif var.startswith(ENV_PREFIX) and ENV_NESTED_DELIMITER in var:
                section, _, field = var[len(ENV_PREFIX) :].partition(ENV_NESTED_DELIMITER)
                key = self._known_key(section.lower(), field.lower(), f"env {var}")
            else:
                continue  # not ours: other tools may use LBD_* names too
            if key is None:
                continue
            if key in chosen and chosen[key][1] != env[var]:
                self.problems.append(
                    f"env {var}: {_dotted(key)}: also set, differently, by {chosen[key][0]}; "
                    "set only one"
                )
                continue
            chosen[key] = (f"env {var}", env[var])
        for key, (label, value) in chosen.items():
            self._set(key, value, label)

    def add_overrides(self, overrides: Mapping[str, object]) -> None:
        for dotted, value in overrides.items():
            if value is None:
                continue
            section, _, field = dotted.partition(".")
            key = self._known_key(section, field, OVERRIDES_ORIGIN)
            if key is not None:
                self._set(key, value, OVERRIDES_ORIGIN)

    def _known_key(self, section: str, field: str, label: str) -> _Key | None:
        model = self.models.get(section)
        if model is None:
            hint = _did_you_mean(section, self.models)
            self.problems.append(f"{label}: {section}.{field}: unknown section{hint}")
            return None
        if field not in toml_keys(model):
            hint = _did_you_mean(field, toml_keys(model))
            self.problems.append(
                f"{label}: {section}.{field}: unknown key in section [{section}]{hint}"
            )
            return None
        return section, field

    def _set(self, key: _Key, value: object, label: str) -> None:
        section, field = key
        if section in self.broken_sections:
            return
        if isinstance(value, str) and _is_list(self.models[section], field):
            value = [part.strip() for part in value.split(",") if part.strip()]
        self.data.setdefault(section, {})[field] = value
        self.origins[key] = label

    def validate(self) -> Settings:
        sections: dict[str, Section] = {}
        for name, model in self.models.items():
            if name in self.broken_sections:
                continue
            try:
                sections[name] = model.model_validate(self.data.get(name, {}))
            except ValidationError as e:
                self.problems.extend(self._describe(name, model, err) for err in e.errors())
        # Rules are checked even when some sections failed, over the sections that did not, so
        # that one run reports everything it can.
        candidate = Settings.model_construct(None, **sections)
        for problem in check_invariants(candidate, frozenset(sections)):
            self.problems.append(f"{self._rule_origin(problem)}: {problem.key}: {problem.message}")
        if self.problems:
            raise SettingsError(self.problems)
        return Settings.model_validate(sections)

    def _rule_origin(self, problem: Problem) -> str:
        """Where the first key of the rule that was set explicitly came from: what to edit."""
        for key in problem.keys:
            section, _, field = key.partition(".")
            if (section, field) in self.origins:
                return self.origins[(section, field)]
        return self.file_label

    def _describe(self, section: str, model: type[Section], err: ErrorDetails) -> str:
        loc = err["loc"]
        field = str(loc[0]) if loc else ""
        path = section + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        origin = self.origins.get((section, field), self.file_label)
        kind, ctx = err["type"], err.get("ctx", {})
        if kind == "extra_forbidden":
            hint = _did_you_mean(field, toml_keys(model))
            return f"{origin}: {path}: unknown key in section [{section}]{hint}"
        message = _MESSAGES.get(kind)
        if message is None:
            message = str(ctx["error"]) if kind == "value_error" else err["msg"]
        else:
            message = message.format(**{k: _plain(v) for k, v in ctx.items()})
        attr = toml_keys(model).get(field)
        if attr and _is_secret(model, attr):
            return f"{origin}: {path}: {message} (value hidden)"
        if not loc:  # a rule over the whole section: its input is every key, secrets included
            return f"{origin}: {path}: {message}"
        return f"{origin}: {path}: {message} (got {toml_value(err['input'])})"


_MESSAGES = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "too_short": "must have at least {min_length} item(s)",
    "literal_error": "must be one of {expected}",
    "model_type": "must be a table",
    "dict_type": "must be a table",
}
"""pydantic error types -> operator wording (``{...}`` from the error's context)."""


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SettingsError([f"{path}: cannot read: {e.strerror or e}"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SettingsError([f"{path}: not UTF-8 text (byte {e.start})"]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SettingsError([f"{path}: invalid TOML: {e}"]) from None


def _did_you_mean(name: str, known: Mapping[str, object]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _plain(value: object) -> object:
    """Bounds as an operator writes them: 0 rather than 0.0."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _dotted(key: _Key) -> str:
    return f"{key[0]}.{key[1]}"


def _is_list(model: type[Section], toml_key: str) -> bool:
    attr = toml_keys(model)[toml_key]
    return get_origin(model.model_fields[attr].annotation) is list


def _is_secret(model: type[Section], attr: str) -> bool:
    annotation = model.model_fields[attr].annotation
    return annotation is SecretStr or SecretStr in get_args(annotation)
