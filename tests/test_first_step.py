"""The time to a run's first step: the train step compiled once before it, on an accelerator
too (where an analysis compile is the full one), and a program the persistent compile cache
finds again at the next launch."""

from __future__ import annotations

import pytest
from conftest import make_cfg, recorded_compiles

from dxrun.experiment import Experiment
from dxrun.experiment import step as experiment_step
from dxrun.model.sharding import in_mesh_context
from dxrun.tracking import goodput
from dxrun.train import prepare, start_state

# One device, one layer, short sequences: what is counted is compiles, not their size.
SMALL = ("logger=none", "model.n_layers=1", "data.batch_size=4", "data.seq_len=16",
         "parallelism.n_devices=1")


# search=model (ranked by the estimate alone) compiled the step twice; dp1 and search=measure
# share the preflight's compile too, which test_train's one-compile test guards on CPU.
@pytest.mark.parametrize("layout", [
    ("parallelism=auto", "parallelism.search=model"),
], ids=lambda layout: " ".join(layout))
def test_an_accelerator_run_compiles_its_step_once_before_the_first_step(
        layout, monkeypatch, tmp_path):
    """The memory preflight's compile (or the layout search's) is the executable the first
    step runs: one compile of ``jit(step)`` from the launch to the first step's result. On a
    GPU or TPU an analysis compile has no cheaper options (``experiment.analysis_options``), so a
    search that ranks from analysis compiles keeps the chosen one for the run instead of
    compiling the same program again."""
    monkeypatch.setattr(experiment_step, "analysis_options", lambda platform: {})  # a GPU's or TPU's
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no earlier decision cached
    cfg = make_cfg(*SMALL, *layout)
    with recorded_compiles() as compiled:
        prepared = prepare(cfg, tmp_path / "run")
        preflight = prepared.exp.step.compiled
        exp = prepared.exp
        state = start_state(exp, prepared.resume, prepared.handover).state
        state, metrics = exp.step(state, exp.batch(0))
        float(metrics["train/loss"])
    assert compiled.count("jit(step)") == 1, compiled
    assert preflight is not None and exp.step.compiled is preflight
    assert exp.step.compile_time_s > 0


def _step_program(exp) -> str:
    """The step's StableHLO as the persistent compile cache keys it (debug info stripped)."""
    with in_mesh_context(exp.mesh, exp.plan.rules):
        lowered = exp.step.jitted.lower(exp.abstract_state(), exp.abstract_batch())
    return lowered.as_text(debug_info=False)


def test_the_step_program_holds_nothing_of_the_run_dir_or_its_bookkeeping(tmp_path):
    """A relaunch of the same config takes its compiled step from the persistent compile cache
    (runtime.compile_cache=auto; tests/test_runtime.py launches twice into two run dirs): the
    program is the same whatever the run dir, the checkpoint dir and cadence, the logger and
    the log and eval cadence, none of which is baked into it."""
    base = make_cfg(*SMALL, "parallelism=dp1")
    other = make_cfg(*SMALL, "parallelism=dp1", f"checkpoint.dir={tmp_path / 'ckpt'}",
                     "checkpoint.every=7", "train.log_every=3", "train.eval_every=5",
                     "logger=csv", "logger.project=other")
    programs = [_step_program(Experiment.build(c, with_data=False)) for c in (base, other)]
    assert programs[0] == programs[1] and "func.func public @main" in programs[0]


def test_compiling_counts_the_seconds_of_the_compiles_inside_it():
    """What goodput books as compile of the state's init (``goodput.compiling``): a program
    lowered and compiled inside the block, nothing outside it or run from an executable."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
    with goodput.compiling() as seconds:
        f(jnp.arange(7.0)).block_until_ready()
    assert seconds[0] > 0
    with goodput.compiling() as again:
        f(jnp.arange(7.0)).block_until_ready()  # compiled already: nothing to book
    assert again == [0.0]


def test_a_fresh_run_compiles_its_init_beside_the_step(tmp_path):
    """A fresh run's seeded init is lowered before the preflight lowers the step, and compiled
    on a thread of its own while the step compiles (on a TPU each takes seconds); the run then
    starts from that program's draw, the seeded init bit for bit, compiled once."""
    import jax
    import numpy as np

    cfg = make_cfg(*SMALL, "parallelism=dp1")
    with recorded_compiles() as compiled, recorded_compiles("jaxpr_to_mlir_module") as lowered:
        prepared = prepare(cfg, tmp_path / "run")
        assert prepared.exp.seeded.compiling is not None  # under way
        params = start_state(prepared.exp, None, prepared.handover).state.params
    assert lowered.index("jit(init)") < lowered.index("jit(step)"), lowered
    assert compiled.count("jit(init)") == 1 and compiled.count("jit(step)") == 1, compiled
    seeded = Experiment.build(cfg, with_data=False).seeded.params()
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(seeded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_compiling_books_of_an_earlier_compile_only_its_part_inside_the_block():
    """A compile that began on another thread before the block (the init's, beside the step's)
    is booked for the seconds it ran inside the block, the wait for it, not its whole length."""
    import threading
    import time

    import jax.monitoring

    done = threading.Event()

    def compile_elsewhere() -> None:  # a compile of 0.6 s that ends 0.2 s into the block
        time.sleep(0.6)
        jax.monitoring.record_event_duration_secs(goodput.COMPILE_EVENTS[1], 0.6)
        done.set()

    thread = threading.Thread(target=compile_elsewhere)
    thread.start()
    time.sleep(0.4)
    with goodput.compiling() as seconds:
        done.wait()
    thread.join()
    assert 0.15 < seconds[0] < 0.45, seconds
