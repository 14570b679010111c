"""Once validated, the run config is read, never rewritten: the derived numbers (the global
batch, the sequence length) travel in the mesh plan, and only the saved config records them."""

from __future__ import annotations

from omegaconf import OmegaConf

from dxrun import config
from dxrun.batch import saved_config
from dxrun.train import prepare


def test_planning_and_preparing_a_run_leaves_its_config_as_it_was(cfg_factory, tmp_path):
    # The per-device batch and data.seq_len=null: both resolved by the plan (4 replicas x 2).
    cfg = cfg_factory("model=tiny", "model.n_layers=1", "parallelism=dp4_tp2",
                      "data.per_device_batch_size=2", "data.seq_len=null", "train.steps=2")
    config.validate(cfg)
    before = OmegaConf.to_container(cfg, resolve=True)
    exp, resume = prepare(cfg, tmp_path / "run")  # plan, data, resume check, preflight
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
