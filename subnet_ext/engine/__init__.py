"""The engine: `SubnetDataParallel`, the model surgery of each regime, and its reports."""
from .data_parallel import SubnetDataParallel

__all__ = ["SubnetDataParallel"]
