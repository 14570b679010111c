"""Hugging Face checkpoints in and out: ``model.init_from=hf:<dir>`` and ``python -m dxrun.export``.

``config_json.py`` reads a HF directory's ``config.json`` into the model section (no JAX);
``mapping.py`` is the one table of which HF tensor becomes which dxrun weight, and how (the guide's
table is generated from it), and reads the safetensors files lazily and checks them;
``load.py`` reads the weights tensor by tensor into their shards on a run's mesh; ``save.py``
writes a run's parameters as a HF directory (``dxrun.export`` is its command).
"""
