"""The mixtures of experts in and out (issue 82, item 4): Mixtral (8 experts, top 2 of the
softmax renormalised, every layer an MoE layer, a window) and Qwen3-MoE (experts of their own
width, top 3 not renormalised, dense and MoE layers alternating, q and k norms) and Qwen2-MoE
(q, k, v biases, a shared expert with its sigmoid gate, a dense first layer). A tiny random
checkpoint of each, made here, gives transformers' PyTorch logits (stored:
tests/fixtures/hf_reference/, with the script and versions that made them; CI has no torch):
dxrun's equal them on one device, with the experts split over the ``expert`` axis and with
tensor parallelism; import then export gives the tensors back bitwise; a fine-tune on dp2_ep4
exports what it computes; what dxrun does not build is refused in one line naming it."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import ROOT, make_cfg
from hf_checkpoints import MOE_FAMILIES, V
from test_hf import hf_cfg, logits
from test_hf_families import fine_tuned, reference_checkpoints, round_tripped

from dxrun.config.errors import ConfigError
from dxrun.config.hf_model import (
    ARCHITECTURES,
    apply_hf_model,
    model_fields,
    model_type_of,
    read_config,
)
from dxrun.experiment import Experiment

FIXTURES = ROOT / "tests" / "fixtures" / "hf_reference"
sys.path.insert(0, str(FIXTURES))

EP = ["parallelism=dp2_ep4", "data.batch_size=8"]  # the expert axis splits the batch too
MESHES = {"dp1": ["parallelism=dp1"], "dp2_ep4": EP,
          "dp4_tp2": ["parallelism=dp4_tp2"]}
# The model.moe keys each checkpoint gives.
MOE_KEYS = {"mixtral": dict(n_experts=8, top_k=2, d_ff=None, every=1, first_dense=0,
                            renormalize=True, aux_loss=0.002),
            "qwen3_moe": dict(n_experts=8, top_k=3, d_ff=24, every=2, first_dense=0,
                              renormalize=False, aux_loss=0.003),
            "qwen2_moe": dict(n_experts=8, top_k=2, d_ff=24, every=1, first_dense=1,
                              renormalize=True, shared_d_ff=40, shared_gate=True,
                              aux_loss=0.002)}


def tiled(x: np.ndarray) -> np.ndarray:
    """The reference's 2 rows 4 times: a batch the 8 replicas of dp2_ep4 split (the experts'
    shard_map splits the batch over the expert axis too); each row's logits its own."""
    return np.tile(x, (4,) + (1,) * (x.ndim - 1))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return reference_checkpoints(tmp_path_factory.mktemp("moe_families"), MOE_FAMILIES)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_equal_transformers_on_every_mesh(families, family):
    """dxrun's fp32 logits against transformers' PyTorch class (stored), to 1e-5 of the largest
    logit, on one device, with the experts split four ways and with tp2; the model section's
    MoE keys are the checkpoint's."""
    d, ref = families[family]
    want = ref["logits"]
    assert str(ref["transformers"]).startswith("4.57") and want.shape == (2, 16, V)
    tokens, want = tiled(ref["tokens"]), tiled(want)
    for mesh, overrides in MESHES.items():
        exp = Experiment.build(hf_cfg(d, *overrides), with_data=False)
        got = logits(exp, exp.hf_params(), tokens)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                   err_msg=f"{family} {mesh}")
    moe = exp.cfg.model.moe
    assert {k: moe[k] for k in MOE_KEYS[family]} == pytest.approx(MOE_KEYS[family])
    assert model_type_of(exp.cfg.model) == family


def test_qwen3_moe_weights_are_not_renormalised(families):
    """Renormalising Qwen3-MoE's top 3 weights (Mixtral's rule) gives other logits: the
    checkpoint's norm_topk_prob=false is real, and dxrun's is what makes them equal."""
    d, ref = families["qwen3_moe"]
    exp = Experiment.build(hf_cfg(d, "parallelism=dp1"), with_data=False)
    cfg = exp.cfg.copy()
    cfg.model.moe.renormalize = True
    other = Experiment.build(cfg, with_data=False)
    got = logits(other, exp.hf_params(), ref["tokens"])
    assert np.abs(got - ref["logits"]).max() > 1e-3 * np.abs(ref["logits"]).max()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_import_then_export_gives_the_tensors_back_bitwise(families, family, tmp_path):
    """HF -> dxrun (dp2_ep4: the experts split) -> export: the same tensors bit for bit, each
    expert's under its own name, the same model fields, the family's architecture, a
    config.json transformers reads as that family with the same MoE fields."""
    from transformers import AutoConfig

    d, _ = families[family]
    out = round_tripped(d, family, tmp_path / "out", *EP)
    theirs, ours = AutoConfig.from_pretrained(str(d)), AutoConfig.from_pretrained(str(out))
    assert ours.model_type == family
    for name in ("num_local_experts", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                 "mlp_only_layers", "sliding_window", "router_aux_loss_coef",
                 "shared_expert_intermediate_size", "qkv_bias"):
        assert getattr(ours, name, None) == pytest.approx(getattr(theirs, name, None)), name


def test_a_dxrun_moe_exports_as_the_family_that_computes_it():
    """moe_tiny's shape exports as Mixtral (every layer MoE, renormalised); with dense first
    layers and q, k norms as Qwen3-MoE, its layers as mlp_only_layers; a sigmoid router, a
    shared expert or GELU experts have no Hugging Face equivalent, refused naming the key."""
    from dxrun.checks import validation
    from dxrun.config import config_json

    base = ["model=tiny_llama", "model.moe.n_experts=4", "model.n_layers=4"]
    cfg = make_cfg(*base)
    validation.validate(cfg)
    assert model_type_of(cfg.model) == "mixtral"
    cfg = make_cfg(*base, "model.moe.first_dense=1", "model.moe.every=3", "model.qk_norm=head",
                   "model.moe.d_ff=8")
    validation.validate(cfg)
    out = config_json(cfg.model)
    assert out["model_type"] == "qwen3_moe" and out["mlp_only_layers"] == [0, 1, 2]
    assert out["decoder_sparse_step"] == 1 and out["moe_intermediate_size"] == 8
    for given in ("model.moe.router=sigmoid", "model.moe.shared_d_ff=16", "model.mlp=geglu"):
        cfg = make_cfg(*base, given)
        with pytest.raises(ConfigError) as e:
            model_type_of(cfg.model)
        assert given in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.e2e  # a training, then an export read back
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_fine_tune_on_dp2_ep4_exports_what_it_computes(families, family, tmp_path):
    """20 steps from each family's checkpoint on dp2_ep4 lower the loss; the export imports
    again with the run's logits bit for bit."""
    from dxrun.export import export
    from dxrun.tools.checkpoint import load

    d, ref = families[family]
    rows = fine_tuned(d, "parallelism=dp2_ep4", tmp_path / "run")
    assert all("moe/aux_loss" in r for r in rows if "train/loss" in r)
    out = export([str(tmp_path / "run"), "--to", str(tmp_path / "exported")])
    run = load(tmp_path / "run", [], "path")
    ours = logits(run.exp, run.params, tiled(ref["tokens"]))
    exp = Experiment.build(hf_cfg(out, *EP), with_data=False)
    np.testing.assert_array_equal(logits(exp, exp.hf_params(), tiled(ref["tokens"])), ours)
    assert read_config(out)["architectures"] == [ARCHITECTURES[family]]


def test_what_dxrun_does_not_build_is_refused_in_one_line(families, tmp_path):
    """A router jitter, non-SwiGLU experts, MoE and dense layers in an order the layers' scan
    does not build, Qwen2-MoE without its biases or with its window: one line naming the field;
    a run's own aux_loss is kept, a shape key contradicting the checkpoint refused."""
    d, _ = families["qwen3_moe"]
    cases = {"jitter": (dict(model_type="mixtral", num_local_experts=8,
                             router_jitter_noise=0.01), "router_jitter_noise=0.01"),
             "gelu": (dict(hidden_act="gelu"), "hidden_act=gelu (dxrun's experts are SwiGLU"),
             "order": (dict(mlp_only_layers=[3], decoder_sparse_step=1),
                       "mlp_only_layers=[3], decoder_sparse_step=1 (MoE and dense layers in "
                       "an order dxrun does not build"),
             "no_bias": (dict(model_type="qwen2_moe", shared_expert_intermediate_size=40,
                              qkv_bias=False), "qkv_bias=false (Qwen2-MoE's attention"),
             "window": (dict(model_type="qwen2_moe", shared_expert_intermediate_size=40,
                             use_sliding_window=True, sliding_window=8, max_window_layers=0),
                        "sliding_window=8 (model_type=qwen2_moe attends to every earlier")}
    for name, (fields, words) in cases.items():
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**read_config(d), **fields}))
        given = [f"model.init_from=hf:{bad}"]
        with pytest.raises(ConfigError) as e:
            apply_hf_model(make_cfg(*given), given)
        assert words in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    given = [f"model.init_from=hf:{d}", "model.moe.aux_loss=0.5"]
    cfg = make_cfg(*given)
    apply_hf_model(cfg, given)
    assert cfg.model.moe.aux_loss == 0.5 and cfg.model.moe.top_k == 3
    given = [f"model.init_from=hf:{d}", "model.moe.top_k=2"]
    with pytest.raises(ConfigError, match="model.moe.top_k=2 contradicts"):
        apply_hf_model(make_cfg(*given), given)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_config_json_leaving_out_its_class_defaults_reads_as_transformers_fills_it(family):
    """save_pretrained writes only what differs from the config class's defaults: a config.json
    of the shape alone reads as transformers' whole config does (Mixtral's 8 experts, top 2,
    rope_theta 1e6; Qwen3-MoE's 128 experts, top 8, 768 wide; Qwen2-MoE's 60, top 4, its
    5632-wide shared expert), never as another family's defaults."""
    from pathlib import Path

    from transformers import AutoConfig

    shape = {k: MOE_FAMILIES[family][k] for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "vocab_size", "max_position_embeddings")}
    shape["num_hidden_layers"] = 12
    path = Path("config.json")
    full = AutoConfig.for_model(family, **shape).to_dict()
    assert model_fields(dict(model_type=family, **shape), path) == model_fields(full, path)
