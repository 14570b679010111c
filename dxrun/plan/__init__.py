"""The pure plan, below the experiment: values in, values out, no JAX and nothing compiled.
The mesh plan (``mesh``, with ``hosts`` and ``axes``: the sizes and the layout), batch
arithmetic and the loss's chunk (``batch``), the run plan every run carries (``run_plan``),
the targets a plan is made for (``targets``) and the attention kernel chosen for them
(``attention_kernel``), the memory and speed models (``memory_model``, ``gpu_cost``,
``flops``, ``estimate``), the layout search's candidates and ranking rules (``layouts``) and
its record (``search_record``)."""
