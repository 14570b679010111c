"""The schema's value checks: each key's facts live in its field (``config.key``), and the
ranges, choices, checks and tables are what those fields say."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from dxrun.checks import validation
from dxrun.config import registry, schema
from dxrun.config.errors import ConfigError
from dxrun.run import Faults, faults_from_env


def _numeric_keys() -> list[str]:
    hints = {k: h for k, _, h in schema.walk(schema.RunConfig)}
    # Optional numbers too (the data keys only some sources read).
    return [k for k, h in hints.items()
            if set(typing.get_args(h) or [h]) - {type(None)} <= {int, float}]


def test_every_section_and_key_has_a_meaning():
    sections = [f for cls in (schema.RunConfig, schema.TrainConfig)
                for f in dataclasses.fields(cls) if dataclasses.is_dataclass(f.default_factory)]
    assert len(sections) == 14 and len(schema.FIELDS) > 100  # 14: train.early_stop
    missing = [f.name for f in sections if not f.metadata.get("meaning")]
    missing += [k for k, f in schema.FIELDS.items() if not f.metadata.get("meaning", "").strip()]
    assert not missing, f"give these a meaning in their key(...): {missing}"


def test_every_numeric_key_has_its_range_or_a_reason_in_its_field():
    """A number without a bound would be checked nowhere: each carries a Range or says where it
    is checked (``unranged``), never both; RANGES and UNRANGED are exactly what fields say."""
    meta = {k: f.metadata for k, f in schema.FIELDS.items()}
    numeric = _numeric_keys()
    assert {"train.steps", "parallelism.dp", "data.order", "runtime.memory_gb"} <= set(numeric)
    assert not [k for k in numeric if bool(meta[k]["range"]) == bool(meta[k]["unranged"])]
    assert schema.RANGES == {k: meta[k]["range"] for k in numeric if meta[k]["range"]}
    assert schema.UNRANGED == {k: meta[k]["unranged"] for k in numeric if meta[k]["unranged"]}
    assert all(":" in why for why in schema.UNRANGED.values())  # accepted: where it is checked
    assert not [k for k, m in meta.items() if (m["range"] or m["unranged"]) and k not in numeric]
    assert schema.RANGES["optimizer.decay_frac"] == schema.Range(0, 1, lo_closed=False,
                                                                 hi_closed=True)
    # null is a setting of its own for these; for the source keys and the batch pair it is not.
    assert set(schema.NULLABLE) == {"distributed.num_processes", "distributed.process_id",
                                    "data.seq_len", "checkpoint.every", "model.loss_chunk",
                                    "parallelism.search_budget", "model.head_dim",
                                    "model.sliding_window", "model.global_every",
                                    "model.rope_local_theta", "model.attn_softcap",
                                    "model.logit_softcap", "model.attn_scalar",
                                    "model.moe.d_ff", "model.moe.capacity_factor"}
    assert schema.DATA_SOURCE_KEYS["path"] == ("text", "tokens")
    assert schema.DATA_SOURCE_KEYS["order"] == ("markov",)


def test_the_schema_with_metadata_is_still_a_structured_config():
    from hydra.core.config_store import ConfigStore

    node = OmegaConf.structured(schema.RunConfig)
    assert node.train.profile.steps == 3 and node.logger.tags == []
    assert OmegaConf.get_type(node.model) is schema.ModelConfig
    registry.register()
    assert "dxrun_schema.yaml" in ConfigStore.instance().list("/")


# The keys conf/config.yaml may set beside its defaults list and Hydra's settings, each with why
# it must be YAML rather than the schema's default. Empty: every default is the schema's.
YAML_ONLY: dict[str, str] = {}


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """``section.key`` -> value for every leaf (an empty section or list is a leaf)."""
    if isinstance(node, dict) and (node or not prefix):
        return {k: v for name, sub in node.items() for k, v in _flat(sub, f"{prefix}{name}.").items()}
    return {prefix[:-1]: node}


def test_config_yaml_writes_no_default_of_the_schemas():
    """A default is written once, in the schema: conf/config.yaml holds the defaults list and
    Hydra's settings, and any run key it sets is on YAML_ONLY with its reason."""
    import yaml

    raw = yaml.safe_load((registry.conf_dir() / "config.yaml").read_text())
    sets = _flat({k: v for k, v in raw.items() if k not in ("defaults", "hydra")})
    assert set(sets) <= set(YAML_ONLY), f"defaults belong to dxrun/config/schema.py: {sorted(sets)}"
    assert {k for k in sets if k in YAML_ONLY} == set(YAML_ONLY), "YAML_ONLY names a stale key"


def test_the_default_run_is_the_schema_but_for_its_group_presets(base_cfg):
    """Every value ``python -m dxrun`` composes is the schema's default, or set by one of the
    default group options conf/config.yaml chooses (model=tiny, parallelism=auto, ...): nothing
    else can hold a second default that drifts from the schema's."""
    import yaml

    conf = registry.conf_dir()
    chosen = [next(iter(e.items())) for e in yaml.safe_load((conf / "config.yaml").read_text())[
        "defaults"] if isinstance(e, dict) and next(iter(e.values())) is not None]
    by_presets: set[str] = set()
    for group, option in chosen:
        text = (conf / group / f"{option}.yaml").read_text()
        values = yaml.safe_load(text) or {}
        by_presets |= set(_flat(values if "@package _global_" in text else {group: values}))
    composed = _flat(OmegaConf.to_container(base_cfg, resolve=False))
    schema_defaults = _flat(OmegaConf.to_container(OmegaConf.structured(schema.RunConfig),
                                                   resolve=False))
    assert set(composed) == set(schema_defaults)
    drift = {k: (v, schema_defaults[k]) for k, v in composed.items()
             if v != schema_defaults[k] and k not in by_presets}
    assert not drift, f"composed value, schema default: {drift}"
    assert {"model.vocab_size", "data.vocab_size", "parallelism.search"} <= by_presets


@pytest.fixture(scope="module")
def compose():
    """A composed config per set of overrides, composed once for the module."""
    from conftest import make_cfg

    cache: dict[tuple[str, ...], Any] = {}

    def get(*overrides: str) -> Any:
        if overrides not in cache:
            cache[overrides] = make_cfg(*overrides)
        return cache[overrides]

    return get


@pytest.fixture(scope="module")
def base_cfg(compose):
    return compose()


def _with(cfg, **values):
    cfg = cfg.copy()
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def _choosing(compose, key: str):
    """A copy of the default config in which ``key`` can take each of its choices: a data
    source comes with its preset's keys and a path; data.dtype is read by data=tokens only."""
    if key == "data.name":
        return None  # each source is its own preset: composed per choice
    if key == "data.dtype":
        return compose("data=tokens", "data.path=x").copy()
    return compose().copy()


@pytest.mark.parametrize("key", sorted(k for k, f in schema.FIELDS.items()
                                       if f.metadata["choices"]))
def test_validate_accepts_exactly_the_choices_in_the_field(compose, key):
    allowed = schema.choices_of(key)
    assert allowed and allowed == schema._CHOICES.get(key, allowed)
    cfg = _choosing(compose, key)
    for value in allowed:
        if cfg is None:
            validation.validate(compose(*({"markov": [], "text": ["data=text", "data.path=x"]}.get(
                value, [f"data={value}", "data.path=x", "data.dtype=uint16"]))))
        else:
            OmegaConf.update(cfg, key, value, merge=False)
            validation.validate(cfg)
    cfg = _with(compose(), **{key: "bogus"}) if cfg is None else cfg
    OmegaConf.update(cfg, key, "bogus", merge=False)
    with pytest.raises(ConfigError) as err:
        validation.validate(cfg)
    msg = str(err.value)
    assert msg.startswith((f"{key}='bogus' is not one of ", f"{key}=bogus is not a known"))
    assert ", ".join(allowed) in msg and "\n" not in msg
    null_ok = key in ("logger.mode", "plan.target")  # null: follow $WANDB_MODE, these devices
    assert schema.null_is_a_value(key) == null_ok
    if null_ok:
        OmegaConf.update(cfg, key, None, merge=False)
        validation.validate(cfg)


def test_choice_refusals_keep_their_words(base_cfg):
    cases = {"model.norm": "model.norm='bogus' is not one of layernorm, rmsnorm; pick one of them",
             "logger.mode": "logger.mode='bogus' is not one of offline, online, disabled; or "
                            "leave it null to follow $WANDB_MODE"}
    for key, want in cases.items():
        with pytest.raises(ConfigError, match=f"^{want.replace('$', '[$]')}$"):
            validation.validate(_with(base_cfg, **{key: "bogus"}))
    with pytest.raises(ConfigError, match=r"^plan.target=h999 is not a known target; choose one "
                       r"of h100, .* \(or leave it null for the visible devices\)$"):
        validation.validate(_with(base_cfg, **{"plan.target": "h999"}))


def test_validate_is_one_short_check_per_section():
    import inspect

    for section in (f.name for f in dataclasses.fields(schema.RunConfig)):
        check = getattr(validation, f"check_{section}")
        assert check.__name__ in inspect.getsource(validation.validate)
        assert len(inspect.getsource(check).splitlines()) <= 30, section


@pytest.mark.parametrize("override", ["train.seed=-1", "data.seed=-3",
                                      "distributed.num_processes=0",
                                      "distributed.process_id=-1"])
def test_seeds_and_process_numbers_are_ranged(cfg_factory, override):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError, match=f"^{key}={value} is outside its range .*; set {key} "):
        validation.validate(cfg_factory(override))


def test_readme_lists_the_generated_ranges():
    readme = (Path(__file__).resolve().parents[1] / "docs/guide/bad-input.md").read_text()
    assert schema.ranges_markdown() in readme, (
        "README's table of ranges is stale: paste the output of "
        "python -c 'from dxrun.config.schema import ranges_markdown; print(ranges_markdown())'")


@pytest.mark.parametrize("override, bad", [
    ("optimizer.b1=1.0", True), ("optimizer.b1=0.0", False), ("optimizer.b2=-0.1", True),
    ("optimizer.eps=0", True), ("optimizer.momentum=1.0", True),
    ("optimizer.min_lr_ratio=1.0", False), ("optimizer.min_lr_ratio=1.01", True),
    ("optimizer.decay_frac=0", True), ("optimizer.decay_frac=1.0", False),
    ("model.init_std=0", True), ("model.rope_theta=-1", True), ("model.dropout=1.0", True),
    ("model.dropout=0.0", False), ("data.val_fraction=1.0", True),
    ("model.head_dim=0", True), ("model.head_dim=24", False), ("model.sliding_window=0", True),
    ("model.sliding_window=8", False),
    ("data.val_fraction=0.0", False),
    # NaN compares false with every bound; inf is no learning rate or fraction either.
    ("optimizer.lr=nan", True), ("optimizer.lr=inf", True), ("optimizer.min_lr_ratio=nan", True),
    ("data.val_fraction=nan", True), ("model.dropout=-inf", True),
    # Integers end where what they feed overflows (schema.INT32 and the seeds' comments).
    ("train.seed=4294967295", False), ("train.seed=4294967296", True),
    ("data.seed=4294967294", False), ("data.seed=4294967295", True),
    ("train.steps=2147483647", False), ("train.steps=2147483648", True),
    ("data.batch_size=2147483648", True),
])
def test_ranges_refuse_with_key_value_and_fix(cfg_factory, override, bad):
    source = ["data=text", "data.path=x.txt"] if override.startswith("data.") else []
    cfg = cfg_factory(*source, override)
    if not bad:
        validation.validate(cfg)
        return
    with pytest.raises(ConfigError) as err:
        validation.validate(cfg)
    key, value = override.split("=")
    msg = str(err.value)
    assert msg.startswith(f"{key}={value}") and "set " + key in msg and "\n" not in msg


@pytest.mark.parametrize("variable, value, bad", [
    ("DXRUN_TEST_NAN_AT_STEP", "2147483647", False), ("DXRUN_TEST_NAN_AT_STEP", "2147483648", True),
    ("DXRUN_TEST_HOLD_AT_STEP", "-1", True), ("DXRUN_TEST_ERROR_AT_STEP", "x", True),
    ("DXRUN_TEST_ERROR_AT_STEP", "3", False),
])
def test_test_only_faults_come_from_the_environment_ranged(variable, value, bad):
    """The tests' faults are no key of the user's config (``dxrun.run.faults``): each is read from
    its environment variable, refused outside its range like a key (the NaN step is compared
    with the int32 step counter)."""
    assert not [k for k in schema.FIELDS if "inject" in k or "hold_at" in k]
    assert faults_from_env({}) == Faults()
    if not bad:
        got = faults_from_env({variable: value})
        assert int(value) in got.steps() and sorted(got.steps())[:2] == [0, 0]
        return
    with pytest.raises(ConfigError) as err:
        faults_from_env({variable: value})
    msg = str(err.value)
    assert msg.startswith(f"{variable}={value}") and "set " + variable in msg and "\n" not in msg


def test_the_deaf_rank_fault_can_name_rank_0():
    """Unset is off; a rank's number, 0 included, names it (a step fault's 0 is off anyway:
    steps count from 1)."""
    assert faults_from_env({}).deaf_rank is None
    assert faults_from_env({"DXRUN_TEST_DEAF_RANK": "0"}).deaf_rank == 0
    assert faults_from_env({"DXRUN_TEST_DEAF_RANK": ""}).deaf_rank is None
    with pytest.raises(ConfigError):
        faults_from_env({"DXRUN_TEST_DEAF_RANK": "-1"})


def _float_ranged_keys() -> list[str]:
    return sorted(k for k, _, hint in schema.walk(schema.RunConfig)
                  if k in schema.RANGES and float in (typing.get_args(hint) or (hint,)))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_no_range_holds_nan_or_inf(compose, value):
    keys = _float_ranged_keys()
    assert {"optimizer.lr", "optimizer.min_lr_ratio", "data.val_fraction"} <= set(keys)
    for key in keys:
        reads = schema.FIELDS[key].metadata["sources"]
        cfg = compose(*(["data=text", "data.path=x.txt"] if "text" in reads else []))
        with pytest.raises(ConfigError) as err:
            validation.validate(_with(cfg, **{key: value}))
        assert str(err.value) == (f"{key}={value} is not a finite number; "
                                  f"{schema.RANGES[key].fix(key)}")
    for key in ("runtime.memory_gb", "runtime.peak_tflops"):  # unranged, checked by hand
        with pytest.raises(ConfigError, match=f"^{key}={value} must be a finite positive "):
            validation.validate(_with(compose(), **{key: value}))


def test_integer_bounds_are_where_what_they_feed_overflows(cfg_factory):
    """The schema's integer bounds, each against the thing it guards: JAX's 32-bit keys,
    Grain's seed, and the int32 token count of a step (refused by the plan, before compile)."""
    import grain
    import jax
    import numpy as np

    from dxrun.plan import make_plan

    top = schema.RANGES["train.seed"].hi - 1
    data = lambda seed: np.asarray(jax.random.key_data(jax.random.key(seed))).tolist()
    assert data(top) != data(0) and data(top + 1) == data(0)  # 2^32 would be seed 0 again
    top = schema.RANGES["data.seed"].hi - 1
    grain.MapDataset.source([0, 1]).shuffle(seed=top + 1)  # + the held-out stream
    with pytest.raises(ValueError):
        grain.MapDataset.source([0, 1]).shuffle(seed=top + 2)
    ok = cfg_factory("data.batch_size=32768", "data.seq_len=65535", "model.max_seq_len=65536")
    assert make_plan(ok, 8).global_batch * 65535 == 2**31 - 32768
    for overrides, given in [(["data.batch_size=32768"], "data.batch_size=32768"),
                             (["data.batch_size=null", "data.per_device_batch_size=4096"],
                              "data.per_device_batch_size=4096 (a global batch of 32768)")]:
        cfg = cfg_factory(*overrides, "data.seq_len=65536", "model.max_seq_len=65536")
        validation.validate(cfg)
        with pytest.raises(ConfigError) as err:
            make_plan(cfg, 8)
        key = given.partition("=")[0]
        assert str(err.value) == (
            f"{given} with data.seq_len=65536 makes 2,147,483,648 tokens a step, beyond the "
            f"int32 the loss divides by (at most 2,147,483,647); lower {key} or data.seq_len")


@pytest.mark.e2e  # the launcher as a subprocess
@pytest.mark.parametrize("args, line", [
    (["optimizer.lr=nan", "train.nan_policy=skip"],
     "optimizer.lr=nan is not a finite number; set optimizer.lr > 0"),
    (["optimizer.min_lr_ratio=nan"],
     "optimizer.min_lr_ratio=nan is not a finite number; set optimizer.min_lr_ratio in [0, 1]"),
    (["train.seed=9223372036854775808"], "train.seed=9223372036854775808 is outside its range "
                                         "[0, 2^32); set train.seed in [0, 2^32)"),
    (["data.batch_size=1099511627776"], "data.batch_size=1099511627776 is outside its range "
                                        "(0, 2^31); set data.batch_size in (0, 2^31)"),
])
def test_nan_inf_and_overflowing_integers_are_one_line_at_the_cli(tmp_path, args, line):
    from conftest import run_cli

    proc = run_cli(*args, "logger=none", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [x for x in proc.stderr.splitlines() if x.startswith("dxrun: error:")]
    assert errors == [f"dxrun: error: {line}"], proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # refused before the run dir: nothing left


def test_warmup_longer_than_training_warns(cfg_factory):
    (w,) = validation.config_warnings(cfg_factory("train.steps=10", "optimizer.warmup_steps=20"))
    assert "optimizer.warmup_steps=20" in w and "train.steps=10" in w
    assert validation.config_warnings(cfg_factory("train.steps=100")) == []


def _prepared_dir(root: Path) -> Path:
    root.mkdir()
    (root / "train.bin").write_bytes(b"\0\1" * 64)
    return root


@pytest.mark.parametrize("overrides, needle", [
    # The user forgot data=tokens: the path is named, and the source it needs.
    (lambda d: [f"data.path={_prepared_dir(d / 'mycorpus')}"],
     "is used by data=text and data=tokens, not data=markov; add data=tokens"),
    (lambda d: ["data.path=no/such/corpus"], "not data=markov; add data=text or data=tokens"),
    (lambda d: ["data=text", "data.path=x.txt", "data.order=3"],
     "data.order=3 is used by data=markov, not data=text; add data=markov"),
    (lambda d: ["data.workers=2"], "data.workers=2 is used by data=text and data=tokens"),
    (lambda d: ["data=tokens", "data.path=x", "data.tokenizer=t.json"],
     "data.tokenizer=t.json is used by data=text, not data=tokens"),
    (lambda d: ["data=text", "data.path=x.txt", "data.dtype=uint32"],
     "data.dtype=uint32 is used by data=tokens, not data=text"),
    (lambda d: ["data=tokens", "data.path=x", "data.val_fraction=0.1"],
     "data.val_fraction=0.1 is used by data=text, not data=tokens"),
])
def test_a_data_key_the_source_does_not_read_is_refused(cfg_factory, tmp_path, overrides,
                                                        needle):
    with pytest.raises(ConfigError) as err:
        validation.validate(cfg_factory(*overrides(tmp_path)))
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


# GPT-3 paper, table 2.1 for the GPT-2 sizes; the tiny presets keep what reaches the markov floor.
SIZE_DEFAULTS = {"tiny": (1e-2, 20), "tiny_llama": (1e-2, 20), "small": (6e-4, 200),
                 "medium": (3e-4, 300), "large": (2.5e-4, 400), "xl": (2e-4, 500),
                 "qwen3_0_6b": (2.5e-4, 400), "qwen3_8b": (3e-4, 2000),
                 "qwen2_5_7b": (3e-4, 2000), "mistral_7b": (3e-4, 2000),
                 "olmo2_1b": (2e-4, 500), "gemma2_2b": (1.6e-4, 2000),
                 "phi3_mini": (1.6e-4, 2000), "moe_tiny": (1e-2, 20), "moe_small": (6e-4, 200),
                 "mixtral_8x7b": (3e-4, 2000), "qwen3_30b_a3b": (3e-4, 2000)}


@pytest.mark.parametrize("model", sorted(SIZE_DEFAULTS))
def test_each_model_preset_brings_its_lr_and_warmup(cfg_factory, model):
    cfg = cfg_factory(f"model={model}")
    assert (cfg.model.name, cfg.optimizer.name) == (model, "adamw")
    assert (cfg.optimizer.lr, cfg.optimizer.warmup_steps) == SIZE_DEFAULTS[model]


def test_optimizer_choice_and_overrides_win_over_the_size_defaults(cfg_factory):
    lion = cfg_factory("model=small", "optimizer=lion")
    assert (lion.optimizer.lr, lion.optimizer.warmup_steps) == (3e-4, 200)  # lion's own lr
    assert cfg_factory("model=small", "optimizer.lr=1e-3").optimizer.lr == 1e-3
    assert cfg_factory("model=small", "optimizer.warmup_steps=5").optimizer.warmup_steps == 5
    assert cfg_factory("model=small", "optimizer=sgd").optimizer.lr == 0.1
    # An experiment's keys come after the groups.
    assert cfg_factory("experiment=markov_convergence", "model=small").optimizer.lr == 1e-2


@pytest.mark.e2e
def test_cfg_job_shows_the_size_defaults(tmp_path):
    import yaml
    from conftest import run_cli

    proc = run_cli("--cfg", "job", "model=medium", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    job = yaml.safe_load(proc.stdout)
    assert (job["optimizer"]["lr"], job["optimizer"]["warmup_steps"]) == (3e-4, 300)
    assert job["model"]["n_layers"] == 24


def test_real_data_seq_len_follows_the_platform(cfg_factory, tmp_path):
    """data=text and data=tokens leave data.seq_len null: the model's context on an
    accelerator, 64 on CPU; a number is kept; the markov default run stays at 64."""
    from dxrun.cost import plan_platform
    from dxrun.plan import RunPlan, default_seq_len, make_plan, resolved_config

    assert default_seq_len(None, 1024, "gpu") == default_seq_len(None, 1024, "tpu") == 1024
    assert default_seq_len(None, 1024, "cpu") == 64 and default_seq_len(None, 32, "cpu") == 32
    assert default_seq_len(256, 1024, "gpu") == default_seq_len(256, 1024, "cpu") == 256
    assert cfg_factory().data.seq_len == 64
    for source, dtype in (("text", []), ("tokens", ["data.dtype=uint16"])):
        cfg = cfg_factory(f"data={source}", f"data.path={tmp_path}", "model=large", *dtype)
        validation.validate(cfg)
        assert cfg.data.seq_len is None
        assert make_plan(cfg, 8, "cpu").seq_len == 64
        plan = make_plan(cfg, 8, "gpu")
        cfg = resolved_config(cfg, RunPlan(plan))  # what the run's saved config records
        assert plan.seq_len == cfg.data.seq_len == 1024
    # Plan mode for a named target resolves as a run there would, whatever this host is
    # (``autotune.search``: data.seq_len=null on the plan's platform).
    for target, backend, want in [("h100", "cpu", 1024), ("v5e", "cpu", 1024),
                                  ("cpu", "gpu", 64), (None, "gpu", 1024), (None, "cpu", 64)]:
        cfg = cfg_factory("data=tokens", f"data.path={tmp_path}", "model=large",
                          f"plan.target={'null' if target is None else target}")
        platform = plan_platform(cfg.plan.target, backend)
        assert default_seq_len(cfg.data.seq_len, cfg.model.max_seq_len, platform) == want, (
            target, backend)


@pytest.mark.parametrize("overrides, line", [
    (["model.qkv_bias=true"], "model.qkv_bias=true with model.bias=true: bias already puts "
     "biases on q, k and v; set model.qkv_bias=false"),
    (["model.sliding_window=4", "model.objective=mdlm"], "model.sliding_window=4 windows causal "
     "attention, and model.objective=mdlm attends both ways; set model.sliding_window=null"),
    (["model=tiny_llama", "model.head_dim=7"], "model.pos=rope needs an even head dim, got 7"),
    (["model.qk_norm=rms"], "model.qk_norm='rms' is not one of none, head, proj"),
    (["model.n_heads=5"], "pick n_heads that divides d_model, or set model.head_dim"),
    (["model.mlp=reglu"], "model.mlp='reglu' is not one of gelu, swiglu, geglu; pick one"),
    (["model.gelu=erf"], "model.gelu='erf' is not one of tanh, exact; pick one"),
    (["model.norm_position=middle"], "model.norm_position='middle' is not one of pre, post, "
     "sandwich"),
    (["model.attn_softcap=-1"], "model.attn_softcap=-1.0 is outside its range > 0"),
    (["model.logit_softcap=0"], "model.logit_softcap=0.0 is outside its range > 0"),
    (["model.attn_scalar=0"], "model.attn_scalar=0.0 is outside its range > 0"),
    (["model.global_every=0", "model.sliding_window=4"], "model.global_every=0 is outside its "
     "range > 0"),
    (["model.global_every=1", "model.sliding_window=4"], "model.global_every=1 makes every "
     "layer full, the window unused"),
    (["model.global_every=2"], "model.global_every=2 needs model.sliding_window; set "
     "model.sliding_window or model.global_every=null"),
    (["model.sliding_window=4", "model.rope_local_theta=100"], "model.rope_local_theta=100.0 "
     "needs model.global_every"),
    (["model.hf_type=bert"], "model.hf_type=bert is not a model_type dxrun writes; pick one "
     "of gpt2, llama, mistral, qwen2, qwen3, olmo2, gemma, gemma2, gemma3_text, phi3, mixtral, "
     "qwen2_moe, qwen3_moe, or null"),
    (["model.norm_plus_one=true"], "model.norm_plus_one=true scales RMSNorms, and "
     "model.norm=layernorm; set model.norm=rmsnorm or model.norm_plus_one=false"),
])
def test_the_attention_pieces_refuse_what_means_nothing(cfg_factory, overrides, line):
    with pytest.raises(ConfigError) as err:
        validation.validate(cfg_factory(*overrides))
    assert line in str(err.value) and "\n" not in str(err.value), str(err.value)
