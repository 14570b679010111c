"""The pure plan, below the experiment: values in, values out, no JAX and nothing compiled.
``run_plan``: every decision a run takes (the mesh and its axes over devices and hosts, the
batch and the loss's chunk, the attention kernel, the layout search's candidates and record)
and the ``RunPlan`` that carries them; ``cost``: what a plan costs on an accelerator (the
targets, FLOPs, the memory and time models, plan mode's advice)."""
