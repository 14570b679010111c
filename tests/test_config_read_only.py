"""Once validated, the run config is read, never rewritten, and is the config the run trains on:
the derived numbers (the global batch, the sequence length, parallelism=auto's layout, plan
mode's sequence length, the save cadence) travel in the run plan (``RunPlan``), decided once by
``autotune.search``, and only the saved config (``saved_config``) records them, as it records
the W&B job type and group a launch gives the run (carried in ``runtime.Job``)."""

from __future__ import annotations

import sys

import jax
from conftest import finished_wandb_run
from omegaconf import OmegaConf

from dxrun.autotune import cache_key, planned, write_cache
from dxrun.checks import validation
from dxrun.cost import Row, chosen_layout, held_batch
from dxrun.experiment import visible_devices
from dxrun.plan import Layout, saved_config
from dxrun.train import prepare


def test_planning_and_preparing_a_run_leaves_its_config_as_it_was(cfg_factory, tmp_path):
    # The per-device batch and data.seq_len=null: both resolved by the plan (4 replicas x 2).
    cfg = cfg_factory("model=tiny", "model.n_layers=1", "parallelism=dp4_tp2",
                      "data.per_device_batch_size=2", "data.seq_len=null", "train.steps=2")
    validation.validate(cfg)
    before = OmegaConf.to_container(cfg, resolve=True)
    prepared = prepare(cfg, tmp_path / "run")  # plan, data, resume check, preflight
    exp, plan = prepared.exp, prepared.plan
    assert prepared.resume is None
    assert exp.cfg is cfg  # the run trains on the validated config itself
    assert OmegaConf.to_container(cfg, resolve=True) == before
    assert (cfg.data.batch_size, cfg.data.seq_len) == (None, None)
    assert (plan.global_batch, plan.seq_len) == (exp.plan.global_batch, exp.plan.seq_len) == (
        8, 64)
    assert (exp.data.batch_size, exp.data.seq_len) == (8, 64)
    assert exp.abstract_batch().shape == (8, 65)
    assert plan.cadence == (100, 0.0)  # checkpoint.every=null on CPU, decided once
    # What config.yaml, the W&B config and each checkpoint record: the resolved numbers.
    saved = saved_config(cfg, plan)
    assert (saved["data"]["batch_size"], saved["data"]["seq_len"]) == (8, 64)
    assert saved["data"]["per_device_batch_size"] == 2
    assert {k: v for k, v in saved.items() if k != "data"} == {
        k: v for k, v in before.items() if k != "data"}
    assert OmegaConf.to_container(cfg, resolve=True) == before


def test_parallelism_auto_trains_on_the_validated_config_its_plan_holding_the_layout(
        cfg_factory, tmp_path, monkeypatch):
    # A cached decision (nothing compiled but the preflight's step), one that differs from the
    # composed config in every key a layout sets: tp2 with dots recomputation, 2 micro-batches.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = cfg_factory("model=tiny", "model.n_layers=1", "parallelism=auto",
                      "parallelism.n_devices=2", "data.per_device_batch_size=2",
                      "data.seq_len=null", "train.steps=2")
    validation.validate(cfg)
    before = OmegaConf.to_container(cfg, resolve=True)
    layout = Layout.of(dp=1, fsdp=1, tp=2, remat="dots", grad_accum=2)
    held = held_batch(cfg, *visible_devices())
    key = cache_key(cfg, held, 2, jax.devices()[0].device_kind, jax.__version__, 1)
    write_cache(key, {"search": "measure", "target": "cpu", "search_s": 1.0,
                            "rows": [Row(layout, 0.1, 1.0, 1.0, True, True).to_json()]})
    assert OmegaConf.to_container(cfg, resolve=True) == before
    prepared = prepare(cfg, tmp_path / "run")
    exp, plan = prepared.exp, prepared.plan
    assert prepared.resume is None
    assert exp.cfg is cfg  # what the run trains on: the validated config, not a laid-out copy
    assert OmegaConf.to_container(cfg, resolve=True) == before
    assert plan.search["cached"]
    chosen = chosen_layout(plan.search)
    assert chosen == layout == plan.layout and (cfg.model.remat, cfg.train.grad_accum) == (
        "none", 1)
    # The plan carries the layout the step was built with (the model's remat, the step's
    # micro-batches), the batch held at the starting layout's (dp2 x 2), the sequence length.
    assert (exp.plan.dp, exp.plan.fsdp, exp.plan.tp, exp.plan.remat, exp.plan.grad_accum) == (
        chosen.dp, chosen.fsdp, chosen.tp, chosen.remat, chosen.grad_accum)
    assert list(plan.to_json()["mesh_shape"]) == [chosen.dp, chosen.fsdp, chosen.ep, chosen.cp,
                                                  chosen.tp]
    assert (plan.global_batch, plan.seq_len) == (4, 64)
    assert (cfg.data.per_device_batch_size, cfg.data.batch_size, cfg.data.seq_len) == (
        2, None, None)
    saved = saved_config(cfg, plan)
    assert ([saved["parallelism"][k] for k in ("dp", "fsdp", "tp")], saved["model"]["remat"],
            saved["train"]["grad_accum"], saved["data"]["batch_size"],
            saved["data"]["per_device_batch_size"], saved["data"]["seq_len"]) == (
        [1, 1, 2], "dots", 2, 4, None, 64)
    assert OmegaConf.to_container(cfg, resolve=True) == before


def test_plan_mode_resolves_seq_len_and_the_layout_in_its_plan(cfg_factory, monkeypatch,
                                                               tmp_path):
    # data.seq_len=null for an H100 target: the model's context, whatever this host is. One
    # head: tp2 is refused, two candidates (dp2, fsdp2) compiled from shapes.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = cfg_factory("model=tiny", "model.n_layers=1", "model.max_seq_len=128",
                      "model.n_heads=1", "model.n_kv_heads=1",
                      "parallelism=auto", "parallelism.n_devices=2", "data.seq_len=null",
                      "plan.target=h100", "parallelism.search_budget=null")
    validation.validate(cfg)
    before = OmegaConf.to_container(cfg, resolve=True)
    decided = planned(cfg)
    plan = decided.plan
    assert decided.exp.cfg is cfg
    assert OmegaConf.to_container(cfg, resolve=True) == before
    assert cfg.data.seq_len is None and plan.seq_len == decided.exp.plan.seq_len == 128
    chosen = chosen_layout(plan.search)
    assert plan.search["search"] == "model"  # plan mode never measures
    assert sum(r["fits"] for r in plan.search["rows"]) == 2
    assert (plan.mesh.dp, plan.mesh.fsdp, plan.mesh.ep, plan.mesh.cp, plan.mesh.tp) == (
        chosen.dp, chosen.fsdp, chosen.ep, chosen.cp, chosen.tp) == tuple(
        plan.to_json()["mesh_shape"])
    assert saved_config(cfg, plan)["data"]["seq_len"] == 128


def test_the_cli_trains_on_the_validated_config_and_records_its_wandb_names(tmp_path,
                                                                            monkeypatch):
    # ``python -m dxrun -m ...`` in this process: a multirun's job, whose W&B job type and group
    # (left unset) the launch fills in. The config the run trains on is the one __main__
    # validated, unchanged; config.yaml and the W&B run record the filled-in names alike.
    import dxrun.__main__ as entry
    import dxrun.train

    validated, trained = [], []
    real_validate, real_train = entry.validate, dxrun.train.train

    def validate(cfg):
        real_validate(cfg)
        validated.append((cfg, OmegaConf.to_container(cfg, resolve=True)))

    def train(cfg, run_dir, job=None, prepared=None):
        trained.append((cfg, prepared.exp.cfg, job, run_dir))
        return real_train(cfg, run_dir, job, prepared)

    monkeypatch.setattr(entry, "validate", validate)
    monkeypatch.setattr(dxrun.train, "train", train)  # __main__ imports it when it runs
    sweep = tmp_path / "multirun" / "2026-01-02" / "03-04-05"
    monkeypatch.setattr(sys, "argv", [
        "dxrun", "-m", "model=tiny", "model.n_layers=1", "parallelism=dp2",
        "data.batch_size=8", "train.steps=1", "train.eval_every=0", "checkpoint.every=0",
        f"hydra.sweep.dir={sweep}", "hydra/job_logging=none", "hydra/hydra_logging=none"])
    entry.main()
    ((cfg, before),) = validated
    ((run_cfg, exp_cfg, job, run_dir),) = trained
    assert run_cfg is cfg and exp_cfg is cfg  # the validated config itself, not a copy
    assert OmegaConf.to_container(cfg, resolve=True) == before
    assert (cfg.logger.job_type, cfg.logger.group) == (None, None)
    names = ("sweep", "sweep-2026-01-02_03-04-05")
    assert (job.job_type, job.group) == names
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml").logger
    assert (saved.job_type, saved.group) == names
    run = finished_wandb_run(next(run_dir.glob("wandb/offline-run-*/run-*.wandb")))
    assert (run["job_type"], run["group"]) == names
    assert (run["config"]["logger"]["job_type"], run["config"]["logger"]["group"]) == names
