"""The Config keys page: every key of the schema with its type, the default the default run
composes, what it accepts and what it means (each field's ``key(...)`` in dxrun/config/schema.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from docs.reference.markdown import cell
from dxrun.config import registry, schema
from dxrun.cost import TARGETS


@dataclasses.dataclass(frozen=True)
class Key:
    key: str
    type: str
    default: Any
    allowed: str
    meaning: str


def _type_name(tp: Any) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "").replace("Any", "any")


def _allowed(key: str, type_text: str) -> str:
    """What the key's field says it accepts: its choices, its range, or why it has none."""
    null = " or null" if schema.null_is_a_value(key) else ""
    choices = tuple(TARGETS) if key == "plan.target" else schema.choices_of(key)
    if choices:
        return " \\| ".join(f"`{c}`" for c in choices) + null
    if key in schema.RANGES:
        return str(schema.RANGES[key]) + null
    if key in schema.UNRANGED:
        return schema.UNRANGED[key].partition(":")[0]
    if type_text == "bool":
        return "`true` \\| `false`"
    return ""


def config_keys() -> list[Key]:
    """Every key of the schema in order, with the default the default run composes and what its
    field says (``dxrun.config.schema.key``): the accepted values and the meaning."""
    defaults = _composed_defaults()
    out = []
    for key, f in schema.FIELDS.items():
        type_text = _type_name(f.type)
        out.append(Key(key, type_text, defaults.get(key), _allowed(key, type_text),
                       f.metadata["meaning"]))
    return out


def _composed_defaults() -> dict[str, Any]:
    """``python -m dxrun``'s config (the default options of every group), unresolved."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    registry.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(registry.conf_dir()), version_base=None):
        cfg = compose("config")
    GlobalHydra.instance().clear()
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and prefix.count(".") == 0 and k == "profile":
                walk(v, f"{prefix}.{k}")  # a nested section (train.profile)
            else:
                flat[f"{prefix}.{k}"] = v

    for section, values in OmegaConf.to_container(cfg, resolve=False).items():
        walk(values, section)
    return flat


def config_markdown() -> str:
    groups = {g: sorted(p.stem for p in (registry.conf_dir() / g).glob("*.yaml"))
              for g in ("model", "parallelism", "data", "optimizer", "logger")}
    out = ["# Config keys", "",
           "Every key of the run config, generated from the schema in `dxrun/config/schema.py`: each "
           "field's type and default, and the meaning, range or choices its `key(...)` carries. "
           "The default is what `python -m dxrun` composes (`model=tiny`, `parallelism=auto`, "
           "`data=markov`, `optimizer=adamw`, `logger=wandb`); a preset of a group may set another "
           "(see [Presets](presets.md)). Set any key on the command line: "
           "`python -m dxrun section.key=value`. A value outside its range is refused in one "
           "line before anything runs.", ""]
    by_section: dict[str, list[Key]] = {}
    for k in config_keys():
        by_section.setdefault(k.key.partition(".")[0], []).append(k)
    sections = {f.name: f.metadata["meaning"] for f in dataclasses.fields(schema.RunConfig)}
    for section, keys in by_section.items():
        out += [f"## {section}", "", sections[section][:1].upper() + sections[section][1:] + ".",
                ""]
        if section in groups:
            out += [f"Group `{section}`: options " + ", ".join(f"`{o}`" for o in groups[section])
                    + f" (`{section}=NAME`, files in `conf/{section}/`).", ""]
        out += ["| key | type | default | accepted | meaning |", "|---|---|---|---|---|"]
        out += [f"| `{k.key}` | `{k.type}` | `{cell(k.default)}` | {k.allowed} | "
                f"{cell(k.meaning)} |" for k in keys]
        out.append("")
    out += ["## Accepted ranges", "",
            "The same ranges by kind (`dxrun.config.schema.ranges_markdown()`); the numeric keys left "
            "out, each with its reason, are `dxrun/config/schema.py: UNRANGED`.", "",
            schema.ranges_markdown(), ""]
    return "\n".join(out)
