"""A run assembled from a validated config: plan -> mesh -> sharded model -> optimizer -> step;
what the rest may use. ``Experiment`` is what the launcher trains and what tests drive directly
(same code path).

- ``optimizer.py``: the optimizer and its learning-rate schedule (optax, or your own factory
  through ``optimizer._target_``).
- ``step.py``: the jitted train and eval steps (one ``jax.jit`` with explicit shardings and the
  state donated; XLA reduces the gradients, no pmap, no hand-written all-reduce).
- ``assembly.py``: the ``Experiment``: the mesh, the data, the seeded init, the state's layout.
- ``hf_weights.py``: a Hugging Face checkpoint read into the run's sharded parameters.
"""

from dxrun.experiment.assembly import Experiment, adopt, process_data, visible_devices
from dxrun.experiment.hf_weights import check_hf_weights
from dxrun.experiment.optimizer import custom_optimizer, decay_mask, make_optimizer, make_schedule
from dxrun.experiment.step import (
    TrainState,
    analysis_is_full,
    analysis_options,
    jax_dtype,
    loss_and_metrics,
    step_bytes,
)

__all__ = ["Experiment", "TrainState", "adopt", "analysis_is_full", "analysis_options",
           "check_hf_weights", "custom_optimizer", "decay_mask", "jax_dtype",
           "loss_and_metrics", "make_optimizer", "make_schedule", "process_data", "step_bytes",
           "visible_devices"]
