"""The docs' Reference (docs/reference/) is complete: every config key, preset, metric, output
key and command-line tool that exists in the code has its entry, and nothing stale stays."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from docs import reference
from docs.reference import keys as config_keys
from docs.reference import outputs, tools
from dxrun.config import schema
from dxrun.config.metric_names import METRICS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pages():
    return reference.pages()


def test_every_config_key_has_a_row_with_type_default_and_meaning(pages):
    def keys_of(cls: type, prefix: str) -> list[str]:  # nested sections (train.profile) too
        return [k for f in dataclasses.fields(cls)
                for k in (keys_of(f.default_factory, f"{prefix}.{f.name}")
                          if dataclasses.is_dataclass(f.default_factory)
                          else [f"{prefix}.{f.name}"])]

    in_schema = [k for s in dataclasses.fields(schema.RunConfig)
                 for k in keys_of(s.default_factory, s.name)]
    keys = {k.key: k for k in config_keys.config_keys()}
    assert list(keys) == in_schema
    assert not [k for k, v in keys.items() if not v.meaning], "keys without a meaning: give " \
        "the field's key(...) in dxrun/config/schema.py one"
    rows = {m.group(1): m.group(0) for m in
            re.finditer(r"^\| `([\w.]+)` \| .*$", pages["reference/config.md"], re.M)}
    assert set(in_schema) <= set(rows)
    # The ranges and choices the validation uses are what the rows say.
    assert "| `optimizer.decay_frac` | `float` | `0.2` | (0, 1] |" in rows["optimizer.decay_frac"]
    assert "`layernorm` \\| `rmsnorm`" in rows["model.norm"]
    assert "| `train.steps` | `int` | `600` | (0, 2^31) |" in rows["train.steps"]  # int32 step
    assert "| `train.log_every` | `int` | `50` | > 0 |" in rows["train.log_every"]
    assert "`h100`" in rows["plan.target"]
    assert schema.ranges_markdown() in pages["reference/config.md"]
    # Each row's meaning is its field's (no second table of meanings beside the schema).
    assert all(k.meaning == schema.FIELDS[k.key].metadata["meaning"] for k in keys.values())
    assert "`offline` \\| `online` \\| `disabled` or null" in rows["logger.mode"]


def test_every_preset_file_is_listed_with_what_it_sets(pages):
    text = pages["reference/presets.md"]
    files = [*ROOT.glob("conf/*/*.yaml"), *ROOT.glob("conf/hydra/launcher/*.yaml"),
             *ROOT.glob("experiments/*"), *ROOT.glob("sweeps/*.yaml"),
             *ROOT.glob("sweeps/wandb/*.yaml")]
    assert len(files) >= 38
    for f in files:
        assert f"### `{f.name}`" in text, f"{f.relative_to(ROOT)} has no entry"
    section = text.split("### `llama_fsdp.yaml`")[1].split("###")[0]
    assert "`model=tiny_llama`" in section and "`parallelism=fsdp8`" in section
    assert "`train.steps=300`" in section and "Llama-style block" in section


def test_every_metric_the_code_logs_has_unit_and_reduction(pages):
    in_code = outputs.metric_names_in_code()
    assert {"train/loss", "perf/mfu", "eval/tokens", "train/skipped_steps"} <= in_code
    assert in_code - set(METRICS) == set(), "metrics without an entry in METRICS"
    assert set(METRICS) - in_code == set(), "METRICS lists a metric nothing logs"
    for name, (unit, reduction, meaning) in METRICS.items():
        assert unit and reduction and meaning
        assert f"| `{name}` | {unit} |" in pages["reference/outputs.md"]


def test_every_output_key_is_documented(pages):
    summary, status = outputs.summary_keys(), outputs.status_keys()
    assert {"n_params", "checkpoint_block_s", "**last"} <= set(summary)
    assert {"kind", "signal", "relaunch", "finished"} <= set(status)
    assert not [k for k in summary if not outputs.SUMMARY.get(k)], "summary.json keys"
    assert not [k for k in status if not outputs.STATUS.get(k)], "status.json keys"
    assert not set(outputs.SUMMARY) - set(summary) and not set(outputs.STATUS) - set(status)
    plan = outputs.plan_keys()
    assert {"dp", "fsdp", "tp", "global_batch", "padded_vocab", "mesh_shape", "per_device_batch",
            "plan_mode"} <= set(plan)
    text = pages["reference/outputs.md"]
    for name in [*outputs.RUN_FILES, *summary, *status, *plan]:
        assert f"| `{name}` |" in text


def test_the_guides_run_dir_tree_names_every_file_the_reference_lists():
    tree = (ROOT / "docs/guide/outputs.md").read_text().split("```")[1]
    names = re.findall(r"── (\S+)", tree)
    assert not [f for f in outputs.RUN_FILES if f not in names], names


def test_every_tool_has_its_usage(pages):
    assert tools.entry_points() == set(tools.TOOLS)
    text = pages["reference/tools.md"]
    for tool in tools.TOOLS:
        assert f"## `python -m {tool}`" in text
    launch = tools.tool_usage("dxrun.launch")
    assert launch.startswith("usage: python -m dxrun.launch")
    assert all(o in launch for o in ("--nproc", "--devices-per-proc", "--hosts", "--grace"))
    assert "--tokenizer" in tools.tool_usage("dxrun.data.prepare")
    assert "--multirun" in tools.tool_usage("dxrun")
    assert "max_new_tokens=64" in tools.tool_usage("dxrun.sample")


def test_generating_the_reference_imports_no_jax():
    code = ("import sys; from docs import reference; reference.pages(); reference.figures(); "
            "assert 'jax' not in sys.modules, 'reference imported jax'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_mesh_figures_are_the_plans():
    """dp4_tp2: device 1 is data replica 1's second tensor rank; fsdp8: 8 batch shards, each
    device one eighth of every weight's embed axis."""
    figs = reference.figures()
    tp = figs["figures/mesh_dp4_tp2.svg"]
    assert "data=4 x fsdp=1 x tensor=2" in tp and tp.count("<rect") == 8
    dev1 = tp.split("device 1</text>")[1].split("<rect")[0]
    assert "batch rows 1/4" in dev1 and "heads, kv_heads, mlp, vocab: part 2/2" in dev1
    fsdp = figs["figures/mesh_fsdp8.svg"]
    assert "batch rows 8/8" in fsdp and "embed: part 8/8" in fsdp and "tensor" not in fsdp.split(
        "</text>", 2)[2]


def test_the_readme_stays_short_and_its_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README is the entry point: move detail to docs/"
    prose = re.sub(r"^```.*?^```$", "", readme, flags=re.M | re.S)
    assert not [line for line in prose.splitlines() if len(line) > 100 and line[:4] != "<!--"]
    links = re.findall(r"\]\(((?:docs/|BENCHMARKS)[^)#]*)", readme)
    assert len(links) >= 14 and all((ROOT / link).is_file() for link in links), links
    # CI runs the README's commands: they must stay the ones .ci/run runs.
    ci = (ROOT / ".ci/run").read_text()
    assert "python -m pip install -e '.[dev]'" in readme
    assert re.search(r"^python -m pip install (--quiet )?-e '\.\[dev", ci, re.M)
    for command in ("python -m dxrun", "python -m pytest -n 2 --dist loadfile"):
        assert f"\n{command}" in readme and f"\n{command}\n" in ci
