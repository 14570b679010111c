"""A run's checkpoint, loaded for use after training (``dxrun.evaluate``, ``dxrun.sample``).

``python -m dxrun.<tool> <run dir | checkpoints dir | step dir> [--best] [option=value ...]
[overrides ...]`` (``--best``: the checkpoint ``checkpoint.keep_best`` kept): the tool's own
options (``prompt=``, ``n=``, ...) beside config overrides (``parallelism=tp2``,
``data.path=...``, ``eval.batches=8``). The config is the one the checkpoint was written with
(its meta item, read as data: a stored ``${...}`` is that string, never an interpolation), with
the overrides applied as ``python -m dxrun`` would apply them: a group option
(``parallelism=tp2``, ``data=tokens``) replaces that section with its preset, a key replaces
one value. The model's shape and vocabulary are the checkpoint's and cannot be overridden. The
parameters are read straight into the chosen mesh's shardings, as a resume does; a run's layout
that the visible devices cannot hold gives way to those devices data-parallel (``plan_on_devices``).

Bad input is a ConfigError: one line ``dxrun.<tool>: error: ...``, exit 2, no traceback.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from dxrun.checks import validate
from dxrun.config import HF_PREFIX, ConfigError, RunConfig, first_line
from dxrun.config.registry import check_composed, check_keys, composition_error, conf_dir, register
from dxrun.plan import MeshPlan, make_plan, recorded
from dxrun.run import DEVICE_COUNT_FLAG, collect_cycles_rarely, command_imports, simulate_cpu_devices

if TYPE_CHECKING:
    from dxrun.experiment import Experiment

log = logging.getLogger("dxrun")

DEFAULT_CPU_DEVICES = RunConfig().runtime.cpu_devices


def split_args(tool: str, argv: list[str], options: dict[str, Any]
               ) -> tuple[Path, dict[str, Any], list[str]]:
    """(checkpoint path, the tool's ``options`` with the given ones parsed to their default's
    type, config overrides). The path is the argument that is not ``key=value`` (``is_path``):
    Hydra's override_dirname names dirs like ``runs/optimizer.lr=0.1``."""
    paths = [a for a in argv if is_path(a) and a != BEST]
    if len(paths) != 1:
        raise ConfigError(f"give one run dir or checkpoint dir, then key=value arguments "
                          f"(got {len(paths)} paths: {' '.join(paths) or 'none'}); usage: "
                          f"python -m dxrun.{tool} <run dir> [key=value ...]")
    out, overrides = dict(options), []
    for arg in argv:
        if arg == BEST:  # passed on to ``load`` with the overrides
            overrides.append(arg)
            continue
        if is_path(arg):
            continue
        key, _, value = arg.partition("=")
        if key == "best":  # load_model's best=True, on the command line
            raise ConfigError(f"{arg} is no option; ask for checkpoint.keep_best's checkpoint "
                              f"with {BEST}")
        if key not in options:
            overrides.append(arg)
            continue
        kind = type(options[key])
        try:
            out[key] = kind(value)
        except ValueError:
            raise ConfigError(f"{key}={value} is not a {kind.__name__}; e.g. "
                              f"{key}={options[key]}") from None
    return Path(paths[0]), out, overrides


# The best checkpoint by checkpoint.keep_best (summary.json's best_checkpoint), not the newest.
BEST = "--best"

KEY = re.compile(r"[+~]{0,2}[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*")


def is_path(arg: str) -> bool:
    """An existing file or dir, or an argument that is not ``key=value`` with a dotted key
    (``n=2``, ``parallelism=tp2``, ``+data.x=1``): ``outputs/lr=0.1`` is a path."""
    key, eq, _ = arg.partition("=")
    # os.path.exists: an argument too long to be a file name (a long prompt=) is no file,
    # where Path.exists raises OSError (ENAMETOOLONG).
    return not eq or not KEY.fullmatch(key) or os.path.exists(os.path.expanduser(arg))


def token_ids(text: str) -> list[int]:
    """Token ids as a command line gives them: separated by spaces or commas (``1 2 3``,
    ``1,2,3``, ``[1, 2, 3]``); ValueError for anything else."""
    words = [w for w in re.split(r"[\s,]+", text.strip().removeprefix("[").removesuffix("]"))
             if w]
    if not words:
        raise ValueError("no token ids")
    return [int(w) for w in words]


def start_devices(overrides: list[str]) -> bool:
    """Simulate ``runtime.cpu_devices`` CPU devices (default 8, like a run) before JAX starts:
    reading the checkpoint's meta already starts JAX, so the count comes from the command
    line, not from the checkpoint. False: JAX had started in this process (``load_model``
    called after other JAX work), its device count fixed."""
    given = [o.partition("=")[2] for o in overrides if o.startswith("runtime.cpu_devices=")]
    try:
        n = int(given[-1]) if given else DEFAULT_CPU_DEVICES
    except ValueError:
        raise ConfigError(f"runtime.cpu_devices={given[-1]} is not an integer; e.g. "
                          "runtime.cpu_devices=8") from None
    if n <= 0:
        raise ConfigError(f"runtime.cpu_devices={n} must be positive; e.g. runtime.cpu_devices=8")
    return simulate_cpu_devices(n)


INTERPOLATION = re.compile(r"(\\*)\$\{")  # "${" and the backslashes before it
# Keys older checkpoints' configs hold and the schema no longer has (the tests' faults, now
# environment variables: dxrun/run/faults.py).
RETIRED_TRAIN_KEYS = ("inject_nan_at_step", "hold_at_step", "inject_error_at_step")


def as_data(value: Any) -> Any:
    """A value read from a checkpoint's meta, escaped so that OmegaConf holds it as written: a
    string with ``${...}`` in it comes back as that string, never resolved (it could name an
    environment variable, ``${oc.env:...}``, or a file, ``${data_meta:...}``, and the saved
    config was resolved when the run wrote it). OmegaConf reads ``\\${`` as a literal ``${``
    and each ``\\\\`` before it as one backslash: n backslashes before ``${`` become 2n + 1."""
    if isinstance(value, str):
        return INTERPOLATION.sub(lambda m: "\\" * (2 * len(m[1]) + 1) + "${", value)
    if isinstance(value, dict):
        return {k: as_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_data(v) for v in value]
    return value


def compose(saved: dict[str, Any], overrides: list[str]) -> DictConfig:
    """The checkpoint's config (``saved``, read as data: ``as_data``) with ``overrides``
    applied as ``python -m dxrun`` applies them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    register()
    try:
        # The overrides composed on the defaults: Hydra parses their values and checks them
        # against the schema; a group option brings its preset.
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3",
                                   job_name="dxrun"):
            given = hydra_compose(config_name="config", overrides=overrides)
        parsed = OverridesParser.create().parse_overrides(overrides)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - one line for what we can phrase, else Hydra's
        raise ConfigError(composition_error(e) or str(e).splitlines()[0]) from None
    check_keys(given)
    OmegaConf.resolve(given)
    saved = as_data(saved)
    for retired in RETIRED_TRAIN_KEYS:  # a checkpoint written while they were keys
        saved.get("train", {}).pop(retired, None)
    # (The saved "plan" is the mesh plan, written over the plan section: plan mode only.)
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig),
                          {k: v for k, v in saved.items()
                           if k in RunConfig.__dataclass_fields__ and k != "plan"})
    for o in parsed:
        key = o.key_or_group.lstrip("+~")
        if "." in key:
            OmegaConf.update(cfg, key, OmegaConf.select(given, key), merge=False)
        else:  # a group option: its whole preset (with any keys given after it)
            cfg[key] = given[key]
    given_keys = {o.key_or_group for o in parsed}
    if not given_keys & {"data.batch_size", "data.per_device_batch_size"}:
        # The global batch the run used (saved resolved in data.batch_size), whatever the mesh:
        # a per-device batch would make other batches on another mesh.
        cfg.data.per_device_batch_size = None
    if cfg.data.name == "text" and saved["data"].get("name") == "text" and (
            "data.tokenizer" not in given_keys):
        # The tokenizer belongs to the model (its ids are the model's vocabulary): another
        # text corpus is read with the run's own unless one is named.
        cfg.data.tokenizer, cfg.data.vocab_size = (saved["data"]["tokenizer"],
                                                   saved["data"]["vocab_size"])
    return cfg


@dataclass
class Loaded:
    cfg: RunConfig  # the checkpoint's config with the overrides
    ckpt_meta: dict[str, Any]  # the checkpoint's meta (config as written, W&B run id, ...)
    step: int
    path: Path  # the step dir read
    run_dir: Path | None  # the run dir given (eval.json and W&B go there): ``given_run_dir``
    exp: Experiment  # on the chosen mesh
    params: dict  # on that mesh


def load(path: Path, overrides: list[str], key: str, with_data: bool = True,
         adjust: Callable[[RunConfig], None] | None = None, step: int | None = None,
         layout: str | None = None) -> Loaded:
    """The newest checkpoint under ``path`` (or step ``step`` of its checkpoints, or the step
    dir given), its parameters placed on the mesh of its config with ``overrides``; ``adjust``
    may change the config before the mesh plan (sampling sets the batch). ``layout``: the
    ``parallelism`` preset the tool runs on when no override names one (None: the run's own);
    either falls back to the devices found where it does not fit them (``plan_on_devices``).
    ``key`` names the path argument in refusals. A Hugging Face directory loads as step 0
    (``compose_hf``)."""
    with command_imports():
        from dxrun.experiment import Experiment, visible_devices  # imports JAX
        from dxrun.tools.live import read_newest, store  # imports JAX

    best, overrides = BEST in overrides, [o for o in overrides if o != BEST]
    named = names_layout(overrides)
    if layout is not None and not named:
        overrides = [f"parallelism={layout}", *overrides]
    hf = is_hf_dir(path)
    whose = "the tool's" if layout is not None else "the defaults'" if hf else "the run's"
    if hf and best:
        raise ConfigError(f"--best: {path} is a Hugging Face directory, one set of weights "
                          "with no best checkpoint; drop --best")
    if not hf:
        # Before JAX starts: no devices are needed to refuse. Absolute: Orbax refuses relative
        # paths.
        resume = store.locate(path.expanduser().absolute(), key)
        if step is not None:
            if step not in (have := store.committed_steps(resume.directory)):
                raise ConfigError(f"step {step}: {resume.directory} has no committed step "
                                  f"{step} (it has {', '.join(map(str, have))})")
            resume = store.locate(resume.directory / str(step), key)
    started = not start_devices(overrides)

    if hf:
        cfg = compose_hf(path, overrides)
        if adjust is not None:
            adjust(cfg)
        validate(cfg)
        cfg, plan = plan_on_devices(cfg, visible_devices(), named, whose, started)
        # The batch and sequence length the plan resolved, as a checkpoint's config records them
        cfg = recorded(cfg, plan.global_batch, plan.seq_len)
        exp = Experiment.build(cfg, plan, with_data=with_data)
        log.info("%s on mesh %s", path, " x ".join(f"{a}={s}" for a, s in exp.mesh.shape.items()))
        return Loaded(cfg, {}, 0, path.expanduser().absolute(), None, exp, exp.hf_params())

    def build(meta: dict[str, Any], where: Path) -> tuple[DictConfig, Experiment]:
        """(config, experiment) of checkpoint ``where`` (``meta``: its meta)."""
        cfg = compose(meta["config"], overrides)
        if diff := store.changed(cfg, meta["config"],
                                      store.MODEL_SHAPE + store.VOCABULARY):
            k, now, then = diff
            raise ConfigError(f"{k}={now} but checkpoint {where} was written with {k}={then} "
                              f"(a checkpoint's model shape is fixed); drop the {k} override")
        if adjust is not None:
            adjust(cfg)
        validate(cfg)
        cfg, plan = plan_on_devices(cfg, visible_devices(), named, whose, started)
        return cfg, Experiment.build(cfg, plan, with_data=with_data)

    meta, where, cfg, exp, params = read_newest(resume, best, step is not None, build)
    log.info("checkpoint %s (step %d) on mesh %s", where, int(where.name),
             " x ".join(f"{a}={s}" for a, s in exp.mesh.shape.items()))
    return Loaded(cfg, meta, int(where.name), where, given_run_dir(path, resume.directory), exp,
                  params)


def names_layout(overrides: list[str]) -> bool:
    """Whether an override names the layout: the ``parallelism`` group or one of its keys."""
    return any(o.lstrip("+~").partition("=")[0].split(".")[0] == "parallelism" for o in overrides)


def plan_on_devices(cfg: DictConfig, devices: tuple[Any, ...], named: bool, whose: str,
                    started: bool = False) -> tuple[DictConfig, MeshPlan]:
    """(the config, its mesh plan) on ``devices`` (``visible_devices()``): the config's layout
    where the plan accepts it. Where it does not (more devices than are visible, axes that do
    not multiply to them, a batch its replicas do not divide) and no override ``named`` a
    layout, the most visible devices, data-parallel, that the plan accepts (a dp8 run on one
    accelerator: dp=1), with one line saying so (``whose`` layout it replaces). A layout the
    overrides named is refused as a run refuses it (key, value, fix), as is one no data-parallel
    count fixes (the refusal of the config's own). ``started``: JAX had started before the tool
    could simulate CPU devices, so a layout wider than those visible says what works there
    (a run's ``runtime.cpu_devices`` cannot)."""
    try:
        return cfg, make_plan(cfg, *devices)
    except ConfigError as e:
        n, platform, par = devices[0], devices[1], cfg.parallelism
        if named and started and platform == "cpu" and par.n_devices > n:
            raise ConfigError(
                f"parallelism={par.name} needs {par.n_devices} devices but JAX had started in "
                f"this process with {n} cpu device{'s' if n != 1 else ''}, a count fixed once it "
                "starts (runtime.cpu_devices acts only before); load the model before anything "
                f"else starts JAX, or start Python with XLA_FLAGS={DEVICE_COUNT_FLAG}="
                f"{par.n_devices}") from None
        if named:
            raise
        refusal = e
    for k in range(n, 0, -1):
        alt = copy.deepcopy(cfg)
        alt.parallelism.merge_with({"name": f"dp{k}", "n_devices": k, "dp": k, "fsdp": 1,
                                    "cp": 1, "tp": 1, "sequence_parallel": False,
                                    "on_mismatch": "error", "search": "none"})
        try:
            plan = make_plan(alt, *devices)
        except ConfigError:
            continue
        log.warning("%s parallelism=%s does not fit here (%s): laid out on dp=%d instead, %d of "
                    "the %d visible %s devices data-parallel (a parallelism override names "
                    "another layout)", whose, cfg.parallelism.name, str(refusal).split("; ")[0],
                    k, k, n, platform)
        return alt, plan
    raise refusal


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face directory (config.json, no dxrun checkpoints)."""
    path = path.expanduser()
    return (path / "config.json").is_file() and not (path / "checkpoints").is_dir()


def compose_hf(path: Path, overrides: list[str]) -> DictConfig:
    """The config of a Hugging Face directory used as a checkpoint: the defaults with
    ``overrides`` and ``model.init_from=hf:<path>`` (its config.json the model, its
    tokenizer.json a text run's tokenizer)."""
    given = [*overrides, f"model.init_from={HF_PREFIX}{path.expanduser().absolute()}"]
    register()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3",
                                   job_name="dxrun"):
            cfg = hydra_compose(config_name="config", overrides=given)
    except Exception as e:  # noqa: BLE001 - one line for what we can phrase, else Hydra's
        raise ConfigError(composition_error(e) or str(e).splitlines()[0]) from None
    check_composed(cfg, given)
    return cfg


def given_run_dir(path: Path, checkpoints: Path) -> Path | None:
    """The run dir the command line points at: ``path`` itself when it holds ``checkpoints/``
    or ``checkpoints.txt``, else the dir around ``<run dir>/checkpoints`` when ``path`` is
    that dir or a step dir in it (``checkpoints``: the dir ``checkpointing.locate`` found). None
    for checkpoints outside a run dir (a shared ``checkpoint.dir``, a step dir copied
    elsewhere). Never the run dir recorded in the checkpoint's meta: a copied run's results
    would land in the original, and a moved run's in a dir that is gone."""
    from dxrun.checkpointing import POINTER  # imports JAX

    path = path.expanduser().absolute()
    if (path / "checkpoints").is_dir() or (path / POINTER).is_file():
        return path
    return checkpoints.parent if checkpoints.name == "checkpoints" else None


def usage(run: Callable[[list[str]], None]) -> str:
    """A tool's ``--help``: ``usage:`` and its module's docstring (which opens with the command
    line), without the reST markup. ``--help`` is never a path: a run dir named so is ``./--help``."""
    doc = sys.modules[run.__module__].__doc__ or ""
    return "usage: " + doc.replace("``", "").strip()


def main(tool: str, run: Callable[[list[str]], None]) -> None:
    """A tool's entry point: bad input is one line and exit 2, never a traceback."""
    collect_cycles_rarely()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("jax._src.xla_bridge", "absl", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(usage(run))
        return
    try:
        run(sys.argv[1:])
    except ConfigError as e:
        print(f"dxrun.{tool}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - a crash: one line, the traceback in a file
        import tempfile
        import traceback

        # A new file only this user can read: a predictable name in a shared /tmp could be
        # a planted link to another file (mkstemp never follows one).
        fd, name = tempfile.mkstemp(prefix=f"dxrun.{tool}.", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write("".join(traceback.format_exception(e)))
        path = Path(name)
        first = first_line(e)
        print(f"dxrun.{tool}: error: {type(e).__name__}: {first} (full traceback: {path})",
              file=sys.stderr)
        sys.exit(1)
