"""Once validated, the run config is read, never rewritten: the derived numbers (the global
batch, the sequence length) travel in the mesh plan, and only the saved config records them;
what a later stage must change (parallelism=auto's layout, plan mode's sequence length, the W&B
names) goes into a copy, the config the run follows (``exp.cfg``)."""

from __future__ import annotations

from omegaconf import OmegaConf

from dxrun import validation
from dxrun.batch import saved_config
from dxrun.capacity import layout_search
from dxrun.capacity.plan_mode import planned, with_plan_seq_len
from dxrun.train import prepare


def test_planning_and_preparing_a_run_leaves_its_config_as_it_was(cfg_factory, tmp_path):
    # The per-device batch and data.seq_len=null: both resolved by the plan (4 replicas x 2).
    cfg = cfg_factory("model=tiny", "model.n_layers=1", "parallelism=dp4_tp2",
                      "data.per_device_batch_size=2", "data.seq_len=null", "train.steps=2")
    validation.validate(cfg)
    before = OmegaConf.to_container(cfg, resolve=True)
    exp, resume = prepare(cfg, tmp_path / "run")[:2]  # plan, data, resume check, preflight
    assert resume is None
    assert OmegaConf.to_container(cfg, resolve=True) == before
    assert (cfg.data.batch_size, cfg.data.seq_len) == (None, None)
    assert (exp.plan.global_batch, exp.plan.seq_len) == (8, 64)
    assert (exp.data.batch_size, exp.data.seq_len) == (8, 64)
    assert exp.abstract_batch().shape == (8, 65)
    # What config.yaml, the W&B config and each checkpoint record: the resolved numbers.
    saved = saved_config(cfg, exp.plan)
    assert (saved["data"]["batch_size"], saved["data"]["seq_len"]) == (8, 64)
    assert saved["data"]["per_device_batch_size"] == 2
    assert {k: v for k, v in saved.items() if k != "data"} == {
        k: v for k, v in before.items() if k != "data"}
    assert OmegaConf.to_container(cfg, resolve=True) == before


def test_parallelism_auto_runs_on_a_copy_holding_the_chosen_layout(cfg_factory, tmp_path,
                                                                   monkeypatch):
    # A cached decision (nothing compiled but the preflight's step), one that differs from the
    # composed config in every key a layout sets: tp2 with dots recomputation, 2 micro-batches.
    import jax

    from dxrun.experiment import visible_devices

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = cfg_factory("model=tiny", "model.n_layers=1", "parallelism=auto",
                      "parallelism.n_devices=2", "data.per_device_batch_size=2",
                      "data.seq_len=null", "train.steps=2")
    validation.validate(cfg)
    before = OmegaConf.to_container(cfg, resolve=True)
    layout = layout_search.Layout(1, 1, 2, "dots", 2)
    fixed = layout_search.fixed_batch(cfg, visible_devices())
    key = layout_search.cache_key(fixed, 2, jax.devices()[0].device_kind, jax.__version__, 1)
    layout_search.write_cache(key, {"search": "measure", "target": "cpu", "search_s": 1.0,
                                    "rows": [layout_search.Row(layout, 0.1, 1.0, 1.0, True,
                                                               True).to_json()]})
    assert OmegaConf.to_container(cfg, resolve=True) == before
    exp, resume = prepare(cfg, tmp_path / "run")[:2]
    assert resume is None
    assert OmegaConf.to_container(cfg, resolve=True) == before
    assert exp.plan.layout_search["cached"]
    chosen = layout_search.chosen_layout(exp.plan.layout_search)
    assert chosen == layout and (cfg.model.remat, cfg.train.grad_accum) == ("none", 1)
    run = exp.cfg  # what the run follows, and what its W&B config and config.yaml record
    assert run is not cfg
    assert (run.parallelism.dp, run.parallelism.fsdp, run.parallelism.tp, run.model.remat,
            run.train.grad_accum) == (chosen.dp, chosen.fsdp, chosen.tp, chosen.remat,
                                      chosen.grad_accum)
    assert list(exp.plan.to_json()["mesh_shape"]) == [chosen.dp, chosen.fsdp, chosen.tp]
    # The batch held at the starting layout's (dp2 x 2), the sequence length resolved.
    assert (run.data.per_device_batch_size, run.data.batch_size, run.data.seq_len) == (
        None, 4, 64)
    saved = saved_config(run, exp.plan)
    assert ([saved["parallelism"][k] for k in ("dp", "fsdp", "tp")], saved["model"]["remat"],
            saved["train"]["grad_accum"], saved["data"]["batch_size"]) == ([1, 1, 2], "dots", 2, 4)
    assert OmegaConf.to_container(cfg, resolve=True) == before


def test_plan_mode_resolves_seq_len_and_the_layout_on_a_copy(cfg_factory, monkeypatch,
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
    assert with_plan_seq_len(cfg, "cpu").data.seq_len == 128
    plan_cfg, plan = planned(cfg, "cpu")
    assert OmegaConf.to_container(cfg, resolve=True) == before
    assert cfg.data.seq_len is None and plan_cfg.data.seq_len == plan.seq_len == 128
    chosen = layout_search.chosen_layout(plan.layout_search)
    assert plan.layout_search["search"] == "model"  # plan mode never measures
    assert sum(r["fits"] for r in plan.layout_search["rows"]) == 2
    assert (plan_cfg.parallelism.dp, plan_cfg.parallelism.fsdp, plan_cfg.parallelism.tp) == (
        chosen.dp, chosen.fsdp, chosen.tp) == tuple(plan.to_json()["mesh_shape"])
