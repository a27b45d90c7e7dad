"""Params from files: a named profile (src/longctx/profiles/<name>.yaml) with params.yaml's
sections merged over it key by key (a null drops a key), validated before any work starts. A
profile may start with `extends: <profile>`: its sections merge over that one's the same way."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import ValidationError

from ..errors import ConfigError
from .schema import Params

PROFILES = Path(str(resources.files("longctx") / "profiles"))


def profile_path(name: str) -> Path:
    return PROFILES / f"{name}.yaml"


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.yaml"))


def merge(base: dict, over: dict) -> dict:
    """Deep-merge `over` into a copy of `base`; dicts merge, other values replace, None drops, an
    empty dict changes nothing. Keys match by their text, so a YAML `"8192"` overrides a
    profile's `8192`."""
    out = dict(base)
    for k, v in over.items():
        k = next((b for b in out if str(b) == str(k)), k)
        if v == {}:
            continue
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


class _UniqueKeys(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML keeps the last copy; DVC refuses
    the file): the stages and DVC must read the same params."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`, whose keys the mapping may override
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: {what} not found")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as e:  # one line: file, line and column, what is wrong there
        mark = e.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(filter(None, [e.problem, e.context])) or "cannot be parsed"
        raise ConfigError(f"{where}: not valid YAML: {what}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid params: nested too deeply for the YAML reader") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of sections, got {type(data).__name__}")
    return data


def resolve(overrides: dict, source: str = "params") -> Params:
    """Profile + overrides -> validated Params. `source` names the overrides in errors."""
    profile = overrides.get("profile", "tiny")
    if not isinstance(profile, str) or profile not in available_profiles():
        raise ConfigError(
            f"{source}: profile: unknown profile {profile!r}; choose one of {available_profiles()}"
        )
    raw = merge(_profile(profile, ()), overrides)
    raw["profile"] = profile
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: " + _describe(e)) from None


def _profile(name: str, seen: tuple[str, ...]) -> dict:
    """A profile's sections, merged over those of the profile it extends."""
    path = profile_path(name)
    raw = _read_yaml(path, f"profile {name}")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str) or parent not in available_profiles():
        raise ConfigError(f"{path}: extends: unknown profile {parent!r}; choose one of {available_profiles()}")
    if parent in (*seen, name):
        raise ConfigError(f"{path}: extends: {' -> '.join((*seen, name, parent))} is a cycle")
    return merge(_profile(parent, (*seen, name)), raw)


def load(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    return resolve(_read_yaml(path, "params file"), source=str(path))


def _describe(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{key}: {msg}" if key else msg)
    return "; ".join(lines)
