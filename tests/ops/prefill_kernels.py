"""The prefill's kernels run on their own, as the plan for an input says, into NaN-poisoned buffers, and the
float64 truth to hold them to: shared by the interpreter tests of the Triton kernels (``test_prefill.py``) and
of the Gluon ones (``test_prefill_warpgroup.py``)."""

import torch

from fastkda.reference import kda_reference
from helpers import plan_for


def run_triton(inp, v_slices=1, final_dtype=torch.float32, use_final=True, sequence_parallel=False, errors=None,
               max_seqlen=None, **plan_changes):
    """The kernels as the plan for ``inp`` at ``v_slices``, ``sequence_parallel`` and ``max_seqlen`` says, with
    ``plan_changes``, into NaN-poisoned buffers (malformed ``cu_seqlens`` counted in ``errors``, if given)."""
    from fastkda.ops.prefill import chunk_kda_forward

    plan = plan_for(inp, v_slices, sequence_parallel=sequence_parallel, max_seqlen=max_seqlen, **plan_changes)
    key_dim = inp["q"].shape[3]
    out = torch.full_like(inp["v"], float("nan"))
    final = (torch.full((plan.num_seqs, plan.heads, plan.value_dim, key_dim), float("nan"), dtype=final_dtype)
             if use_final else None)
    chunk_kda_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], plan=plan, A_log=inp["A_log"],
                      dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], scale=key_dim ** -0.5,
                      initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], use_qk_l2norm=True,
                      use_beta_sigmoid=True, out=out, final_state=final, errors=errors)
    return out, final


def nan_workspaces(monkeypatch):
    """Every prefill workspace allocated from now on starts NaN-poisoned, so that a read of a section no kernel
    wrote shows in the outputs."""
    from fastkda.ops.prefill import layout

    allocate = layout.Workspace.allocate

    def poisoned(plan, v, cu_seqlens):
        ws = allocate(plan, v, cu_seqlens)
        ws.bf16.fill_(float("nan"))
        ws.fp32.fill_(float("nan"))
        return ws

    monkeypatch.setattr(layout.Workspace, "allocate", staticmethod(poisoned))


def reference(inp):
    return kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                         dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                         initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])


def run_open_entry(inp, entry, v_slices=1, segment_tokens=64, **plan_changes):
    """The open-entry kernels (:func:`fastkda.ops.prefill.open_entry_transitions`, then ``open_entry_finish`` from
    ``entry``) for ``inp``'s fixed-length rows, into NaN-poisoned buffers: ``(exit_map, out, final)``."""
    from fastkda.ops.prefill import open_entry_finish, open_entry_transitions
    from fastkda.plan import choose_open_entry_plan

    q, v = inp["q"], inp["v"]
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[3]
    plan = choose_open_entry_plan(batch, heads, length, key_dim, value_dim, 132,
                                  lower_bound_gate=inp["lower_bound"] is not None, sequence_parallel=segment_tokens)
    plan = plan.replace(v_slices=v_slices, state_rows_v=value_dim // v_slices >= 64, **plan_changes)
    exit_map = torch.full((batch, heads, value_dim + key_dim, key_dim), float("nan"))
    ws = open_entry_transitions(q, inp["k"], v, inp["g"], inp["beta"], plan=plan, A_log=inp["A_log"],
                                dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], scale=key_dim ** -0.5,
                                use_qk_l2norm=True, use_beta_sigmoid=True, exit_maps=exit_map)
    out = torch.full_like(v, float("nan"))
    final = torch.full((batch, heads, value_dim, key_dim), float("nan"))
    open_entry_finish(plan, ws, entry, out, final)
    return exit_map, out, final
