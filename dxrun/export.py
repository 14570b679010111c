"""``python -m dxrun.export <run dir | checkpoints dir | step dir> [--step N | --best] --to <dir>
[overrides]``: a run's checkpoint as a Hugging Face directory that ``transformers`` loads.

The newest committed checkpoint (or step N of the run's checkpoints, the one
``checkpoint.keep_best`` kept with ``--best``, or the step dir given) is
restored onto the mesh of the run's ``parallelism`` (or the overrides', ``parallelism=dp1``; where
the run's does not fit the visible devices, those devices data-parallel, said in one line) and
written by ``dxrun.hf``: config.json, safetensors files of at most 5 GB (with their index),
and the run's tokenizer.json when it has one. A GPT-2-style model becomes ``GPT2LMHeadModel``,
a Llama-style one ``LlamaForCausalLM``; a model with no HF equivalent is refused in one line
naming what differs. ``--to`` must be new or empty; nothing is written on a refusal.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dxrun.config import ARCHITECTURES, ConfigError, DataConfig, RunConfig, model_type_of
from dxrun.data import recorded_tokenizer
from dxrun.hf import save_hf
from dxrun.tools.checkpoint import load, main, split_args

log = logging.getLogger("dxrun")


def flags(argv: list[str]) -> tuple[Path, int | None, list[str]]:
    """(``--to``, ``--step`` or None, the other arguments)."""
    out: dict[str, str] = {}
    rest, it = [], iter(argv)
    for a in it:
        name, eq, value = a.partition("=")
        if name in ("--to", "--step"):
            if not eq:
                value = next(it, "")
            if not value:
                raise ConfigError(f"{name} needs a value; e.g. {name} "
                                  f"{'hf_out' if name == '--to' else '1000'}")
            out[name] = value
        else:
            rest.append(a)
    if "--to" not in out:
        raise ConfigError("give --to <dir>, the Hugging Face directory to write")
    try:
        step = int(out["--step"]) if "--step" in out else None
    except ValueError:
        raise ConfigError(f"--step {out['--step']} is not a step number; e.g. --step 1000") from None
    return Path(out["--to"]).expanduser().absolute(), step, rest


def tokenizer_of(d: DataConfig) -> Path | None:
    """The run's tokenizer.json: data=text's ``data.tokenizer``, or the one a token dir's
    meta.json names; None for bytes and markov runs (no HF tokenizer to write)."""
    if d.name == "text" and d.tokenizer:
        return Path(d.tokenizer).expanduser()
    if d.name == "tokens":
        name = recorded_tokenizer(d)[1]
        return Path(name) if name else None
    return None


def shown(path: Path) -> str:
    """``path`` relative to the working dir when it is under it (as a user would type it)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def exportable(cfg: RunConfig) -> None:
    """Refuses a model Hugging Face has no class for, from the checkpoint's config: before its
    parameters are read (``load``'s ``adjust``)."""
    m = cfg.model
    if m._target_:
        raise ConfigError(f"model._target_={m._target_}: the Hugging Face export writes dxrun's "
                          "own model only; save your module's parameters yourself")
    if m.objective == "mdlm":  # GPT-2 and Llama are causal: the export would lie about it
        raise ConfigError("model.objective=mdlm: Hugging Face's GPT-2 and Llama attend causally, "
                          "so a masked-diffusion model has no architecture there to export to")


def export(argv: list[str]) -> Path:
    to, step, rest = flags(argv)
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise ConfigError(f"--to {to} exists and is not an empty dir; give a new one")
    path, _, overrides = split_args("export", rest, {})
    loaded = load(path, overrides, key="path", with_data=False, step=step, adjust=exportable)
    m = loaded.cfg.model
    kind = model_type_of(m)
    tokenizer = tokenizer_of(loaded.cfg.data)
    save_hf(loaded.params, loaded.exp.axes, m, to, tokenizer)
    print(f"wrote {shown(to)}: {ARCHITECTURES[kind]} from {shown(loaded.path)} (step {loaded.step})"
          f"{', with its tokenizer.json' if tokenizer else ''}")
    return to


def run(argv: list[str]) -> None:
    export(argv)


if __name__ == "__main__":
    main("export", run)
