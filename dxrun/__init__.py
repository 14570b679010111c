"""dxrun: Hydra-configured JAX experiments for transformer language models.

Importing this package does not import JAX: the launcher decides how many devices to simulate
from the composed config first.
"""

__version__ = "0.1.0"
