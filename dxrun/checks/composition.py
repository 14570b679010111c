"""The command line checked before Hydra runs it: every job composes, its run dir can be made.

Hydra reports a bad override or an unwritable dir with a traceback; this says it in one line
naming the key and the fix, before anything is made.
"""

from __future__ import annotations

from omegaconf import OmegaConf, open_dict

from dxrun.config import ConfigError
from dxrun.config.registry import check_keys, composition_error, conf_dir
from dxrun.run import dir_refusal


def composition_refusal(argv: list[str]) -> str | None:
    """Compose the config the way Hydra will and turn a composition error (unknown option, unknown
    key, wrong type) or a run (sweep) dir that cannot be made into one line naming the key and
    the fix (None: it composes): for a single run, for every value of a multirun's sweeps, and
    beside ``hydra.*`` overrides (how schedulers launch). Other Hydra flags (--cfg, --help,
    -cn, ...) are left to Hydra."""
    flags = [a for a in argv if a.startswith("-")]
    if any(f not in ("-m", "--multirun") for f in flags):
        return None
    from hydra import compose, initialize_config_dir

    # Hydra makes the run (or sweep) dir before dxrun's main runs: a dir it cannot make would
    # end in Hydra's traceback, so it is tried here first.
    out_key, default_dir = (("hydra.sweep.dir", "multirun/<date>/<time>") if flags
                            else ("hydra.run.dir", "outputs/<date>/<time>"))
    checked: set[str] = set()
    try:
        _group_values_are_names([a for a in argv if a not in flags])
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="dxrun"):
            for overrides in _one_job_per_sweep_value([a for a in argv if a not in flags]):
                cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
                out_dir = OmegaConf.select(cfg, out_key)
                with open_dict(cfg):
                    del cfg["hydra"]
                check_keys(cfg)
                if out_dir not in checked:
                    checked.add(out_dir)
                    if why := dir_refusal(out_key, out_dir, f"give a dir you can write to, or "
                                          f"leave {out_key} out ({default_dir})"):
                        raise ConfigError(why)
    except ConfigError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - anything we cannot phrase better goes to Hydra
        return composition_error(e) or None
    return None


def _group_values_are_names(argv: list[str]) -> None:
    """A group option Hydra's grammar reads as a number or a boolean (``debug=nan``,
    ``model=1``) ends in Hydra's traceback before any option is looked up: refused here."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for o in OverridesParser.create().parse_overrides(argv):
        key = o.get_key_element()
        if o.is_sweep_override() or not (conf_dir() / key).is_dir():
            continue
        value = o.value()
        if value is not None and not isinstance(value, (str, list)):
            options = sorted(p.stem for p in (conf_dir() / key).glob("*.yaml"))
            raise ConfigError(f"{key}={o.get_value_element_as_str()}: Hydra reads this as a "
                              f"{type(value).__name__}, not an option of the {key} group; "
                              f"choose one of: {', '.join(options)}")


def _one_job_per_sweep_value(argv: list[str]) -> list[list[str]]:
    """Override lists that together use every value of every sweep (``a=1,2 b=x,y`` gives
    ``a=1 b=x``, ``a=2 b=x``, ``a=1 b=y``): each value composes once, not the full grid."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    # glob() sweeps name group options by pattern; Hydra expands (and reports) those itself.
    parsed = [o for o in OverridesParser.create().parse_overrides(argv)
              if o.value_type != ValueType.GLOB_CHOICE_SWEEP]
    first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
             if o.is_sweep_override() else o.input_line for o in parsed]
    jobs = [first]
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            for value in list(o.sweep_string_iterator())[1:]:
                jobs.append([*first[:i], f"{o.get_key_element()}={value}", *first[i + 1:]])
    return jobs
