"""fastkda: Kimi Delta Attention inference kernels in Triton, with a PyTorch CPU path and reference."""

from .api import (OpenEntryPrefill, causal_conv1d, causal_conv1d_update, gated_rmsnorm, kda_decode, kda_decode_step,
                  kda_prefill, kda_prefill_open)
from .errors import error_counts, reset_error_counts
from .plan import DecodePlan, PrefillPlan, choose_decode_plan, choose_open_entry_plan, choose_plan
from .reference import (causal_conv1d_reference, gated_rmsnorm_reference, kda_chunked, kda_decode_reference,
                        kda_reference)

__all__ = ["kda_prefill", "kda_prefill_open", "OpenEntryPrefill", "choose_open_entry_plan", "kda_decode",
           "kda_decode_step", "kda_reference", "kda_chunked", "kda_decode_reference", "PrefillPlan", "DecodePlan",
           "choose_plan", "choose_decode_plan", "error_counts", "reset_error_counts", "causal_conv1d",
           "causal_conv1d_update", "gated_rmsnorm", "causal_conv1d_reference", "gated_rmsnorm_reference"]
__version__ = "0.1.0"
