"""Hydra's ``_target_`` convention: a dotted path to your own factory (``model._target_``,
``data._target_``, ``optimizer._target_``), imported without Hydra's logging, its failure one
line naming the key."""

from __future__ import annotations

import importlib
from typing import Any

from dxrun.errors import ConfigError, first_line


def locate(key: str, target: str, example: str) -> Any:
    """The object at ``target`` (``package.module.Name``, or deeper attributes); a ConfigError
    naming ``key`` when nothing is there. ``example``: a path the refusal suggests."""
    parts = target.split(".")
    why = f"no module named {parts[0]}"
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and not module.startswith(e.name):
                why = first_line(e)  # the module exists but an import inside it failed
                break
            continue
        except Exception as e:  # noqa: BLE001 - any error of the user's module, in one line
            why = f"{type(e).__name__} importing {module}: {first_line(e)}"
            break
        for name in parts[i:]:
            if not hasattr(obj, name):
                why = f"{'.'.join(parts[:i])} has no {name}"
                break
            obj = getattr(obj, name)
        else:
            return obj
        break
    raise ConfigError(f"{key}={target} cannot be imported ({why}); give a dotted path on the "
                      f"PYTHONPATH, e.g. {example}")
