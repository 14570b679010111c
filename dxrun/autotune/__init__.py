"""What needs a compiled step, above the experiment: the run's decision and the layout search
(``search``: the budget rule, the timed turns and the decision's cache), a compiled step's
footprint and estimate, this host's measured figures and the memory preflight of every real run
(``fit``), and plan mode (``plan_mode``: ``run.mode=plan``, the plan, its estimates and advice
without training). The pure rules they apply live in ``dxrun.plan``."""
