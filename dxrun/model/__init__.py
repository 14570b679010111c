"""The model family: what the train step computes. The transformer (``transformer``) and its
blocks (``layers``), attention (``attention``) and its kernels (``splash_attention``, and the
context axis's blockwise one in ``context_parallel``), the loss in chunks (``chunked_loss``),
masked diffusion's objective (``mdlm``), your own model (``user_model``), the logical-axis
rules and constraints that place it on the mesh (``sharding``, ZeRO-1's padding in
``zero_padding``) and the metric reductions for your code (``reductions``).

Imports nothing of dxrun outside itself, the config (``dxrun.config``) and the plan
(``dxrun.plan``).
"""
