"""An example of your own parts for dxrun: a model, ``model._target_=custom_block.CustomLM``
(``model.py``), and data, ``data._target_=custom_block.CountingData`` (``data.py``); the
guide's Configuration page, "Your own parts", gives the protocols."""

from custom_block.data import CountingData
from custom_block.model import CustomLM

__all__ = ["CountingData", "CustomLM"]
