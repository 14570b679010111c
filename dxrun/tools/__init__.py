"""After training, what the commands share: a run's checkpoint (or a Hugging Face directory)
loaded on any mesh and the tools' command line (``checkpoint``; a live run's newest checkpoint
read by ``live``), and the decoders a prompt is continued with (``decode``: the KV cache, and
masked diffusion's reverse process). The commands themselves are ``dxrun.evaluate``,
``dxrun.sample``, ``dxrun.export`` and ``dxrun.logits``."""
