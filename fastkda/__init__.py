"""fastkda: Kimi Delta Attention inference kernels in Triton, with a PyTorch CPU path and reference."""

from .api import kda_prefill
from .plan import Plan, choose_plan
from .reference import kda_chunked, kda_reference

__all__ = ["kda_prefill", "kda_reference", "kda_chunked", "Plan", "choose_plan"]
__version__ = "0.1.0"
