"""What the bench times: fastkda and its peers on the same inputs, each as a ``run()`` made once per input set.

A runner factory takes the inputs of :mod:`fastkda.bench.workloads` and returns ``run``, one call into
preallocated buffers returning ``(output, final state)`` (prefill) or the output (decode). Peers are optional
imports: a peer that is not installed or does not run here is reported and skipped. FLA is held to its own Triton
path (``FLA_FLASH_KDA=0``, set before it is first imported; it would otherwise dispatch to FlashKDA).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

import torch

from .workloads import ACCURACY_CASE, LOWER_BOUND, make_prefill_inputs

os.environ.setdefault("FLA_FLASH_KDA", "0")
PEER_DISTRIBUTIONS = (("fla", "fla-core"), ("flashkda", "tokenspeed-flashkda"))


def fastkda_runner(inp, v_slices="auto", plan=None):
    """``fastkda.kda_prefill`` with the automatic plan, a slice count, or a given :class:`fastkda.PrefillPlan`."""
    from ..api import kda_prefill

    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])

    def run():
        kda_prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                    lower_bound=LOWER_BOUND, scale=inp["scale"], initial_state=inp["initial_state"], final_state=final,
                    cu_seqlens=inp["cu_seqlens"], out=out, v_slices=v_slices, plan=plan,
                    max_seqlen=None if plan is not None else inp.get("max_seqlen"))
        return out, final
    return run


def _fla_call(inp):
    """FLA's ``chunk_kda`` with the workload's gate fused, as one call of the inputs."""
    from fla.ops.kda import chunk_kda

    cu = inp["cu_seqlens"]
    cu_long = cu.long() if cu is not None else None
    cu_cpu = cu_long.cpu() if cu is not None else None
    dt_flat = inp["dt_bias"].reshape(-1)

    def call():
        return chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=inp["scale"],
                         initial_state=inp["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                         lower_bound=LOWER_BOUND, state_v_first=True, cu_seqlens=cu_long, cu_seqlens_cpu=cu_cpu,
                         A_log=inp["A_log"], dt_bias=dt_flat)
    return call


def fla_runner(inp):
    """FLA ``chunk_kda`` (its Triton path)."""
    return _fla_call(inp)


@contextlib.contextmanager
def environment(**values):
    """``os.environ`` with ``values`` set for the duration, as it was afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def fla_cp_runner(inp):
    """FLA ``chunk_kda`` with its intra-card context parallelism (``FLA_INTRACARD_CP=1``, which FLA reads at each
    call and applies only in inference mode to varlen calls): long sequences split across SMs. It cannot be
    captured in a CUDA graph, so it is timed eager only."""
    call = _fla_call(inp)

    def run():
        with torch.inference_mode(), environment(FLA_INTRACARD_CP="1"):
            return call()
    return run


def flashkda_runner(inp):
    """FlashKDA's ``flash_kda.fwd``."""
    import flash_kda

    cu = inp["cu_seqlens"].long() if inp["cu_seqlens"] is not None else None
    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])

    def run():
        flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out, inp["A_log"],
                      inp["dt_bias"], LOWER_BOUND, initial_state=inp["initial_state"], final_state=final, cu_seqlens=cu)
        return out, final
    return run


@dataclass(frozen=True)
class Impl:
    """A prefill implementation the bench can time: its runner factory, the modes it is timed in, the workload
    groups it runs on (empty: all), whether a run without ``--impls`` includes it, and whether it is measured on
    the accuracy case."""

    make: Callable
    modes: tuple = ("eager", "graph")
    groups: tuple = ()
    by_default: bool = True
    accuracy: bool = True

    def runs_on(self, workload) -> bool:
        return not self.groups or workload.get("group") in self.groups


IMPLS = MappingProxyType({
    "fastkda": Impl(lambda inp: fastkda_runner(inp, "auto")),
    "fastkda_s1": Impl(lambda inp: fastkda_runner(inp, 1)),
    "flashkda": Impl(flashkda_runner),
    "fla": Impl(fla_runner),
    # the accuracy case (2048 tokens) is too short for FLA to split, so it would only repeat fla's row
    "fla_cp": Impl(fla_cp_runner, modes=("eager",), groups=("long_sequence",), by_default=False, accuracy=False),
})
DEFAULT_IMPLS = tuple(name for name, impl in IMPLS.items() if impl.by_default)


def fastkda_decode_runner(inp, plan=None):
    """``fastkda.kda_decode`` over the pool, in place (the automatic plan, or a :class:`fastkda.DecodePlan`)."""
    from ..api import kda_decode

    out = torch.empty_like(inp["v"])

    def run():
        return kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["pool"], inp["slots"],
                          A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"],
                          num_accepted_tokens=inp["accepted"], out=out, plan=plan)
    return run


def fla_decode_runner(inp):
    """FLA's fused_recurrent_kda_fwd as vLLM drives it: varlen tokens, pool + ssm_state_indices, in place."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    seqs, tokens, heads, _ = inp["q"].shape
    flat = {x: inp[x].reshape(1, seqs * tokens, *inp[x].shape[2:]) for x in ("q", "k", "v", "g", "beta")}
    cu = torch.arange(0, seqs * tokens + 1, tokens, dtype=torch.long, device=inp["q"].device)

    def run():
        return fused_recurrent_kda_fwd(flat["q"], flat["k"], flat["v"], flat["g"], flat["beta"], A_log=inp["A_log"],
                                       dt_bias=inp["dt_bias"].reshape(-1), initial_state=inp["pool"],
                                       scale=inp["scale"], inplace_final_state=True, state_v_first=True,
                                       cu_seqlens=cu, ssm_state_indices=inp["slots"],
                                       num_accepted_tokens=inp["accepted"], use_qk_l2norm_in_kernel=True,
                                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                       lower_bound=LOWER_BOUND)
    return run


def step_inputs(inp, seed=1):
    """The layer's decode-step inputs around a one-token decode input set: the q | k | v projections before the
    conv ``[N, 3·H·D]``, a conv pool with a row per state slot, a width-4 conv weight, the output gate and the
    norm's weight (spec §9), drawn as the workloads draw theirs. The conv pool is bf16, the activations' dtype, as
    engines keep it (it holds past inputs, which are bf16 already), in :class:`fastkda.cache.KDACache`'s layout."""
    from ..cache import conv_state_pool

    seqs, _, heads, dim = inp["q"].shape
    device = inp["q"].device
    gen = torch.Generator(device).manual_seed(seed)
    channels = 3 * heads * dim

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)
    conv_states = conv_state_pool(inp["pool"].shape[0], channels=channels, kernel=4, dtype=torch.bfloat16,
                                  device=device)
    conv_states.copy_(randn(*conv_states.shape))
    return dict(mixed=randn(seqs, channels), conv_states=conv_states,
                conv_weight=randn(channels, 4), output_gate=randn(seqs, heads, dim),
                norm_weight=1 + 0.1 * randn(dim, dtype=torch.float32))


def fastkda_step_runner(inp, plan=None):
    """``fastkda.kda_decode_step``, the layer's whole decode step (conv update, KDA decode, gated norm: one fused
    launch or three, as its plan decides, or the fused kernel on ``plan``), over the workload's state pool; None
    for several tokens per sequence (the step takes one)."""
    from ..api import kda_decode_step

    if inp["q"].shape[1] != 1:
        return None
    step = step_inputs(inp)
    tickets = torch.zeros(inp["q"].shape[0] * inp["q"].shape[2], dtype=torch.int32, device=inp["q"].device)

    def run():
        return kda_decode_step(step["mixed"], step["conv_states"], step["conv_weight"], inp["g"][:, 0],
                               inp["beta"][:, 0], step["output_gate"], step["norm_weight"], inp["pool"], inp["slots"],
                               A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND,
                               scale=inp["scale"], tickets=tickets, plan=plan)
    return run


def fastkda_three_ops_runner(inp):
    """The same step as :func:`fastkda_step_runner` in three launches (``causal_conv1d_update``, ``kda_decode``,
    ``gated_rmsnorm``), as the layer runs it with ``fused_decode=False``."""
    from ..api import causal_conv1d_update, gated_rmsnorm, kda_decode

    if inp["q"].shape[1] != 1:
        return None
    step = step_inputs(inp)
    seqs, _, heads, dim = inp["q"].shape

    def run():
        conv = causal_conv1d_update(step["mixed"], step["conv_states"], step["conv_weight"], slots=inp["slots"])
        q, k, v = (part.view(seqs, 1, heads, dim) for part in conv.chunk(3, dim=1))
        o = kda_decode(q, k, v, inp["g"], inp["beta"], inp["pool"], inp["slots"], A_log=inp["A_log"],
                       dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"])
        return gated_rmsnorm(o[:, 0], step["output_gate"], step["norm_weight"], 1e-5)
    return run


def floor_decode_runner(inp):
    """The memory floor of fastkda's decode plan for these inputs (:mod:`fastkda.bench.floor`)."""
    from .floor import state_chain_runner

    return state_chain_runner(inp)


# decode implementations by name: "fastkda" is the KDA-only step, "floor" the state's round trip on its plan
DECODE_IMPLS = MappingProxyType({"fastkda": fastkda_decode_runner, "fastkda_step": fastkda_step_runner,
                                 "fastkda_3ops": fastkda_three_ops_runner, "floor": floor_decode_runner,
                                 "fla": fla_decode_runner})


def peer_versions():
    """``{impl: version}`` of the peers installed here."""
    from importlib import metadata

    found = {}
    for impl, dist in PEER_DISTRIBUTIONS:
        try:
            found[impl] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def relative_error(x, ref):
    """Relative L2 error of ``x`` against ``ref`` (float64)."""
    return ((x.double() - ref).norm() / ref.norm()).item()


def accuracy(factory, device):
    """Relative L2 error of (output, final state) of ``factory``'s runner against the float64 recurrence on the
    spec's accuracy case."""
    from ..reference import kda_reference

    inp = make_prefill_inputs(ACCURACY_CASE, device, seed=1)
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                                 dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"],
                                 initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    o, s = factory(inp)()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return relative_error(o, ref_o), relative_error(s, ref_s)
