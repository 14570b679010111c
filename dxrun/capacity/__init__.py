"""What a run needs and how fast it can go, from shapes alone: plan mode (``plan_mode``: the
mesh plan extended with the compiled step's memory, FLOPs, collectives and time estimate),
its parts (``flops``: FLOPs, peaks, MFU; ``hlo``: collectives in the compiled HLO;
``memory_model``: an accelerator's memory; ``gpu_cost``: an accelerator's step time), the memory
preflight of every real run (``preflight``, with ``memory_report``: where the memory goes) and
``parallelism=auto``'s search over layouts (``layout_search``)."""
