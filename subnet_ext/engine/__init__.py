"""The engine: `SubnetDataParallel` and its `SDPConfig`, the model surgery of each regime, and its reports."""
from .config import SDPConfig
from .data_parallel import SubnetDataParallel

__all__ = ["SDPConfig", "SubnetDataParallel"]
