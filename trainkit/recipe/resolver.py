"""Recipe file(s) + overrides -> one validated, frozen `Recipe`, or every problem at once.

Order: load each file safely with positions -> compose `defaults:` (relative paths, cycles
detected) -> apply `key=value` overrides -> resolve `${...}` interpolation (OmegaConf) -> check
plugin names -> pydantic schema -> cross-field rules. Every problem is mapped back to the file,
line and column (or override) that set the offending value.
"""

from __future__ import annotations

import copy
import json
import os
import re
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pydantic import BaseModel, ValidationError

from .. import registry
from .arguments import OVERRIDE_FORMS as _OVERRIDE_FORMS
from .problems import COMMAND_LINE, Location, Problem, RecipeError, did_you_mean, short
from .schema import PLUGIN_FIELDS, Recipe, recipe_model
from .yaml_source import KEY, Path_, dotted, load_yaml
from . import aliases, confinement, imports, paths, rules, secrets

Positions = dict[Path_, Location]


@dataclass
class Resolved:
    """A validated recipe plus where each value came from (for plan and later errors)."""

    recipe: Recipe
    data: dict[str, Any]
    positions: Positions
    files: list[str]
    warnings: list[Problem] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)  # composed + overrides, `${...}` not yet resolved
    secrets: frozenset[str] = frozenset()  # values of secret-looking env variables the recipe reads

    def locate(self, path: Path_) -> Location:
        return locate(self.positions, path, self.files[0])

    def origin(self, path: Path_) -> str:
        """'' unless the value at `path` was produced by `${...}` interpolation; then a sentence saying
        which, and which environment variables to set (for messages about the final value)."""
        return interpolation_origin(self.raw, path)

    def redacted(self) -> dict[str, Any]:
        """The resolved data as it may be printed or stored (secrets and URI credentials masked)."""
        return secrets.redact(self.data, self.secrets)

    def redact_text(self, text: str) -> str:
        return secrets.redact_text(text, self.secrets)

    def redact_problems(self, problems: list[Problem]) -> list[Problem]:
        return _redacted(problems, self.secrets)


def locate(positions: Positions, path: Path_, default_file: str, key: bool = False) -> Location:
    """Where the value at `path` (or, with key=True, its key) was written, else its nearest ancestor's."""
    path = tuple(path)
    if key and path + (KEY,) in positions:
        return positions[path + (KEY,)]
    while path:
        if path in positions:
            return positions[path]
        path = path[:-1]
    return positions.get((), Location(default_file))


_ENV_REF = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")


def interpolation_origin(raw: dict, path: Path_) -> str:
    """'' unless the raw (uninterpolated) value at `path` is an interpolation: then where it came from."""
    parent, present = _lookup(raw, tuple(path))
    expr = parent[path[-1]] if present else None
    if not isinstance(expr, str) or "${" not in expr:
        return ""
    env = []
    for var, default in _ENV_REF.findall(expr):
        if var in os.environ:
            env.append(f"{var} is set")
        else:
            env.append(f"{var} is not set, so its default {default.strip()!r} was used" if default
                       else f"{var} is not set")
    vars_ = sorted(set(_ENV_REF.findall(expr)), key=lambda v: v[0])
    fix = f"set {' / '.join(v for v, _ in vars_)}, or change {dotted(tuple(path))}" if vars_ else \
        f"change {dotted(tuple(path))} or what it refers to"
    return f"the value came from {expr}" + (f" ({'; '.join(env)})" if env else "") + f": {fix}"


# ----------------------------------------------------------------------------- composition
def _merge(base: Any, base_pos: Positions, top: Any, top_pos: Positions, prefix: Path_ = ()) -> Any:
    """Deep-merge `top` over `base` (mappings merge, everything else replaces), positions alike."""
    if isinstance(base, dict) and isinstance(top, dict):
        if prefix and prefix[0] in ("data", "strategy") and len(prefix) == 1:
            base = _switch_plugin(prefix[0], base, top)
        out = dict(base)
        for key, value in top.items():
            out[key] = _merge(base.get(key), base_pos, value, top_pos, prefix + (key,)) if key in base else value
            if key not in base:
                _drop_positions(base_pos, prefix + (key,))
        return out
    _drop_positions(base_pos, prefix)
    return top


def _switch_plugin(block: str, base: dict, top: dict) -> dict:
    """`strategy.name=fsdp` over a ddp block keeps only the options fsdp also accepts."""
    new, old = top.get("name"), base.get("name")
    if new is None or new == old or new not in registry.names(PLUGIN_FIELDS[block]):
        return base
    try:
        accepted = registry.load(PLUGIN_FIELDS[block], new).model_fields
    except registry.PluginError:
        return base
    return {k: v for k, v in base.items() if k in accepted}


def _drop_positions(positions: Positions, prefix: Path_) -> None:
    n = len(prefix)
    for key in [k for k in positions if k[:n] == prefix]:
        del positions[key]


def _compose(path: Path, chain: list[Path], problems: list[Problem], root: Path) -> tuple[dict, Positions, list[str]]:
    """Load `path` and everything its `defaults:` names, merged in order under it; every composed
    file must lie inside `root` (confinement.py says why)."""
    try:
        data, positions = load_yaml(path)
    except RecipeError as err:
        problems.extend(err.problems)
        return {}, {}, [str(path)]
    files = [str(path)]
    defaults = data.pop("defaults", [])
    own_pos = {k: v for k, v in positions.items() if not (k and k[0] == "defaults")}
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        problems.append(Problem(locate(positions, ("defaults",), str(path)), "defaults",
                                f"must be a list of recipe file paths, got {short(defaults)}"))
        defaults = []
    merged: dict = {}
    merged_pos: Positions = {}
    for i, name in enumerate(defaults):
        where = locate(positions, ("defaults", i), str(path))
        try:
            target = confinement.real_path(path.parent / name)
        except confinement.UnreadablePath as exc:
            problems.append(Problem(where, f"defaults[{i}]", f"{exc}; name a recipe file"))
            continue
        if confinement.outside(target, root):
            problems.append(Problem(where, f"defaults[{i}]", (
                f"{name} is outside the recipe's repository {root}: a recipe composes only files inside it "
                f"(set {confinement.ROOT_VAR} to allow another folder)")))
            continue
        if target in chain:
            cycle = " -> ".join(p.name for p in chain[chain.index(target):] + [target])
            problems.append(Problem(where, f"defaults[{i}]", f"composition cycle: {cycle}"))
            continue
        if not target.is_file():
            folder = os.path.dirname(name)
            siblings = [os.path.join(folder, p.name) for p in target.parent.glob("*.y*ml")] if target.parent.is_dir() else []
            problems.append(Problem(where, f"defaults[{i}]", f"file not found: {name} (looked in {target.parent})"
                                    + did_you_mean(name, siblings)))
            continue
        sub, sub_pos, sub_files = _compose(target, chain + [target], problems, root)
        merged = _merge(merged, merged_pos, sub, sub_pos)
        merged_pos.update(sub_pos)
        files += sub_files
    merged = _merge(merged, merged_pos, data, own_pos)
    merged_pos.update(own_pos)
    return merged, merged_pos, files


_OVERRIDE_KEY = re.compile(r"[A-Za-z_][\w\-]*(\.[\w\-]+)*")


@dataclass(frozen=True)
class _Added:
    """A plain `key=value` override that created a key the recipe did not have (checked against the schema)."""

    path: Path_
    where: Location


_BASE60 = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")


def _base60_as_text(assignment: str) -> str:
    """`launch.nnodes=2:4` stays the string '2:4': OmegaConf's YAML 1.1 parser would read base-60 (124),
    as recipe files no longer do (yaml_source)."""
    key, sep, value = assignment.partition("=")
    return f"{key}='{value.strip()}'" if sep and _BASE60.fullmatch(value.strip()) else assignment


def _apply_overrides(data: dict, positions: Positions, overrides: Sequence[str],
                     problems: list[Problem]) -> tuple[dict, list[_Added], dict[Path_, Location]]:
    """Apply `key=value`, `+key=value` and `~key` in order; returns (data, plain overrides that added a
    key, deleted paths and the override that deleted each)."""
    from omegaconf import OmegaConf

    added: list[_Added] = []
    deleted: dict[Path_, Location] = {}
    for text in overrides:
        where = Location(COMMAND_LINE, override=text)
        op = text[0] if text[:1] in ("~", "+") else ""
        key, sep, _ = text[len(op):].partition("=")
        key = key.strip()
        if not _OVERRIDE_KEY.fullmatch(key) or (op == "~") == bool(sep):
            hint = "; ~ deletes a key and takes no value: ~" + key if op == "~" and sep else ""
            problems.append(Problem(where, "", _OVERRIDE_FORMS + hint))
            continue
        path = tuple(int(p) if p.isdigit() else p for p in key.split("."))
        parent, present = _lookup(data, path)
        if op == "~":
            if not present:
                problems.append(Problem(where, key, "nothing to delete: the recipe has no such key"))
                continue
            del parent[path[-1]]
            _drop_positions(positions, path)
            deleted[path] = where
            continue
        if op == "+" and present:
            problems.append(Problem(where, key, f"already set at {locate(positions, path, '')}; write {key}=... "
                                                "(without '+') to change it"))
            continue
        try:
            layer = OmegaConf.to_container(OmegaConf.from_dotlist([_base60_as_text(text[len(op):])]), resolve=False)
        except Exception as exc:  # OmegaConf grammar errors
            problems.append(Problem(where, key, f"cannot parse override value: {_first_line(exc)}"))
            continue
        if not op and not present:
            added.append(_Added(path, where))
        layer_pos = {path[:i] + end: where for i in range(1, len(path) + 1) for end in ((), (KEY,))}
        data = _merge(data, positions, layer, layer_pos)
        positions.update(layer_pos)
        deleted.pop(path, None)
    return data, added, deleted


def _lookup(data: Any, path: Path_) -> tuple[Any, bool]:
    """(the container holding path[-1], whether the key is there)."""
    for part in path[:-1]:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return None, False
    last = path[-1]
    if isinstance(data, dict):
        return data, last in data
    return data, isinstance(data, list) and isinstance(last, int) and last < len(data)


def _free_form_owner(model: type[BaseModel], data: dict, path: Path_) -> Optional[tuple[Path_, str]]:
    """If `path` lies under a free-form mapping (a `dict[str, Any]` field such as model.args), that
    field's path and description; else None."""
    for i in range(1, len(path)):
        parent = _model_at(model, data, path[: i - 1])
        info = parent.model_fields.get(str(path[i - 1])) if parent else None
        if info is None:
            return None
        if typing.get_origin(info.annotation) is dict or info.annotation is dict:
            return path[:i], info.description or ""
    return None


def _check_added_keys(added: list[_Added], model: type[BaseModel], data: dict) -> list[Problem]:
    """A plain override may add any key the schema defines; under a free-form mapping, where no
    schema catches a typo, a new key needs '+'."""
    out = []
    for item in added:
        owner = _free_form_owner(model, data, item.path)
        if owner:
            where, what = owner
            text = item.where.override or ""
            out.append(Problem(item.where, dotted(item.path),
                               f"{dotted(where)} is a free-form mapping{f' ({what})' if what else ''} and has no key "
                               f"'{dotted(item.path[len(where):])}'; to add it, write +{text}"))
    return out


def _has_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_has_interpolation(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_interpolation(v) for v in value)
    return False


def _interpolate(data: dict, positions: Positions, file: str, problems: list[Problem]) -> dict:
    if not _has_interpolation(data):
        return data  # OmegaConf costs ~8 ms per recipe; most recipes don't need it
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.create(data)
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        path = tuple(int(p) if p.isdigit() else p for p in re.split(r"[.\[\]]+", key) if p)
        problems.append(Problem(locate(positions, path, file), key, f"cannot resolve interpolation: {_first_line(exc)}"))
        return data


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# ----------------------------------------------------------------------------- plugin names
def _check_plugin_names(data: dict, positions: Positions, file: str, problems: list[Problem]) -> dict[str, tuple]:
    """Check every plugin block names a registered plugin; return the names per block."""
    chosen: dict[str, tuple] = {}
    bad: set[Path_] = set()
    for block in ("data", "strategy"):
        kind = PLUGIN_FIELDS[block]
        value = data.get(block)
        if not isinstance(value, dict):
            chosen[block] = (registry.names(kind)[0],)
            continue
        name = value.get("name")
        if name in registry.names(kind):
            chosen[block] = (name,)
        else:
            chosen[block] = (registry.names(kind)[0],)
            bad.add((block,))
            problems.append(_unknown_plugin(kind, name, positions, (block, "name"), file))
    monitors = data.get("monitors")
    names: list[str] = []
    if isinstance(monitors, list):
        seen: dict[str, int] = {}
        for i, item in enumerate(monitors):
            name = item.get("name") if isinstance(item, dict) else None
            if not isinstance(item, dict):
                continue
            if name not in registry.names("monitors"):
                bad.add(("monitors", i))
                problems.append(_unknown_plugin("monitors", name, positions, ("monitors", i, "name"), file))
            elif name in seen:
                problems.append(Problem(locate(positions, ("monitors", i), file), f"monitors[{i}]",
                                        f"monitor '{name}' is listed twice (first at monitors[{seen[name]}])"))
            else:
                seen[name] = i
                names.append(name)
    chosen["monitors"] = tuple(sorted(set(names)))
    chosen["_bad"] = tuple(bad)
    return chosen


def _unknown_plugin(kind: str, name: Any, positions: Positions, path: Path_, file: str) -> Problem:
    known = registry.names(kind)
    what = kind[:-1] if kind != "strategies" else "strategy"
    if name is None:
        msg = f"missing 'name': which {what}? one of: {', '.join(known)}"
    else:
        alias = aliases.value_hint(path[-2:] if kind == "strategies" else path, name)
        hint = f"; {alias}" if alias else did_you_mean(name, known)
        msg = f"unknown {what} {short(name)}{hint} (registered: {', '.join(known)})"
    return Problem(locate(positions, path, file), dotted(path), msg)


def _check_model_name(data: dict, positions: Positions, file: str, problems: list[Problem]) -> None:
    model = data.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    if not isinstance(name, str):
        return  # the schema reports missing/mistyped names
    if (name.startswith("torchvision.") and ":" not in name) or name in registry.names("models"):
        return
    if imports.is_import_path(name):
        why = imports.refusal(name)
        if why:
            problems.append(Problem(locate(positions, ("model", "name"), file), "model.name", why))
        return
    problems.append(Problem(
        locate(positions, ("model", "name"), file), "model.name",
        f"unknown model {short(name)}{did_you_mean(name, registry.names('models'))}; write torchvision.<name> "
        f"(e.g. torchvision.resnet50), an import path 'package.module:factory', or a registered model "
        f"({', '.join(registry.names('models'))})"))


# ----------------------------------------------------------------------------- pydantic errors
def _unwrap_models(tp: Any) -> list[type[BaseModel]]:
    """BaseModel classes reachable through Annotated / Optional / Union / list annotations."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap_models(typing.get_args(tp)[0])
    if origin in (typing.Union, list, getattr(__import__("types"), "UnionType", None)):
        return [m for arg in typing.get_args(tp) for m in _unwrap_models(arg)]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return []


def _model_at(model: type[BaseModel], data: Any, path: Path_) -> Optional[type[BaseModel]]:
    """The options model that validates the mapping at `path` (to list its accepted keys)."""
    candidates: list[type[BaseModel]] = [model]
    for part in path:
        if isinstance(part, int):
            data = data[part] if isinstance(data, list) and part < len(data) else None
            continue
        current = _pick(candidates, data)
        if current is None or part not in current.model_fields:
            return None
        candidates = _unwrap_models(current.model_fields[part].annotation)
        data = data.get(part) if isinstance(data, dict) else None
    return _pick(candidates, data)


def _pick(candidates: list[type[BaseModel]], data: Any) -> Optional[type[BaseModel]]:
    """The union member a mapping selects with its `name` tag."""
    if len(candidates) == 1:
        return candidates[0]
    tag = data.get("name") if isinstance(data, dict) else None
    for cand in candidates:
        name_field = cand.model_fields.get("name")
        if name_field is not None and tag in typing.get_args(name_field.annotation):
            return cand
    return None


def _clean_loc(loc: tuple, data: Any) -> Path_:
    """Drop discriminator tags pydantic inserts into locations ('strategy', 'ddp', 'x')."""
    out: list = []
    for part in loc:
        if isinstance(data, dict) and part not in data and data.get("name") == part:
            continue
        if isinstance(data, dict):
            data = data.get(part)
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            data = None
        out.append(part)
    return tuple(out)


def _section_fields(model: type[BaseModel], data: dict) -> dict[str, list[str]]:
    """Accepted keys of each top-level section (for 'max_steps -> trainer.max_steps' hints)."""
    out = {}
    for section in aliases.SECTIONS:
        found = _model_at(model, data, (section,))
        out[section] = list(found.model_fields) if found else []
    return out


def _pydantic_problem(err: dict, model: type[Recipe], data: dict, positions: Positions, file: str,
                      deleted: dict[Path_, Location]) -> Problem:
    path = _clean_loc(err["loc"], data)
    kind = err["type"]
    if kind == "missing" and path in deleted:  # `~key` removed a required key: name that override
        where = deleted[path]
    elif kind == "missing":  # point at the mapping that lacks the key
        where = locate(positions, path[:-1], file, key=True)
    else:
        where = locate(positions, path, file, key=kind == "extra_forbidden")
    if kind == "extra_forbidden":
        parent = _model_at(model, data, path[:-1])
        accepted = [k for k in parent.model_fields] if parent else []
        alias = aliases.key_hint(path[:-1], path[-1], _section_fields(model, data))
        msg = f"unknown key '{path[-1]}'" + (f"; {alias}" if alias else did_you_mean(str(path[-1]), accepted))
        if accepted:
            msg += f" (accepted: {', '.join(accepted)})"
    elif kind == "missing":
        parent = _model_at(model, data, path[:-1])
        info = parent.model_fields.get(str(path[-1])) if parent else None
        desc = f" ({info.description})" if info and info.description else ""
        msg = f"required field missing{desc}"
    elif kind == "literal_error":
        options = re.findall(r"'([^']*)'", err.get("ctx", {}).get("expected", ""))
        alias = aliases.value_hint(path, err["input"])
        hint = f"; {alias}" if alias else did_you_mean(str(err["input"]), options)
        msg = f"got {short(err['input'])}{hint}; expected one of: {', '.join(options)}"
    elif kind == "string_pattern_mismatch" and path == ("name",):
        msg = f"got {short(err['input'])}; use letters, digits, '.', '_' and '-' (it names run folders and MLflow runs)"
    else:
        msg = f"{err['msg']} (got {short(err['input'])})"
    return Problem(where, dotted(path), msg)


# ----------------------------------------------------------------------------- entry point
def resolve(path: str | Path, overrides: Sequence[str] = ()) -> Resolved:
    """Resolve and validate a recipe. Raises RecipeError listing every problem found."""
    path = Path(path)
    file = str(path)
    problems: list[Problem] = []
    try:
        top = confinement.real_path(path)
    except confinement.UnreadablePath as exc:
        raise RecipeError([Problem(Location(file), "", str(exc))]) from None
    data, positions, files = _compose(top, [top], problems, confinement.recipe_root(top))
    # report locations relative to what the user typed, not the resolved absolute path
    relabel = _display_names(path)
    positions = {k: relabel(v) for k, v in positions.items()}
    problems = [Problem(relabel(p.location), p.path, p.message, p.severity) for p in problems]
    files = [relabel(Location(f)).file for f in files]
    if problems:  # a broken composition makes every later message noise
        raise RecipeError(problems)
    data, added, deleted = _apply_overrides(data, positions, overrides, problems)
    raw = copy.deepcopy(data)
    hidden = secrets.secret_values(raw)
    data = _interpolate(data, positions, file, problems)
    if problems:
        raise RecipeError(_redacted(problems, hidden))
    if isinstance(data.get("monitors"), list):
        data["monitors"] = [{"name": m} if isinstance(m, str) else m for m in data["monitors"]]
    _check_model_name(data, positions, file, problems)
    chosen = _check_plugin_names(data, positions, file, problems)
    try:
        model = recipe_model(chosen["data"], chosen["strategy"], chosen["monitors"])
    except registry.PluginError as exc:
        raise RecipeError(problems + [Problem(Location(file), "", str(exc))]) from None
    problems += _check_added_keys(added, model, data)
    recipe = None
    try:
        recipe = model.model_validate(data)
    except ValidationError as exc:
        bad = chosen["_bad"]
        for err in exc.errors(include_url=False):
            p = _clean_loc(err["loc"], data)
            if any(p[: len(b)] == b for b in bad):
                continue  # already reported as an unknown plugin name
            found = _pydantic_problem(err, model, data, positions, file, deleted)
            origin = interpolation_origin(raw, p) if err["type"] not in ("missing", "extra_forbidden") else ""
            problems.append(Problem(found.location, found.path, f"{found.message}; {origin}") if origin else found)
    if recipe is not None and not problems:
        for rule_path, message in rules.check(recipe):
            problems.append(Problem(locate(positions, rule_path, file), dotted(rule_path), message))
        problems += _secret_path_components(recipe, hidden, positions, file)
    if problems:
        raise RecipeError(_redacted(_dedupe(_without_interpolated_values(problems, raw, data)), hidden))
    return Resolved(recipe=recipe, data=data, positions=positions, files=files, raw=raw, secrets=hidden)


def _interpolated_leaves(raw: Any, data: Any, path: Path_ = ()) -> list[tuple[str, Any]]:
    """(expression, the value it produced) for every `${...}` value of the recipe."""
    if isinstance(raw, str):
        return [(raw, data)] if "${" in raw else []
    if isinstance(raw, dict) and isinstance(data, dict):
        return [leaf for k, v in raw.items() if k in data for leaf in _interpolated_leaves(v, data[k], path + (k,))]
    if isinstance(raw, list) and isinstance(data, list):
        return [leaf for v, d in zip(raw, data) for leaf in _interpolated_leaves(v, d, path)]
    return []


def _without_interpolated_values(problems: list[Problem], raw: dict, data: dict) -> list[Problem]:
    """Messages say where an interpolated value came from, never what it is: an untrusted recipe's
    `${...}` can pull a value from the environment or another key, and an error would otherwise print
    it into a CI log. A value written literally in its expression (an env default) stays visible."""
    masks: list[tuple[str, str]] = []
    for expr, value in _interpolated_leaves(raw, data):
        if isinstance(value, bool) or value is None or str(value) in expr:
            continue
        shown = {short(value), json.dumps(value, default=str), str(value)}
        masks += [(text, f"<the value of {expr}>") for text in shown if len(text) >= 4]
        masks += [(f"got {short(value)}", f"got <the value of {expr}>")]
    if not masks:
        return problems
    masks.sort(key=lambda m: -len(m[0]))
    out = []
    for p in problems:
        message = p.message
        for text, replacement in masks:
            message = message.replace(text, replacement)
        out.append(Problem(p.location, p.path, message, p.severity))
    return out


def _secret_path_components(recipe: Recipe, hidden: frozenset[str], positions: Positions,
                            file: str) -> list[Problem]:
    """A folder name is written to disk and shown everywhere: it cannot carry a secret."""
    return [Problem(locate(positions, path, file), dotted(path),
                    "comes from a secret environment variable, but it names a folder (written to disk and "
                    "printed); use a non-secret value")
            for path, value in paths.field_values(recipe)
            if value and secrets.redact_text(value, hidden) != value]


def _redacted(problems: list[Problem], hidden: frozenset[str]) -> list[Problem]:
    return [Problem(p.location, p.path, secrets.redact_text(p.message, hidden), p.severity) for p in problems]


def _display_names(typed: Path) -> Callable[[Location], Location]:
    """Show file names as the user addressed them: the path they typed, others relative to the cwd."""
    typed_abs = str(typed.resolve())

    @lru_cache(maxsize=None)
    def name(file: str) -> str:
        if file == typed_abs:
            return str(typed)
        rel = os.path.relpath(file) if os.path.isabs(file) else file
        return file if rel.startswith("../../..") else rel

    def relabel(loc: Location) -> Location:
        return loc if loc.override is not None else Location(name(loc.file), loc.line, loc.col)

    return relabel


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen, out = set(), []
    for p in problems:
        if (str(p)) not in seen:
            seen.add(str(p))
            out.append(p)
    return out
