"""Hugging Face checkpoints in and out (issue 50): dxrun's logits equal transformers' own Flax
GPT-2 and Llama (grouped-query) on every kind of mesh, import then export gives the tensors back
bitwise, a fine-tune lowers the held-out loss and its export loads into the reference with
dxrun's logits, import holds one tensor beyond the shards, bad directories are refused in one
line, plan mode plans a fine-tune of Llama 3.1 8B from its published config.json, and two
processes import and train as one does.

Every checkpoint is made here (tests/hf_checkpoints.py); no network (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import gc
import json
import logging
import re
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import ROOT, cli_in_process, make_cfg, subprocess_env, write_corpus
from flax import nnx
from hf_checkpoints import (
    GPT2,
    LLAMA,
    V,
    hf_config,
    random_tensors,
    reference_logits,
    write_hf_dir,
    write_tokenizer,
)

from dxrun.checks import validate
from dxrun.config.errors import ConfigError
from dxrun.config.hf_model import apply_hf_model, model_fields, model_type_of, read_config
from dxrun.evaluate import evaluate_checkpoint
from dxrun.experiment import Experiment, check_hf_weights
from dxrun.export import export
from dxrun.export import run as export_run
from dxrun.hf import TABLES, save_hf
from dxrun.logits import load_model
from dxrun.model.sharding import in_mesh_context
from dxrun.run import Job, describe_model
from dxrun.sample import OPTIONS, sample
from dxrun.tools.checkpoint import load, main

MESHES = {"dp1": ["parallelism=dp1"], "tp2": ["parallelism=tp2"],
          "fsdp2_tp2": ["parallelism=tp2", "parallelism.n_devices=4", "parallelism.fsdp=2"],
          "dp2_tp4": ["parallelism=dp2_tp4"]}
SMALL = ["logger=none", "data.batch_size=4", "data.seq_len=16"]


def hf_cfg(d: Path, *overrides: str):
    given = [f"model.init_from=hf:{d}", *SMALL, *overrides]
    cfg = make_cfg(*given)
    apply_hf_model(cfg, given)
    validate(cfg)
    return cfg


def logits(exp: Experiment, params: dict, tokens_BxL: np.ndarray) -> np.ndarray:
    with in_mesh_context(exp.mesh, exp.plan.rules):
        out = jax.jit(lambda p, t: nnx.merge(exp.graphdef, p)(t))(params, tokens_BxL)
    return np.asarray(out)[..., :exp.cfg.model.vocab_size]


def tensors_of(d: Path) -> dict[str, np.ndarray]:
    """Every tensor of a HF dir, GPT-2's names without the ``transformer.`` prefix."""
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= {n.removeprefix("transformer."): x for n, x in load_file(str(f)).items()}
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The two checkpoints (GPT-2 as the hub lays it out: one file, no ``transformer.``
    prefix; Llama with grouped-query heads in two shards, and the same tensors in one file for
    the reference, whose Flax loader reads no shards), a token batch and the reference logits."""
    root = tmp_path_factory.mktemp("hf")
    g = write_hf_dir(root / "gpt2", GPT2, random_tensors(GPT2))
    llama_tensors = random_tensors(LLAMA, seed=1)
    ls = write_hf_dir(root / "llama_sharded", LLAMA, llama_tensors, shards=2)
    l1 = write_hf_dir(root / "llama", LLAMA, llama_tensors)
    tokens = np.random.default_rng(2).integers(0, V, (2, 16)).astype(np.int32)
    return {"root": root, "gpt2": g, "llama": ls, "llama_one_file": l1, "tokens": tokens,
            "ref": {"gpt2": reference_logits(g, tokens), "llama": reference_logits(l1, tokens)}}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_logits_equal_the_reference_on_every_mesh(hf, kind):
    """dxrun's fp32 logits of the imported checkpoint against transformers' Flax model, to
    1e-5, on one device, tensor-parallel (the vocabulary padded), FSDP x TP and dp2 x tp4."""
    for mesh, overrides in MESHES.items():
        exp = Experiment.build(hf_cfg(hf[kind], *overrides), with_data=False)
        out = logits(exp, exp.hf_params(), hf["tokens"])
        np.testing.assert_allclose(out, hf["ref"][kind], rtol=0, atol=1e-5, err_msg=mesh)
        assert exp.padded_vocab == {"dp1": V, "tp2": 102, "fsdp2_tp2": 102,
                                    "dp2_tp4": 104}[mesh]


def test_a_flax_checkpoint_imports_with_its_norm_epsilon(hf, tmp_path):
    """What transformers' Flax classes save (safetensors, format flax: kernel transposed,
    embedding, scale), with a norm epsilon other than 1e-5 (a LlamaConfig()'s 1e-6): dxrun's
    logits on tp2 equal the Flax model's to 1e-5 of the largest logit."""
    from transformers import FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM

    for fields, cls, eps in ((dict(GPT2, layer_norm_epsilon=1e-3), FlaxGPT2LMHeadModel, 1e-3),
                             (dict(LLAMA, rms_norm_eps=1e-6), FlaxLlamaForCausalLM, 1e-6)):
        ref = cls(hf_config(fields), seed=3, dtype=np.float32)
        d = tmp_path / fields["model_type"]
        ref.save_pretrained(str(d), safe_serialization=True)
        want = np.asarray(jax.jit(lambda p, t, ref=ref: ref(t, params=p).logits)(
            ref.params, hf["tokens"]))
        exp = Experiment.build(hf_cfg(d, *MESHES["tp2"]), with_data=False)
        assert exp.cfg.model.norm_eps == eps
        got = logits(exp, exp.hf_params(), hf["tokens"])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_dxrun_logits_gives_the_reference_logits(hf, tmp_path):
    """The documented way to dxrun's logits: ``load_model`` of a HF dir (the Llama in two
    shards) on tp2 equals transformers' Flax model; ``python -m dxrun.logits`` prints the last
    position's top five and saves the array; bad token ids are one line, exit 2."""
    from dxrun import logits as tool

    model = load_model(hf["llama"], "parallelism=tp2")
    assert dict(model.loaded.exp.mesh.shape)["tensor"] == 2
    ref = hf["ref"]["llama"]
    got = model(hf["tokens"])
    assert got.shape == ref.shape == (2, 16, V) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_array_equal(model(hf["tokens"][1]), got[1:])  # [L]: a batch of one
    ids = ",".join(map(str, hf["tokens"][0]))
    entry = lambda: tool.main("logits", tool.run)  # noqa: E731
    proc = cli_in_process(str(hf["llama"]), f"tokens={ids}", "out=l.npy", "parallelism=tp2",
                          cwd=tmp_path, entry=entry, prog="dxrun.logits")
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = np.load(tmp_path / "l.npy")
    np.testing.assert_array_equal(saved, got[:1])
    top = np.argsort(-saved[0, -1])[:5]
    assert ("step 0  last position's top 5: "
            + "  ".join(f"{i}: {saved[0, -1, i]:.4f}" for i in top)) in proc.stdout
    for bad, says in (("tokens=1,x", "tokens=1,x: give token ids, e.g. tokens=1,2,3"),
                      (f"tokens=1,{V}", f"tokens: ids must lie in [0, {V})")):
        proc = cli_in_process(str(hf["llama"]), bad, cwd=tmp_path, entry=entry,
                              prog="dxrun.logits")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("dxrun.logits: error:")]
        assert says in line, line


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_tied"])
def test_import_then_export_gives_the_tensors_back_bitwise(hf, kind, tmp_path):
    """HF -> dxrun (tp2: the vocabulary padded to 102 rows) -> export: the same tensors bit
    for bit (GPT-2's fused c_attn split and put back; a tied Llama without lm_head), the same
    config; written in several files with their index when a file may hold less than the
    model."""
    if kind == "llama_tied":
        fields = dict(LLAMA, tie_word_embeddings=True)
        tensors = random_tensors(fields)  # no lm_head.weight: tied
        hf = {kind: write_hf_dir(tmp_path / kind, fields, tensors)}
    align = ["parallelism.vocab_align=128"] if kind == "llama_tied" else []  # 27 padding rows
    exp = Experiment.build(hf_cfg(hf[kind], "parallelism=tp2", *align), with_data=False)
    out = save_hf(exp.hf_params(), exp.axes, exp.cfg.model, tmp_path / "out",
                  max_shard_bytes=40_000)
    want, have = tensors_of(hf[kind]), tensors_of(out)
    assert have.keys() == want.keys()
    for name, x in want.items():
        assert have[name].dtype == x.dtype and np.array_equal(have[name], x), name
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    config = read_config(out)
    assert model_fields(config, out) == model_fields(read_config(hf[kind]), hf[kind])
    assert config["architectures"] == [
        "GPT2LMHeadModel" if kind == "gpt2" else "LlamaForCausalLM"]


def test_import_holds_one_shard_beyond_the_placed_ones(tmp_path):
    """Host memory while importing a 12-layer model onto fsdp8 (tracemalloc sees every numpy
    array the import makes; on CPU the shards JAX keeps may be those arrays): what is left at
    the end is at most the shards, and the peak exceeds it by one shard (and its staging copy)
    and one layer's slice of a tensor, far below the model's bytes: never read whole."""
    fields = dict(GPT2, n_layer=12, n_embd=128, n_head=4)
    tensors = random_tensors(fields)
    d = write_hf_dir(tmp_path / "deep", fields, tensors)
    model_bytes = sum(x.nbytes for x in tensors.values())
    largest = max(x.nbytes for x in tensors.values())
    del tensors
    exp = Experiment.build(hf_cfg(d, "parallelism=fsdp8", "data.batch_size=8"), with_data=False)
    spec = exp.abstract_state().params  # its tracing's Python objects are not the import's
    gc.collect()
    tracemalloc.start()
    try:
        params = exp.hf_params(spec)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    sizes = [s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards]
    shards, one_shard = sum(sizes), max(sizes)
    assert model_bytes > 30 * largest and shards < 1.1 * model_bytes  # fsdp8: one copy
    assert kept <= shards + largest, (kept, shards)
    # The shard being filled, the copy JAX stages it through, one layer's region of a tensor
    # (as read, and transposed): each device's slices alone are read, never a whole tensor
    # (fsdp8 splits every matrix)
    print(f"import: peak {peak - kept:,} B over the kept shards; one shard {one_shard:,} B, "
          f"largest tensor {largest:,} B, model {model_bytes:,} B")
    assert peak - kept <= 2 * one_shard + largest / 4 + 64 * 1024, (peak, kept, one_shard)
    assert peak - kept < model_bytes / 8


def test_a_shard_reads_only_its_region_of_each_tensor():
    """``layout.dxrun_block``: every block a mesh can ask for (each axis whole or halved, head
    dims too) of every weight of GPT-2, Llama and Phi-3 (q, k, v and gate, up fused: the
    blocks of unequal parts of a transposed tensor) equals the whole tensor converted then
    sliced, and reads no more than the block when only the first axis is split."""
    import itertools

    from dxrun.hf import dxrun_block, shape_of, to_dxrun

    d = {"D": 8, "H": 4, "K": 2, "E": 2, "F": 12, "V": 10, "P": 6}
    rng = np.random.default_rng(0)
    for family in ("gpt2", "llama", "phi3"):
        K = d["H"] if family == "gpt2" else d["K"]
        shapes = {"wte": (10, 8), "wpe": (6, 8), "lm_head": (8, 10), "blocks/attn/wq": (8, 4, 2),
                  "blocks/attn/wk": (8, K, 2), "blocks/attn/wv": (8, K, 2),
                  "blocks/attn/wo": (4, 2, 8), "blocks/attn/bq": (4, 2),
                  "blocks/attn/bk": (K, 2), "blocks/attn/bv": (K, 2),
                  "blocks/mlp/w_up": (8, 12), "blocks/mlp/w_gate": (8, 12),
                  "blocks/mlp/w_down": (12, 8), "blocks/mlp/b_up": (12,)}
        for w in TABLES[family]:
            dk = {**d, "K": K}
            real, hf_shape = shapes.get(w.dxrun, (8,)), shape_of(w.hf_shape, dk)
            x = rng.standard_normal(hf_shape).astype(np.float32)
            whole = to_dxrun(w, x, real, dk)
            for halves in itertools.product(*[(1, 2) if n % 2 == 0 else (1,) for n in real]):
                for at in itertools.product(*[range(h) for h in halves]):
                    block = tuple((i * n // h, (i + 1) * n // h)
                                  for i, n, h in zip(at, real, halves, strict=True))
                    read = []
                    got = dxrun_block(w, real, block, hf_shape,
                                      lambda sl, x=x, read=read: read.append(x[sl]) or x[sl],
                                      dk)
                    want = whole[tuple(slice(a, b) for a, b in block)]
                    assert np.array_equal(got, want), (w.dxrun, block)
                    if all(h == 1 for h in halves[1:]):  # the first axis split, or none
                        assert read[0].size == want.size, (w.dxrun, block)


def test_plan_mode_plans_a_fine_tune_of_llama_3_1_8b_on_8_h100():
    """The published config.json of meta-llama/Llama-3.1-8B (a fixture: no weights): the
    model's shape, its 8.03 B parameters, rope scaling, planned on fsdp8 for H100s (bf16 compute,
    full remat, 2048-token windows: it fits); nothing is read but config.json."""
    from dxrun.autotune import plan_report
    from dxrun.fit import NoData

    d = ROOT / "tests" / "fixtures" / "llama-3.1-8b"
    given = [f"model.init_from=hf:{d}", "parallelism=fsdp8", "plan.target=h100",
             "logger=none", "data.seq_len=2048", "data.per_device_batch_size=1",
             "train.precision=bf16", "model.remat=full"]
    cfg = make_cfg(*given)
    apply_hf_model(cfg, given)
    validate(cfg)
    m = cfg.model
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size) == (
        32, 4096, 32, 8, 14336, 128256)
    assert m.rope_theta == 500000.0 and m.rope_scaling["factor"] == 8.0
    report = plan_report(cfg, Experiment.build(cfg, data=NoData()), suggest=False)
    assert report["n_params"] == 8_030_261_248
    assert report["target"]["target"].startswith("H100") and report["target"]["fits"]


def test_llama3_rope_scaling_keeps_high_frequencies_and_slows_low_ones():
    from dxrun.model.attention import llama3_frequencies

    E = 128
    freq = 500000.0 ** (-np.arange(0, E, 2, dtype=np.float32) / E)
    out = np.asarray(llama3_frequencies(freq, 8.0, 1.0, 4.0, 8192.0))
    wavelen = 2 * np.pi / freq
    np.testing.assert_array_equal(out[wavelen < 8192 / 4], freq[wavelen < 8192 / 4])
    np.testing.assert_allclose(out[wavelen > 8192], freq[wavelen > 8192] / 8, rtol=1e-6)
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert mid.any() and np.all(out[mid] < freq[mid]) and np.all(out[mid] > freq[mid] / 8)


def _damaged(hf, root: Path) -> dict[str, tuple[Path, str]]:
    """Directory -> the words its refusal must have."""
    cases = {}

    def copy(name: str, src: Path) -> Path:
        d = root / name
        shutil.copytree(src, d)
        return d

    cases["no_config"] = (copy("no_config", hf["gpt2"]), "no config.json")
    (cases["no_config"][0] / "config.json").unlink()
    d = copy("bert", hf["gpt2"])
    (d / "config.json").write_text(json.dumps({**read_config(d), "model_type": "bert"}))
    cases["bert"] = (d, "model_type=bert is not one dxrun reads")
    tensors = random_tensors(GPT2)
    missing = dict(tensors)
    del missing["h.1.mlp.c_fc.bias"]
    cases["missing"] = (write_hf_dir(root / "missing", GPT2, missing),
                        "tensor transformer.h.1.mlp.c_fc.bias is missing")
    cases["extra"] = (write_hf_dir(root / "extra", GPT2, {**tensors, "h.9.x": tensors["wte.weight"]}),
                      "tensor h.9.x is not one of the model's")
    wide = {**tensors, "h.0.mlp.c_fc.weight": np.zeros((32, 100), np.float32)}
    cases["shape"] = (write_hf_dir(root / "shape", GPT2, wide),
                      "tensor h.0.mlp.c_fc.weight has shape [32, 100], but config.json makes "
                      "it [32, 128]")
    d = copy("truncated", hf["gpt2"])
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])
    cases["truncated"] = (d, "model.safetensors: not a readable safetensors file")
    d = copy("msgpack", hf["gpt2"])
    (d / "model.safetensors").rename(d / "flax_model.msgpack")
    cases["msgpack"] = (d, "holds flax_model.msgpack (Flax's msgpack layout), not "
                           "model.safetensors (safetensors); save it with save_pretrained(dir, "
                           "safe_serialization=True)")
    cases["renamed"] = (write_hf_dir(root / "renamed", GPT2, {
        "tf." + n: x for n, x in tensors.items()}), "no tensor is named as transformers saves "
        "this model (e.g. transformer.wte.weight, in PyTorch's layout, or Flax's: kernel, "
        "embedding, scale); its tensors are named like tf.h.0.attn.c_attn.bias")
    return cases


def test_bad_directories_are_refused_in_one_line_naming_the_file(hf, tmp_path):
    """Each bad directory: one ConfigError line naming its file and what is wrong, from the
    config.json (before JAX builds anything) or from the safetensors headers (before the run
    writes anything); a model override that contradicts config.json; the two new keys'
    values."""
    for name, (d, words) in _damaged(hf, tmp_path).items():
        given = [f"model.init_from=hf:{d}", *SMALL, "parallelism=dp1"]
        cfg = make_cfg(*given)
        with pytest.raises(ConfigError) as e:
            apply_hf_model(cfg, given)
            check_hf_weights(Experiment.build(cfg, with_data=False).cfg.model)
        msg = str(e.value)
        assert words in msg and "\n" not in msg and str(d) in msg, (name, msg)
    for key, words in (("model.init_from=gpt2", "model.init_from=gpt2: give hf:<dir>"),
                       ("experiment=finetune_hf", "model.init_from=hf:: give hf:<dir>"),
                       ("model.rope_scaling={factor:8}", "model.rope_scaling={'factor': 8}: "
                        "give null or positive factor, low_freq_factor")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            validate(make_cfg(key))
    given = [f"model.init_from=hf:{hf['llama']}", "model.n_kv_heads=8"]
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=8 contradicts .*config.json "
                                          r"\(n_kv_heads=4\); drop the override"):
        apply_hf_model(make_cfg(*given), given)


def test_the_launcher_refuses_a_bad_directory_in_one_line_and_writes_nothing(
        hf, tmp_path, monkeypatch, capsys):
    """A truncated safetensors file through ``python -m dxrun``, and a path with no
    checkpoint through ``python -m dxrun.export``: one line each, exit 2, no run dir and no
    export dir left behind."""
    d = _damaged(hf, tmp_path / "cases")["truncated"][0]
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dxrun", f"model.init_from=hf:{d}", "parallelism=dp1",
         "logger=none", "data.batch_size=4", "data.seq_len=16", f"hydra.run.dir={out}"],
        capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "not a readable safetensors file" in lines[0] and str(d) in lines[0]
    assert not out.exists() or not any(out.iterdir())
    # The export tool's entry point, in process (its refusal is the same code as a subprocess's)
    monkeypatch.setattr(sys, "argv", ["dxrun.export", str(tmp_path / "nowhere"),
                                      "--to", str(tmp_path / "exported")])
    with pytest.raises(SystemExit) as e:
        main("export", export_run)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("dxrun.export: error: path="), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "exported").exists()


def test_a_model_with_no_hf_equivalent_is_refused_naming_what_differs():
    m = make_cfg("model=tiny").model  # GPT-2 style with an untied output layer
    with pytest.raises(ConfigError, match=r"no Hugging Face equivalent: nearest is gpt2 "
                                          r"\(GPT2LMHeadModel.*\), but model.tie_embeddings=false"):
        model_type_of(m)
    assert model_type_of(make_cfg("model=tiny", "model.tie_embeddings=true").model) == "gpt2"
    # the presets the guide names as exportable, each as its family
    for preset, kind in (("small", "gpt2"), ("medium", "gpt2"), ("large", "gpt2"),
                         ("xl", "gpt2"), ("tiny_llama", "llama"), ("llama2_7b", "llama"),
                         ("llama3_8b", "llama")):
        assert model_type_of(make_cfg(f"model={preset}").model) == kind, preset
        assert f"`{preset}`" in (ROOT / "docs/guide/huggingface.md").read_text()


def test_the_guide_prints_the_layout_table_import_and_export_read():
    """Every dxrun weight of each family has one row, and the guide's tables are generated
    from these rows (docs/reference/hf_layout.py fills the page's marker at build time)."""
    from docs.reference.hf_layout import MARKER, fill

    assert len(TABLES["gpt2"]) == 20 and len(TABLES["llama"]) == 12
    assert {w.kind for w in TABLES["gpt2"]} == {"same"}
    assert {w.kind for w in TABLES["llama"] if w.hf.endswith("proj.weight")} == {"transposed"}
    page = (ROOT / "docs" / "guide" / "huggingface.md").read_text()
    assert MARKER in page
    filled = fill(page)
    for w in TABLES["gpt2"] + TABLES["llama"]:
        assert f"| `{w.hf}` | ({', '.join(w.hf_shape)}) | `{w.dxrun}` |" in filled, w


TEXT = ["data=text", "data.seq_len=16", "data.batch_size=8", "eval.batches=2", "logger=none"]


@pytest.mark.e2e  # a whole fine-tune
def test_a_fine_tune_lowers_the_held_out_loss_and_exports_what_it_computes(hf, tmp_path,
                                                                           caplog):
    """experiment=finetune_hf from a GPT-2 directory with its tokenizer.json, on a text corpus:
    the held-out loss after 30 steps is below the checkpoint's own (dxrun.evaluate of the HF
    dir); dxrun.export of the run writes the tokenizer and loads into transformers with
    dxrun's logits; imported again, it has the run's logits bit for bit and trains on
    identically (two steps, fresh optimizer, the same batches); dxrun.sample of the exported
    dir decodes with its tokenizer; a relaunch resumes the run's own checkpoint."""
    from dxrun.train import train

    corpus = write_corpus(tmp_path / "corpus.txt", n_sentences=400)
    d = tmp_path / "gpt2"
    shutil.copytree(hf["gpt2"], d)
    write_tokenizer(d / "tokenizer.json", corpus, vocab=V)
    data = [*TEXT, f"data.path={corpus}", "parallelism=dp1"]
    before = evaluate_checkpoint(d, data)["eval/loss"]
    given = ["experiment=finetune_hf", f"model.init_from=hf:{d}", *data, "train.steps=30",
             "optimizer.lr=3e-3", "optimizer.warmup_steps=5", "train.log_every=10",
             "train.eval_every=30", "checkpoint.every=30", "train.precision=fp32"]
    cfg = make_cfg(*given)
    apply_hf_model(cfg, given)
    assert cfg.data.tokenizer == str(d / "tokenizer.json")
    # the log's "model ..." line: the checkpoint's model, not the default preset modified
    assert describe_model(cfg.model, Job(choices={"model": "tiny"}, overrides=given)) == (
        f"hf-gpt2 (hf:{d})")
    validate(cfg)
    summary = train(cfg, tmp_path / "run")
    assert summary["eval/loss"] < before - 0.5, (before, summary["eval/loss"])

    out = export([str(tmp_path / "run"), "--to", str(tmp_path / "exported")])
    assert (out / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    run = load(tmp_path / "run", [], "path")  # its mesh, its step: compiled once
    ours = logits(run.exp, run.params, hf["tokens"])
    np.testing.assert_allclose(ours, reference_logits(out, hf["tokens"]), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(load_model(tmp_path / "run")(hf["tokens"]), ours)  # public

    exp = Experiment.build(hf_cfg(out, *data), with_data=False)
    again = exp.hf_params()
    np.testing.assert_array_equal(logits(exp, again, hf["tokens"]), ours)
    states = [run.exp.init_state(p) for p in (run.params, again)]
    for step in range(2):
        batch = run.exp.batch(step)
        (a, ma), (b, mb) = (run.exp.step(s, batch) for s in states)
        assert float(ma["train/loss"]) == float(mb["train/loss"])
        states = [a, b]
    for x, y in zip(jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # dxrun.sample reads the exported dir's prompt with its tokenizer.json; greedy, its first
    # token is the reference's argmax after the prompt
    options = {**OPTIONS, "prompt": "the cat sees", "max_new_tokens": 2}
    got = sample(out, options, ["logger=none", "data.seq_len=16"])
    assert got["texts"][0].startswith("the cat sees")
    prompt = got["tokens"][:, :got["prompt_len"]].astype(np.int32)
    assert got["tokens"][0, got["prompt_len"]] == reference_logits(out, prompt)[0, -1].argmax()
    # a dir without tokenizer.json (an exported bytes-level run's) takes ids, and says so
    with pytest.raises(ConfigError, match=re.escape(
            f"prompt='the cat': {hf['gpt2']} has no tokenizer.json: its prompts are token ids "
            f"0-{V - 1} separated by spaces")):
        sample(hf["gpt2"], {**options, "prompt": "the cat"}, ["logger=none", "data.seq_len=16"])

    # A relaunch into the run dir resumes its checkpoint, not the HF weights
    longer = [*given, "train.steps=40"]
    cfg = make_cfg(*longer)
    apply_hf_model(cfg, longer)
    with caplog.at_level(logging.INFO, logger="dxrun"):
        assert train(cfg, tmp_path / "run")["step"] == 40
    assert "resuming from step 30" in caplog.text and "weights from" not in caplog.text


@pytest.mark.e2e  # two launched processes' training
def test_two_processes_import_and_train_as_one_does(hf, tmp_path):
    """``model.init_from`` on two processes (``dxrun.launch``, 4 simulated devices each,
    dp2_tp4: each process reads the shards of its own devices): the run's losses equal the
    same run's in one process."""
    from dxrun.train import train

    given = [f"model.init_from=hf:{hf['gpt2']}", "parallelism=dp2_tp4", *SMALL,
             "train.steps=2", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0"]
    # No compile cache for the launched ranks, as in tests/test_launch.py (NO_CACHE).
    proc = subprocess.run(
        [sys.executable, "-m", "dxrun.launch", "--nproc", "2", "--devices-per-proc", "4", "--",
         "runtime.compile_cache=null", *given, "hydra.run.dir=two"], cwd=tmp_path,
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"weights from hf:{hf['gpt2']}" in proc.stdout + proc.stderr
    cfg = make_cfg(*given)
    apply_hf_model(cfg, given)
    validate(cfg)
    train(cfg, tmp_path / "one")

    def losses(run: Path) -> list[float]:
        rows = (run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["train/loss"] for x in rows]

    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(two) == 2
    np.testing.assert_allclose(two, one, rtol=1e-5)
