"""Chunked KDA prefill on the GPU, one module per stage.

Spec §2 in the WY form, over chunks of ``C`` tokens (the plan's ``chunk``, two 16-token blocks):

1. ``prepare.py``: everything of a chunk that does not depend on the state but the inverse (gate, cumulative
   decays, normalised q and k, the in-chunk matrices M and β·L), token-parallel over (chunk, head);
2. ``solve.py``: the in-chunk inverse ``T = (I + β·L)⁻¹``, stored as T·diag(β), token-parallel (its own kernel,
   or the first kernel's tail under the plan's ``inverse_in_prepare``);
3. ``recurrence.py``: the serial recurrence over chunks, one program per (sequence, head, V-slice); each step forms
   ``v_new = T·β·(v − kd·S)`` (w and u are never formed).

Under sequence parallelism (the plan's ``segment_chunks``) the third stage is three launches: the segments'
transitions (``recurrence.py`` over V + K columns from zero and identity states), the scan over each sequence's
segments (``scan.py``), and the recurrence over every segment from its entry state.

A prefill whose entry state is not known when it starts (context parallelism: the tokens before it run on
another GPU) splits in two: :func:`open_entry_transitions` runs the preparation, every segment's transition and a
scan that composes them into the sequence's map; :func:`open_entry_finish`, once the entry state is known, the scan
from it and the rerun.

``layout.py`` defines where chunks and the workspace between the stages live. Every launch number comes from the
:class:`fastkda.plan.PrefillPlan` the caller passes; nothing here decides one.
"""

from ...errors import counters
from ..common import interpreting
from .layout import Workspace
from .prepare import launch_prepare
from .recurrence import launch_recurrence, launch_transitions
from .scan import launch_scan
from .solve import launch_solve


def prepare_stages(plan, ws, q, k, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid,
                   errors, emulate):
    """The first two stages (the preparation and the inverse) into the workspace ``ws``, where there are chunks: in
    one launch under the plan's ``inverse_in_prepare``."""
    if plan.chunk_slots:
        launch_prepare(plan, ws, q, k, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid,
                       errors, emulate)
        if not plan.inverse_in_prepare:
            launch_solve(plan, ws, beta, use_beta_sigmoid, errors, emulate)


def _prepared(plan, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid,
              cu_seqlens, errors):
    """A new workspace with :func:`prepare_stages` run into it; returns it, the error counters (``errors``, or the
    device's :func:`fastkda.errors.counters` where there are sequences) and whether the kernels run under the
    interpreter."""
    ws = Workspace.allocate(plan, v, cu_seqlens)
    emulate = interpreting()
    if errors is None and plan.num_seqs:
        errors = counters(q.device)
    prepare_stages(plan, ws, q, k, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid,
                   errors, emulate)
    return ws, errors, emulate


def chunk_kda_forward(q, k, v, g, beta, *, plan, A_log, dt_bias, lower_bound, scale, initial_state, cu_seqlens,
                      use_qk_l2norm, use_beta_sigmoid, out, final_state, checkpoint_offsets=None,
                      checkpoint_states=None, errors=None):
    """The three stages on validated inputs (``q, k, g [B, T, H, K]``, ``v [B, T, H, V]`` with ``[H, D]``
    contiguous per token, ``beta [B, T, H]`` any strides) as ``plan`` says; writes ``out``, ``final_state`` and
    the checkpoints in place and counts malformed ``cu_seqlens`` (and, under the plan's ``equal_rows``, ones that
    disagree with its rows) in ``errors`` (default: the device's
    :func:`fastkda.errors.counters`)."""
    ws, errors, emulate = _prepared(plan, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm,
                                    use_beta_sigmoid, cu_seqlens, errors)
    if plan.num_seqs:
        if plan.sequence_parallel:
            launch_transitions(plan, ws, initial_state, emulate)
            launch_scan(plan, ws, initial_state, errors, final_state)
        launch_recurrence(plan, ws, out, initial_state, final_state, checkpoint_offsets, checkpoint_states, errors,
                          emulate)


def open_entry_transitions(q, k, v, g, beta, *, plan, A_log, dt_bias, lower_bound, scale, use_qk_l2norm,
                           use_beta_sigmoid, exit_maps, errors=None):
    """The first half of a prefill whose entry state comes later, on validated inputs (as
    :func:`chunk_kda_forward` takes them, fixed-length rows) and a segmented ``plan``: writes each sequence's map
    ``exit_maps [N, H, V + K, K]`` (fp32, contiguous; rows ``[ℬᵀ; 𝒜ᵀ]``: the exit from an entry ``X [V, K]`` is
    ``X·𝒜ᵀ + ℬᵀ``) and returns the workspace :func:`open_entry_finish` takes."""
    ws, errors, emulate = _prepared(plan, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm,
                                    use_beta_sigmoid, None, errors)
    if plan.num_seqs:
        launch_transitions(plan, ws, None, emulate, open_entry=True)
        launch_scan(plan, ws, None, errors, exit_maps=exit_maps)
    return ws


def open_entry_finish(plan, ws, entry_state, out, final_state, errors=None):
    """The second half (:func:`open_entry_transitions`): from ``entry_state [N, H, V, K]`` (None: zeros), every
    segment's entry, then the rerun; writes ``out`` and ``final_state`` in place. It may run again with another
    entry state."""
    if plan.num_seqs:
        errors = counters(ws.v.device) if errors is None else errors
        launch_scan(plan, ws, entry_state, errors, open_entry=True)
        launch_recurrence(plan, ws, out, entry_state, final_state, None, None, errors, interpreting())
