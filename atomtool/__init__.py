"""atomtool: inspect, convert and serve large language model checkpoints (MLA + DSA + MoE, dense)."""

__version__ = "0.1.0"
