"""What needs a compiled step, above the experiment (``fit``): a run fitted to its devices (the
run's decision and the layout search with its budget rule, timed turns and cache; a compiled
step's footprint and estimate, this host's measured figures and the memory preflight of every
real run), and plan mode (``run.mode=plan``: the plan, its estimates and advice without
training). The pure rules they apply live in ``dxrun.plan``."""
