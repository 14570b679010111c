"""``python -m dxrun.evaluate <run dir | checkpoints dir | step dir | HF dir> [overrides]``:
score a checkpoint, or a Hugging Face directory (as step 0), on held-out data, on any mesh.

The newest committed checkpoint (or the step dir given) is restored onto the mesh of the run's
``parallelism`` or the overrides' (``parallelism=tp2``) and scored by the loop's own evaluation
on the held-out split's first ``eval.batches`` batches (at most the split's; on the same mesh:
bitwise the run's ``eval/*`` of that step), or on another source (``data.path=...``).
``eval.batches=all``: every full batch of a corpus's held-out windows (one if they fill none).

The result is printed, appended to ``eval.json`` in the run dir given (or around the checkpoints
or step dir given; no training file touched) and, when the run logged to W&B (and ``logger`` is
not ``none``), to that W&B run as ``eval/...`` at the checkpoint's step. Never in a run dir the
checkpoint records (a copied run's would land in the original); a checkpoint outside a run dir
(a shared ``checkpoint.dir``) gets its result printed only: give the run dir to record it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dxrun.config import ConfigError
from dxrun.data import EVAL
from dxrun.run import command_imports, read_json, write_json
from dxrun.tools.checkpoint import Loaded, load, main, split_args
from dxrun.tracking import open_wandb

if TYPE_CHECKING:
    from dxrun.config import DataConfig
    from dxrun.data import Data

log = logging.getLogger("dxrun")

ALL = "eval.batches=all"


def batch_count(d: DataConfig, batches: int, data: Data, all_batches: bool) -> int:
    """``batches`` (``eval.batches``), or with ``all`` every full global batch of the held-out
    windows of the run's data ``d`` (read by ``data``; one, with a warning, where they fill
    none: ``Data.eval_batches``)."""
    if not data.has_eval:
        raise ConfigError(f"data.path={d.path}: the held-out split is shorter than one "
                          f"window (data.seq_len+1={d.seq_len + 1} tokens); evaluate on "
                          "other data (data.path=...) or raise data.val_fraction")
    if all_batches:
        if data.eval_windows is None:
            raise ConfigError(f"{ALL}: data={d.name} has an endless held-out stream; give a "
                              "number, e.g. eval.batches=16")
        # A split of fewer windows than a batch: the one batch a number reads (said once).
        batches = max(1, data.eval_windows // d.batch_size)
    n, capped = data.eval_batches(batches, ALL if all_batches else None)  # at most the split's
    if capped:
        log.warning(capped)
    return n


def evaluate_checkpoint(path: Path, overrides: list[str]) -> dict[str, Any]:
    """Evaluate, write ``eval.json``, log to W&B; return the record."""
    with command_imports():
        from dxrun.train import evaluate  # imports JAX

    all_batches = ALL in overrides
    loaded = load(path, [o for o in overrides if o != ALL], key="path")
    cfg, exp = loaded.cfg, loaded.exp
    n = batch_count(cfg.data, cfg.eval.batches, exp.data, all_batches)
    t0 = time.perf_counter()
    metrics = evaluate(exp, loaded.params, (exp.batch(k, EVAL) for k in range(n)))
    rows = n * cfg.data.batch_size  # the distinct windows scored: a short split's repeat
    metrics["eval/tokens"] = min(rows, exp.data.eval_windows or rows) * cfg.data.seq_len
    record = {
        "step": loaded.step,
        "checkpoint": str(loaded.path),
        "data": {k: cfg.data[k] for k in ("name", "path", "tokenizer", "seed", "seq_len")
                 if cfg.data[k] is not None},
        "batches": n,
        "batch_size": cfg.data.batch_size,
        # the context axis named where it splits the sequences (cp > 1)
        # the axes a run may leave out (context, expert) only where it uses them
        "mesh": {k: int(v) for k, v in exp.mesh.shape.items()
                 if k not in ("context", "expert") or v > 1},
        **metrics,
        "seconds": time.perf_counter() - t0,
        "overrides": overrides,
    }
    if loaded.run_dir is None and loaded.ckpt_meta == {}:  # a Hugging Face directory
        return record
    if loaded.run_dir is None:
        log.warning("%s is not in a run dir: eval.json and W&B are not written; give the run "
                    "dir (its checkpoints.txt leads here) to record the result", path)
        return record
    _append(loaded.run_dir / "eval.json", record)
    log.info("wrote %s", loaded.run_dir / "eval.json")
    _log_wandb(loaded, loaded.run_dir, metrics)
    return record


def _append(path: Path, record: dict[str, Any]) -> None:
    # A damaged eval.json is set aside (eval.json.damaged): the new record is not lost to it.
    records = read_json(path, lambda x: isinstance(x, list)) or []
    write_json(path, [*records, record])


def _log_wandb(loaded: Loaded, run_dir: Path, metrics: dict[str, float]) -> None:
    """The numbers into the run's own W&B run, at the checkpoint's step."""
    run_id = loaded.ckpt_meta.get("wandb_id")
    if loaded.cfg.logger.name != "wandb" or not run_id:
        return
    run = open_wandb(run_dir, loaded.cfg.logger, None, None, None, None, run_id)
    if run is None:
        return
    try:
        run.log({"step": loaded.step, **metrics})
        run.finish()
        log.info("logged to W&B run %s at step %d", run_id, loaded.step)
    except Exception as e:  # noqa: BLE001 - W&B trouble never costs the result
        log.warning("W&B log failed (%s); the result is in eval.json", e)


def run(argv: list[str]) -> None:
    path, _, overrides = split_args("evaluate", argv, {})
    r = evaluate_checkpoint(path, overrides)
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    print(f"step {r['step']}  eval/loss {r['eval/loss']:.4f}  eval/ppl {r['eval/ppl']:.4f}  "
          f"eval/accuracy {r['eval/accuracy']:.4f}  eval/tokens {r['eval/tokens']:,}  "
          f"({r['batches']} batch{'es' if r['batches'] != 1 else ''} of {r['batch_size']} x "
          f"{r['data']['seq_len']}, "
          f"data {r['data']['name']}, mesh {mesh})")


if __name__ == "__main__":
    main("evaluate", run)
