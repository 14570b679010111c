"""The Llama-shaped families beside Llama (issue 81): Mistral (a sliding window, its own
head_dim), Qwen2/2.5 (q, k, v biases), Qwen3 (per-head q and k norms, its own head_dim, tied
embeddings) and OLMo 2 (q and k norms across heads, the blocks' norms after, not before). A
tiny random checkpoint of each, made here, gives transformers' PyTorch logits (stored:
tests/fixtures/hf_reference/, with the script and versions that made them; CI has no torch)
on one device, dp4 x tp2 and dp2 x fsdp2 x tp2; import then export gives its tensors back
bitwise under its own architecture; a fine-tune exports what it computes; what dxrun does not
build is refused in one line naming it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, make_cfg
from hf_checkpoints import FAMILIES, LLAMA, V, random_tensors, write_hf_dir
from test_hf import hf_cfg, logits, tensors_of

from dxrun.checks import validation
from dxrun.config.errors import ConfigError
from dxrun.config.hf_model import ARCHITECTURES, apply_hf_model, model_fields, read_config
from dxrun.experiment import Experiment
from dxrun.hf import save_hf

FIXTURES = ROOT / "tests" / "fixtures" / "hf_reference"
sys.path.insert(0, str(FIXTURES))
from make_reference import SEED, weights_sha256  # noqa: E402

MESHES = {"dp1": ["parallelism=dp1"], "dp4_tp2": ["parallelism=dp4_tp2"],
          "dp2_fsdp2_tp2": ["parallelism=dp2_fsdp2_tp2"]}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Each family's checkpoint (the reference's own: its weights' hash checked) and its
    stored reference."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family, fields in FAMILIES.items():
        tensors = random_tensors(fields, seed=SEED)
        ref = np.load(FIXTURES / f"{family}.npz")
        assert weights_sha256(tensors) == str(ref["weights_sha256"]), family
        out[family] = (write_hf_dir(root / family, fields, tensors), ref)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_on_every_mesh(families, family):
    """dxrun's fp32 logits against transformers' PyTorch class (stored), to 1e-5 of the largest
    logit, on one device and on two tensor-parallel meshes (vocabulary padded, heads split
    with head_dim free); the model section is the family's."""
    d, ref = families[family]
    want = ref["logits"]
    assert str(ref["transformers"]).startswith("4.57") and want.shape == (2, 16, V)
    for mesh, overrides in MESHES.items():
        exp = Experiment.build(hf_cfg(d, *overrides), with_data=False)
        got = logits(exp, exp.hf_params(), ref["tokens"])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                   err_msg=f"{family} {mesh}")
    m = exp.cfg.model
    assert (m.head_dim, m.qkv_bias, m.qk_norm, m.sliding_window, m.tie_embeddings,
            m.norm_position) == {
        "mistral": (16, False, "none", 5, False, "pre"),
        "qwen2": (None, True, "none", None, False, "pre"),
        "qwen3": (16, False, "head", None, True, "pre"),
        "olmo2": (None, False, "proj", None, False, "post")}[family]


def test_the_window_is_what_mistral_computes(families):
    """Without its window (5 of 16 positions) the same Mistral weights give other logits: the
    reference's window is real, and dxrun's is what makes them equal."""
    d, ref = families["mistral"]
    exp = Experiment.build(hf_cfg(d, "parallelism=dp1"), with_data=False)
    exp.cfg.model.sliding_window = None
    full = Experiment.build(exp.cfg, with_data=False)
    got = logits(full, full.hf_params(), ref["tokens"])
    assert np.abs(got - ref["logits"])[:, 5:].max() > 1e-2
    np.testing.assert_allclose(got[:, :5], ref["logits"][:, :5], rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_then_export_gives_the_tensors_back_bitwise(families, family, tmp_path):
    """HF -> dxrun (tp2) -> export: the same tensors bit for bit (Qwen3 tied: no lm_head),
    the same model fields, the family's own architecture, a config.json transformers reads
    as that family."""
    from transformers import AutoConfig

    d, _ = families[family]
    exp = Experiment.build(hf_cfg(d, "parallelism=tp2"), with_data=False)
    out = save_hf(exp.hf_params(), exp.axes, exp.cfg.model, tmp_path / "out")
    want, have = tensors_of(d), tensors_of(out)
    assert have.keys() == want.keys()
    for name, x in want.items():
        assert have[name].dtype == x.dtype and np.array_equal(have[name], x), name
    assert model_fields(read_config(out), out) == model_fields(read_config(d), d)
    assert read_config(out)["architectures"] == [ARCHITECTURES[family]]
    assert AutoConfig.from_pretrained(str(out)).model_type == family


@pytest.mark.e2e  # a training, then an export read back
def test_a_qwen3_fine_tune_exports_what_it_computes(families, tmp_path):
    """20 steps from the Qwen3 checkpoint on dp2_fsdp2_tp2 lower the loss; the export imports
    again with the run's logits bit for bit."""
    from dxrun.tools.checkpoint import load
    from dxrun.train import train

    d, ref = families["qwen3"]
    given = [f"model.init_from=hf:{d}", "parallelism=dp2_fsdp2_tp2", "logger=none",
             "data.batch_size=8", "data.seq_len=16", "train.steps=20", "train.log_every=10",
             "train.eval_every=0", "checkpoint.every=20", "optimizer.lr=3e-3",
             "optimizer.warmup_steps=2", "train.precision=fp32"]
    cfg = make_cfg(*given)
    apply_hf_model(cfg, given)
    train(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 2 and losses[-1] < losses[0]
    from dxrun.export import export

    out = export([str(tmp_path / "run"), "--to", str(tmp_path / "exported")])
    run = load(tmp_path / "run", [], "path")
    ours = logits(run.exp, run.params, ref["tokens"])
    exp = Experiment.build(hf_cfg(out, "parallelism=dp2_fsdp2_tp2"), with_data=False)
    np.testing.assert_array_equal(logits(exp, exp.hf_params(), ref["tokens"]), ours)
    assert read_config(out)["architectures"] == ["Qwen3ForCausalLM"]


def _refused(root: Path) -> dict[str, tuple[Path, str]]:
    """A directory per refusal, and the words its line must have."""
    def config(name: str, fields: dict) -> Path:
        d = write_hf_dir(root / name, LLAMA, random_tensors(LLAMA))
        (d / "config.json").write_text(json.dumps({**read_config(d), **fields}))
        return d

    return {
        "relabelled": (config("relabelled", dict(sliding_window=8)),
                       "sliding_window=8 (model_type=llama attends to every earlier position"),
        "alternating": (config("alternating", dict(
            model_type="qwen2", layer_types=["sliding_attention", "full_attention"],
            sliding_window=8)), "layer_types=[\"full_attention\", \"sliding_attention\"] "
                                "(sliding-window and full attention layers alternating"),
        "yarn": (config("yarn", dict(model_type="qwen3", rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=32768))),
                 "rope_scaling={\"rope_type\": \"yarn\""),
        "o_bias": (config("o_bias", dict(model_type="qwen3", attention_bias=True)),
                   "attention_bias=true (model_type=qwen3)"),
        "softcap": (config("softcap", dict(model_type="mistral", final_logit_softcapping=30.0)),
                    "final_logit_softcapping=30.0 (model_type=mistral)"),
        "gemma2": (config("gemma2", dict(model_type="gemma2")),
                   "model_type=gemma2 is not one dxrun reads; it reads gpt2, llama, mistral, "
                   "qwen2, qwen3, olmo2"),
    }


def test_what_dxrun_does_not_build_is_refused_in_one_line(tmp_path):
    for name, (d, words) in _refused(tmp_path).items():
        given = [f"model.init_from=hf:{d}"]
        with pytest.raises(ConfigError) as e:
            apply_hf_model(make_cfg(*given), given)
        msg = str(e.value)
        assert words in msg and "\n" not in msg and str(d) in msg, (name, msg)


# Published parameter counts (the models' own config.json, counted as transformers counts them).
PRESETS = {"qwen3_0_6b": ("qwen3", 596_049_920), "qwen3_8b": ("qwen3", 8_190_735_360),
           "qwen2_5_7b": ("qwen2", 7_615_616_512), "mistral_7b": ("mistral", 7_241_732_096),
           "olmo2_1b": ("olmo2", 1_484_916_736)}


@pytest.mark.parametrize("preset", PRESETS)
def test_the_presets_are_shaped_as_the_published_models(preset):
    """Each preset has its published model's parameters and exports as its family; plan mode
    plans it (Qwen3-0.6B on one v5e in bf16, as issue 81's benchmark row; the others fsdp8 on
    H100s) and finds it fits."""
    from dxrun.autotune import plan_report
    from dxrun.config.hf_model import model_type_of
    from dxrun.fit import NoData

    family, n_params = PRESETS[preset]
    small = preset == "qwen3_0_6b"
    cfg = make_cfg(f"model={preset}", "parallelism=dp1" if small else "parallelism=fsdp8",
                   f"plan.target={'v5e' if small else 'h100'}", "logger=none",
                   "data.seq_len=2048", "data.per_device_batch_size=1", "train.precision=bf16",
                   "model.remat=full")
    validation.validate(cfg)
    assert model_type_of(cfg.model) == family
    report = plan_report(cfg, Experiment.build(cfg, data=NoData()), suggest=False)
    assert report["n_params"] == n_params and report["target"]["fits"], report["target"]
