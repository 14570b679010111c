"""The model family: what the train step computes. The transformer, its blocks and attention
(``transformer``) and attention's kernels beside it (``splash_attention``, and the context
axis's blockwise one in ``context_parallel``), the objectives and their losses (``objectives``:
the next token's, in chunks, and masked diffusion's), your own model (``user_model``), the
logical-axis rules and constraints that place it on the mesh, ZeRO-1's padding with them
(``sharding``), and the metric reductions for your code (``reductions``).

Imports nothing of dxrun outside itself, the config (``dxrun.config``) and the plan
(``dxrun.plan``).
"""
