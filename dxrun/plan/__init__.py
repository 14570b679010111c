"""The pure plan, below the experiment: values in, values out, no JAX and nothing compiled.
The mesh plan (``mesh``, with ``hosts``, ``vocab``, ``layout``), batch arithmetic (``batch``,
``loss_chunk``), the run plan every run carries (``run_plan``), the targets a plan is made
for (``targets``), the memory and speed models (``memory_model``, ``gpu_cost``, ``flops``,
``estimate``) and the layout search's candidates and ranking rules (``layouts``,
``ranking``)."""
