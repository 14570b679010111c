"""The Llama-shaped families beside Llama (issue 81): Mistral (a sliding window, its own
head_dim), Qwen2/2.5 (q, k, v biases), Qwen3 (per-head q and k norms, its own head_dim, tied
embeddings), OLMo 2 (q and k norms across heads, the blocks' norms after, not before), Gemma
(GeGLU, 1 + w norms, embeddings scaled by sqrt(d)), Gemma 2 (besides: sandwich norms, soft
caps, a score scale, windowed and full layers alternating), Gemma 3 text (Gemma 2's with q and
k norms, 2 windowed layers to 1 full on their own rope base) and Phi-3 (q, k, v and gate, up
fused in the checkpoint, a window). A tiny random checkpoint of each, made here, gives
transformers' PyTorch logits (stored: tests/fixtures/hf_reference/, with the script and
versions that made them; CI has no torch), and Gemma's Flax class's, on one device, dp4 x tp2
and dp2 x fsdp2 x tp2; import then export gives its tensors back bitwise under its own
architecture; a fine-tune exports what it computes; what dxrun does not build is refused in
one line naming it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, make_cfg
from hf_checkpoints import FAMILIES, LLAMA, V, random_tensors, reference_logits, write_hf_dir
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


def fine_tuned(checkpoint: Path, layout: str, run_dir: Path) -> list[dict]:
    """Twenty fp32 steps from ``checkpoint`` on ``layout`` into ``run_dir``: its logged rows,
    whose loss fell."""
    from dxrun.train import train

    given = [f"model.init_from=hf:{checkpoint}", layout, "logger=none",
             "data.batch_size=8", "data.seq_len=16", "train.steps=20", "train.log_every=10",
             "train.eval_every=0", "checkpoint.every=20", "optimizer.lr=3e-3",
             "optimizer.warmup_steps=2", "train.precision=fp32"]
    cfg = make_cfg(*given)
    apply_hf_model(cfg, given)
    train(cfg, run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 2 and losses[-1] < losses[0]
    return rows


def round_tripped(checkpoint: Path, family: str, out: Path, *layout: str) -> Path:
    """``checkpoint`` imported on ``layout`` and exported to ``out`` untrained: every tensor
    back bit for bit, the same model fields and the family's own architecture."""
    exp = Experiment.build(hf_cfg(checkpoint, *layout), with_data=False)
    out = save_hf(exp.hf_params(), exp.axes, exp.cfg.model, out)
    want, have = tensors_of(checkpoint), tensors_of(out)
    assert have.keys() == want.keys()
    for name, x in want.items():
        assert have[name].dtype == x.dtype and np.array_equal(have[name], x), name
    assert model_fields(read_config(out), out) == model_fields(read_config(checkpoint),
                                                                checkpoint)
    assert read_config(out)["architectures"] == [ARCHITECTURES[family]]
    return out


def reference_checkpoints(root: Path, families: dict) -> dict:
    """Each family's checkpoint (the reference's own: its weights' hash checked) and its
    stored reference."""
    out = {}
    for family, fields in families.items():
        tensors = random_tensors(fields, seed=SEED)
        ref = np.load(FIXTURES / f"{family}.npz")
        assert weights_sha256(tensors) == str(ref["weights_sha256"]), family
        out[family] = (write_hf_dir(root / family, fields, tensors), ref)
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return reference_checkpoints(tmp_path_factory.mktemp("families"), FAMILIES)


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
    assert {k: m[k] for k in PIECES} == {**dict(zip(PIECES, PLAIN, strict=True)),
                                         **FAMILY_PIECES[family]}


# The model keys each family's checkpoint gives (the rest: PLAIN, Llama's).
PIECES = ("head_dim", "qkv_bias", "qk_norm", "sliding_window", "tie_embeddings",
          "norm_position", "mlp", "norm_plus_one", "embed_scale", "global_every",
          "rope_local_theta", "attn_softcap", "logit_softcap", "attn_scalar")
PLAIN = (None, False, "none", None, False, "pre", "swiglu", False, False, None, None, None,
         None, None)
GEMMA = dict(head_dim=16, tie_embeddings=True, mlp="geglu", norm_plus_one=True,
             embed_scale=True)
FAMILY_PIECES = {
    "mistral": dict(head_dim=16, sliding_window=5), "qwen2": dict(qkv_bias=True),
    "qwen3": dict(head_dim=16, qk_norm="head", tie_embeddings=True),
    "olmo2": dict(qk_norm="proj", norm_position="post"), "gemma": GEMMA,
    "gemma2": dict(GEMMA, norm_position="sandwich", sliding_window=5, global_every=2,
                   attn_softcap=2.0, logit_softcap=5.0, attn_scalar=24.0),
    "gemma3_text": dict(GEMMA, norm_position="sandwich", qk_norm="head", sliding_window=5,
                        global_every=3, rope_local_theta=100.0),
    "phi3": dict(sliding_window=7)}


def test_gemma_equals_transformers_flax_class(families):
    """Gemma has a Flax class in transformers: dxrun's logits equal it, run here, as they equal
    the stored PyTorch ones."""
    d, ref = families["gemma"]
    want = reference_logits(d, ref["tokens"])
    np.testing.assert_allclose(want, ref["logits"], rtol=0, atol=1e-5 * np.abs(want).max())
    exp = Experiment.build(hf_cfg(d, "parallelism=dp1"), with_data=False)
    got = logits(exp, exp.hf_params(), ref["tokens"])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_each_gemma_piece_is_what_transformers_computes(families, family):
    """Without any one of its pieces (each set back to Llama's) the same Gemma 2 / 3 weights
    give other logits: each piece the reference has is real, and dxrun's is what makes them
    equal."""
    d, ref = families[family]
    exp = Experiment.build(hf_cfg(d, "parallelism=dp1"), with_data=False)
    params = exp.hf_params()
    pieces = {k: v for k, v in FAMILY_PIECES[family].items()
              if k not in ("head_dim", "tie_embeddings", "mlp", "norm_position", "qk_norm")}
    for key in pieces:
        cfg = exp.cfg.copy()
        cfg.model[key] = dict(zip(PIECES, PLAIN, strict=True))[key]
        if key == "sliding_window":
            cfg.model.global_every = cfg.model.rope_local_theta = None
        off = Experiment.build(cfg, with_data=False)
        got = logits(off, params, ref["tokens"])
        assert np.abs(got - ref["logits"]).max() > 1e-3 * np.abs(ref["logits"]).max(), key


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
    out = round_tripped(d, family, tmp_path / "out", "parallelism=tp2")
    assert AutoConfig.from_pretrained(str(out)).model_type == family


@pytest.mark.e2e  # a training, then an export read back
@pytest.mark.parametrize("family", FAMILIES)
def test_a_fine_tune_exports_what_it_computes(families, family, tmp_path):
    """20 steps from each family's checkpoint on dp2_fsdp2_tp2 lower the loss; the export
    imports again with the run's logits bit for bit (Gemma's: transformers' Flax class reads
    it and gives them too)."""
    from dxrun.tools.checkpoint import load

    d, ref = families[family]
    fine_tuned(d, "parallelism=dp2_fsdp2_tp2", tmp_path / "run")
    from dxrun.export import export

    out = export([str(tmp_path / "run"), "--to", str(tmp_path / "exported")])
    run = load(tmp_path / "run", [], "path")
    ours = logits(run.exp, run.params, ref["tokens"])
    exp = Experiment.build(hf_cfg(out, "parallelism=dp2_fsdp2_tp2"), with_data=False)
    np.testing.assert_array_equal(logits(exp, exp.hf_params(), ref["tokens"]), ours)
    assert read_config(out)["architectures"] == [ARCHITECTURES[family]]
    if family == "gemma":
        want = reference_logits(out, ref["tokens"])
        np.testing.assert_allclose(ours, want, rtol=0, atol=1e-5 * np.abs(want).max())


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
            model_type="qwen2", layer_types=["full_attention", "sliding_attention"],
            sliding_window=8)), "layer_types=[\"full_attention\", \"sliding_attention\"] "
                                "(windowed and full attention layers in an order dxrun does "
                                "not build"),
        "longrope": (config("longrope", dict(model_type="phi3", rope_scaling=dict(
            type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4))),
                     "rope_scaling={\"type\": \"longrope\""),
        "gemma3_scaling": (config("gemma3_scaling", dict(
            model_type="gemma3_text", rope_scaling=dict(rope_type="linear", factor=8.0))),
            "rope_scaling={\"rope_type\": \"linear\", \"factor\": 8.0} (Gemma 3's, on its "
            "global layers only; dxrun scales none)"),
        "relu": (config("relu", dict(model_type="gemma2", hidden_activation="relu")),
                 "hidden_activation=relu (dxrun's gated MLPs: silu, gelu_pytorch_tanh, gelu)"),
        "partial_rotary": (config("partial_rotary", dict(model_type="phi3",
                                                         partial_rotary_factor=0.75)),
                           "partial_rotary_factor=0.75 (model_type=phi3)"),
        "yarn": (config("yarn", dict(model_type="qwen3", rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=32768))),
                 "rope_scaling={\"rope_type\": \"yarn\""),
        "o_bias": (config("o_bias", dict(model_type="qwen3", attention_bias=True)),
                   "attention_bias=true (model_type=qwen3)"),
        "softcap": (config("softcap", dict(model_type="mistral", final_logit_softcapping=30.0)),
                    "final_logit_softcapping=30.0 (model_type=mistral)"),
        "gemma3": (config("gemma3", dict(model_type="gemma3")),
                   "model_type=gemma3 is not one dxrun reads; it reads gpt2, llama, mistral, "
                   "qwen2, qwen3, olmo2, gemma, gemma2, gemma3_text, phi3"),
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
           "olmo2_1b": ("olmo2", 1_484_916_736), "gemma2_2b": ("gemma2", 2_614_341_888),
           "phi3_mini": ("phi3", 3_821_079_552)}


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


@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_json_leaving_out_its_class_defaults_reads_as_transformers_fills_it(family):
    """save_pretrained writes only what differs from the config class's defaults: a config.json
    of the shape alone reads as transformers' whole config (every default written out) does,
    so a family's defaults (Gemma's tied embeddings and head_dim of 256, Gemma 2's soft caps
    and alternating layers, Mistral's window) are never read as Llama's."""
    from transformers import AutoConfig

    shape = {k: FAMILIES[family][k] for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "vocab_size", "max_position_embeddings")}
    shape["num_hidden_layers"] = 12  # Gemma 3's 6-layer pattern twice
    bare = dict(model_type=family, **shape)
    full = AutoConfig.for_model(family, **shape).to_dict()
    path = Path("config.json")
    assert model_fields(bare, path) == model_fields(full, path)
