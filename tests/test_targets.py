"""Your own parts through Hydra's ``_target_``: optimizer._target_ trains as the preset it names;
a model, data or optimizer factory that cannot take what dxrun passes it is refused in one line
(the model and data protocols' own checks: test_custom_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import optax
import pytest
from conftest import cli_in_process, make_cfg, recorded_compiles
from flax import nnx

from dxrun.config.errors import ConfigError
from dxrun.config.target import call_refusal, locate
from dxrun.data import build_source
from dxrun.experiment import custom_optimizer
from dxrun.model.user_model import build_model
from dxrun.train import train

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

TINY = ["model=tiny", "model.n_layers=1", "data.seq_len=16", "data.batch_size=8",
        "parallelism=dp1", "logger=none"]


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e  # two trainings compared loss for loss
def test_an_optimizer_target_is_the_preset_it_names(tmp_path):
    """optimizer._target_ with optax.adamw and the preset's numbers trains exactly as
    optimizer=adamw does (no weight decay: the preset's mask is then moot)."""
    same = [*TINY, "optimizer.weight_decay=0.0", "train.steps=3", "train.log_every=1",
            "train.eval_every=0", "checkpoint.every=0"]
    train(make_cfg(*same), tmp_path / "preset")
    train(make_cfg(*same, "optimizer._target_=optax.adamw", "+optimizer.kwargs.b1=0.9",
                   "+optimizer.kwargs.b2=0.95", "+optimizer.kwargs.eps=1e-8",
                   "+optimizer.kwargs.weight_decay=0.0"), tmp_path / "target")
    losses = [[r["train/loss"] for r in _rows(tmp_path / d)] for d in ("preset", "target")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_an_optimizer_target_that_is_no_optax_factory_is_refused():
    with pytest.raises(ConfigError, match=r"^optimizer._target_=optax.nope cannot be imported"):
        custom_optimizer("optax.nope", lambda s: 0.1, {})
    with pytest.raises(ConfigError, match=r"returned a dict, not an optax"):
        custom_optimizer("builtins.dict", lambda s: 0.1, {})


class NoVocab(nnx.Module):
    """A module that takes no vocab_size (dxrun passes one)."""

    def __init__(self, d_model: int, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.numpy.zeros((d_model, d_model)), axes=("embed", "mlp"))


class NeedsWidth(nnx.Module):
    """A module with a parameter nothing gives unless model.kwargs does."""

    def __init__(self, vocab_size: int, rngs: nnx.Rngs, *, width: int):
        self.w = nnx.Param(jax.numpy.zeros((vocab_size, width)), axes=("vocab", "embed"))


class NoSeed:
    """A batch source without the seed dxrun passes."""

    def __init__(self, batch_size: int, seq_len: int, vocab_size: int):
        pass


def _model(target: str, *kwargs: str) -> None:
    build_model(make_cfg(f"model._target_={target}", *kwargs).model, nnx.Rngs(0))


# How each site builds a plug-in, as dxrun does, and the line it refuses with. The factory's
# signature and dxrun's call are both in the line.
MODEL_CALL = "(**model.kwargs, vocab_size=<model.vocab_size>, rngs=<nnx.Rngs(train.seed)>)"
PLUGINS = [
    (lambda: _model(f"{__name__}.NoVocab", "+model.kwargs.d_model=8"),
     f"model._target_={__name__}.NoVocab does not take what dxrun passes: NoVocab(d_model, "
     f"rngs) takes no vocab_size; dxrun calls NoVocab{MODEL_CALL}: point model._target_ at a "
     "factory that takes vocab_size (a vocab_size parameter, or **kwargs)"),
    (lambda: _model(f"{__name__}.NeedsWidth"),
     f"model._target_={__name__}.NeedsWidth does not take what dxrun passes: NeedsWidth("
     "vocab_size, rngs, *, width) needs width, which neither dxrun nor model.kwargs gives; "
     f"dxrun calls NeedsWidth{MODEL_CALL}: set +model.kwargs.width=<value>, or give width a "
     "default"),
    (lambda: _model(f"{__name__}.NeedsWidth", "+model.kwargs.width=8", "+model.kwargs.depth=2"),
     f"model._target_={__name__}.NeedsWidth does not take what dxrun passes: NeedsWidth("
     "vocab_size, rngs, *, width) takes no depth, given as model.kwargs.depth; dxrun calls "
     f"NeedsWidth{MODEL_CALL}: drop model.kwargs.depth, or rename it to one of NeedsWidth's "
     "parameters"),
    (lambda: _model(f"{__name__}.NeedsWidth", "+model.kwargs.width=8",
                    "+model.kwargs.vocab_size=8"),
     "model.kwargs.vocab_size is passed by dxrun itself (model.vocab_size) to model._target_="
     f"{__name__}.NeedsWidth; drop model.kwargs.vocab_size"),
    (lambda: build_source(f"{__name__}.NoSeed", {}, 8, 16, 64, 0),
     f"data._target_={__name__}.NoSeed does not take what dxrun passes: NoSeed(batch_size, "
     "seq_len, vocab_size) takes no seed; dxrun calls NoSeed(**data.kwargs, batch_size=<the "
     "global batch>, seq_len=<the window>, vocab_size=<model.vocab_size>, seed=<data.seed>): "
     "point data._target_ at a factory that takes seed (a seed parameter, or **kwargs)"),
    (lambda: custom_optimizer("optax.adamw", 1e-3, {"beta1": 0.9}),
     "optimizer._target_=optax.adamw does not take what dxrun passes: adamw(learning_rate, "
     "b1=0.9, b2=0.999, eps=1e-08, eps_root=0.0, mu_dtype=None, weight_decay=0.0001, "
     "mask=None, *, nesterov=False) takes no beta1, given as optimizer.kwargs.beta1; dxrun "
     "calls adamw(**optimizer.kwargs, learning_rate=<the schedule of optimizer.lr>): drop "
     "optimizer.kwargs.beta1, or rename it to one of adamw's parameters"),
    (lambda: custom_optimizer("optax.chain", 1e-3, {}),
     "optimizer._target_=optax.chain does not take what dxrun passes: chain(*args) takes no "
     "learning_rate; dxrun calls chain(**optimizer.kwargs, learning_rate=<the schedule of "
     "optimizer.lr>): point optimizer._target_ at a factory that takes learning_rate (a "
     "learning_rate parameter, or **kwargs)"),
    (lambda: custom_optimizer("optax.contrib", 1e-3, {}),
     "optimizer._target_=optax.contrib is a module, not a class or function; give the dotted "
     "path of one, e.g. optax.nadamw"),
]


@pytest.mark.parametrize("build, line", PLUGINS, ids=[line.split(" does")[0].split(" is")[0]
                                                       for _, line in PLUGINS])
def test_a_plugin_that_cannot_take_what_dxrun_passes_is_one_line(build, line):
    """Refused where dxrun builds it (the CLI refuses before anything compiles: below),
    instead of the TypeError of the call."""
    with pytest.raises(ConfigError) as e:
        build()
    assert str(e.value) == line


def test_the_examples_and_optax_take_what_dxrun_passes():
    """The signature of a Flax NNX module is its __init__'s (its metaclass's __call__ takes
    anything): the example's model, data and an optax factory pass the check."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))
        for target, kwargs in (("custom_block.CustomLM", {"d_model": 16}),
                               ("custom_block.CountingData", {"max_stride": 2})):
            section = "model" if target.endswith("LM") else "data"
            factory = locate(f"{section}._target_", target, "")
            assert call_refusal(section, target, factory, list(kwargs)) is None
    assert call_refusal("optimizer", "optax.nadamw", optax.nadamw, ["b1", "nesterov"]) is None


def test_a_plugin_with_the_wrong_signature_is_refused_before_anything_is_made(tmp_path):
    """Through the entry point: exit 2, the one line, nothing compiled, no run dir left (it was
    a crash, exit 1, status "crashed" in a run dir)."""
    with recorded_compiles() as compiled:
        proc = cli_in_process(f"model._target_={__name__}.NoVocab", "+model.kwargs.d_model=8",
                              "logger=none", "train.steps=1", "data.seq_len=16",
                              "data.batch_size=8", "parallelism=dp1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("dxrun: error:")]
    assert line == f"dxrun: error: {PLUGINS[0][1]}"
    assert compiled == [] and not list(tmp_path.iterdir())
