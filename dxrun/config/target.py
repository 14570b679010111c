"""Hydra's ``_target_`` convention: a dotted path to your own factory (``model._target_``,
``data._target_``, ``optimizer._target_``), imported without Hydra's logging and checked to take
what dxrun passes it; either failure one line naming the key.

No JAX import here (your module may import it).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dxrun.config.errors import ConfigError, first_line

if TYPE_CHECKING:
    from dxrun.config.schema import RunConfig

# Each section's ``_target_``: what dxrun passes it by keyword beside ``<section>.kwargs`` (the
# name, and where its value comes from: the refusal shows the call) and an example path.
# The protocols: dxrun/model/user_model.py, dxrun/data/__init__.py, dxrun/experiment.py.
PASSES: dict[str, tuple[dict[str, str], str]] = {
    "model": ({"vocab_size": "model.vocab_size", "rngs": "nnx.Rngs(train.seed)"},
              "mypkg.MyModel"),
    "data": ({"batch_size": "the global batch", "seq_len": "the window",
              "vocab_size": "model.vocab_size", "seed": "data.seed"}, "mypkg.MyData"),
    "optimizer": ({"learning_rate": "the schedule of optimizer.lr"}, "optax.nadamw"),
}


def checked_factory(section: str, target: str, kwargs: Mapping[str, Any]) -> Any:
    """``<section>._target_``'s factory (``locate``), checked to take ``kwargs`` (the section's
    ``kwargs``) and what dxrun passes it (``PASSES``), all by keyword; a ConfigError naming the
    key, the factory's signature and dxrun's call when it does not."""
    passes, example = PASSES[section]
    factory = locate(f"{section}._target_", target, example)
    if why := call_refusal(section, target, factory, list(kwargs)):
        raise ConfigError(why)
    return factory


def check_targets(cfg: RunConfig) -> None:
    """Every ``_target_`` of ``cfg`` imported and checked against what dxrun passes it: before
    anything compiles, so that a plug-in that cannot be built is one line, not a crash."""
    for name in PASSES:  # model, data, optimizer
        section = getattr(cfg, name)
        if section._target_:
            checked_factory(name, section._target_, section.kwargs)


def _signature(factory: Any) -> inspect.Signature | None:
    """How ``factory(...)`` is called: a class's ``__init__`` less ``self`` (a metaclass's
    ``__call__``, as Flax NNX modules have, says only ``*args, **kwargs``); None where Python
    cannot tell (a builtin)."""
    try:
        if isinstance(factory, type) and factory.__init__ is not object.__init__:
            sig = inspect.signature(factory.__init__)
            return sig.replace(parameters=list(sig.parameters.values())[1:])
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return None


class _Elided:
    def __repr__(self) -> str:
        return "..."


def _shown_default(default: Any) -> Any:
    """A default as the refusal shows it: a short literal as it is; a function, a class or a
    long value as ``...`` (its repr names an address, or takes the line)."""
    if default is inspect.Parameter.empty:
        return default
    text = repr(default)
    return default if len(text) <= 16 and not text.startswith("<") else _Elided()


def call_refusal(section: str, target: str, factory: Any, kwargs: list[str]) -> str | None:
    """Why dxrun's call of ``factory`` (``<section>._target_=target``) with ``kwargs`` (the
    names of ``<section>.kwargs``) and ``PASSES``' would fail; None when it would not (or
    Python cannot tell)."""
    key, passes = f"{section}._target_", PASSES[section][0]
    if clash := [k for k in kwargs if k in passes]:
        return (f"{section}.kwargs.{clash[0]} is passed by dxrun itself ({passes[clash[0]]}) to "
                f"{key}={target}; drop {section}.kwargs.{clash[0]}")
    if not callable(factory):
        return (f"{key}={target} is a {type(factory).__name__}, not a class or function; give "
                f"the dotted path of one, e.g. {PASSES[section][1]}")
    if (sig := _signature(factory)) is None:
        return None
    given = [*kwargs, *passes]
    try:
        sig.bind(**dict.fromkeys(given))
        return None
    except TypeError as e:
        bind_error = first_line(e)
    name = target.rsplit(".", 1)[-1]
    params = sig.parameters.values()
    shown = name + str(sig.replace(
        parameters=[p.replace(annotation=p.empty, default=_shown_default(p.default))
                    for p in params],
        return_annotation=inspect.Signature.empty))
    call = f"{name}(" + ", ".join([f"**{section}.kwargs",
                                   *(f"{k}=<{v}>" for k, v in passes.items())]) + ")"
    by_keyword = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    missing = [p.name for p in params if p.default is p.empty and p.name not in given
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unexpected = [] if any_keyword else [k for k in given if k not in by_keyword]
    if unexpected and unexpected[0] in passes:
        k = unexpected[0]
        problem = f"takes no {k}"
        fix = f"point {key} at a factory that takes {k} (a {k} parameter, or **kwargs)"
    elif unexpected:
        k = unexpected[0]
        problem = f"takes no {k}, given as {section}.kwargs.{k}"
        fix = f"drop {section}.kwargs.{k}, or rename it to one of {name}'s parameters"
    elif missing:
        k = missing[0]
        problem = f"needs {k}, which neither dxrun nor {section}.kwargs gives"
        fix = f"set +{section}.kwargs.{k}=<value>, or give {k} a default"
    else:  # e.g. a parameter dxrun passes by keyword taken by position only
        problem, fix = f"cannot be called so ({bind_error})", f"make {name} take those keywords"
    return (f"{key}={target} does not take what dxrun passes: {shown} {problem}; dxrun calls "
            f"{call}: {fix}")


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
