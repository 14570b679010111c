"""After training: a run's checkpoint loaded on any mesh (``load``), scored on held-out data
(``evaluate``) or continued from a prompt (``sample``, with the KV-cache decoder ``decode``).
The commands keep their names: ``python -m dxrun.evaluate``, ``python -m dxrun.sample``."""
