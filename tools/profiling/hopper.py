"""Compile fastkda's kernels for the H200 (sm_90a) on any machine, no GPU needed: exactly what a launch under a
given plan compiles.

Every constexpr, ``num_warps`` and ``num_stages`` comes from a :class:`fastkda.PrefillPlan` (or
:class:`fastkda.DecodePlan`) made for a shape, as the launch functions in ``fastkda/ops/`` read them, and every
runtime integer (strides, workspace section offsets, lengths) is the value such a launch passes on contiguous
inputs, specialised as Triton's launcher specialises it (a 1 becomes a constant, a multiple of 16 gets the
divisibility hint, pointers are 16-byte aligned as torch allocates them). Import this module before anything
imports fastkda's kernels: it clears ``TRITON_INTERPRET`` so that ``triton.jit`` makes compilable kernels.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fastkda.bench.workloads import DIM, LOWER_BOUND, is_varlen, load_workloads  # noqa: E402
from fastkda.plan import choose_decode_plan, choose_decode_step_plan, choose_plan, decode_step_chunk  # noqa: E402
from tools.plan_changes import add_set_argument, combined  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # ptxas, nvdisasm
BF16, F32, I32 = "*bf16", "*fp32", "*i32"
PREFILL_KERNELS = ("prepare", "solve", "recurrence", "transition", "scan")  # the last two: sequence parallelism
KERNELS = PREFILL_KERNELS + ("decode", "decode_step")
DEFAULT_WORKLOAD = "H12_N1_T8192"


def compile_for_hopper(fn, args, num_warps, num_stages, maxnreg=None):
    """Compile the Triton kernel ``fn`` for sm_90a. ``args`` gives every parameter by name: a pointer as its type
    (``"*bf16"``), a runtime integer or float as the value a launch passes, a constexpr as its value; ``maxnreg``
    caps the registers per thread as the launch option of that name does."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    names = [p.name for p in fn.params]
    if set(args) != set(names):
        raise ValueError(f"{fn.__name__}: missing {sorted(set(names) - set(args))}, "
                         f"unknown {sorted(set(args) - set(names))}")
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        value = args[param.name]
        if param.is_constexpr:
            kind = "constexpr"
        elif isinstance(value, str):
            kind, attrs[(index,)] = value, [["tt.divisibility", 16]]
        else:
            kind, hint = native_specialize_impl(CUDABackend, value, False, not param.do_not_specialize,
                                                not param.do_not_specialize_on_alignment)
            if kind != "constexpr" and hint and "D" in hint:
                attrs[(index,)] = [["tt.divisibility", 16]]
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = value
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (recurrence_warpgroup.py): its own source kind
        from triton.experimental.gluon._runtime import GluonASTSource as source_kind
    else:
        source_kind = ASTSource
    source = source_kind(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def prefill_launches(plan, checkpoints=0, l2norm=True, beta_sigmoid=True):
    """``{kernel: (fn, args, num_warps, num_stages, maxnreg)}`` of the prefill kernels as ``chunk_kda_forward``
    launches them under ``plan`` (the Gluon recurrence and transitions for its ``warpgroup_recurrence`` and
    ``warpgroup_transition``) on contiguous inputs (bf16 q, k, v, β and, under the lower-bound gate, g; an fp32
    log-decay g otherwise; fp32 states; int32 ``cu_seqlens``), with ``checkpoints`` (0, 1 or 2) per sequence."""
    from fastkda.ops.prefill import prepare, recurrence, scan, solve
    from fastkda.ops.prefill.layout import plan_layout

    H, K, V, gate = plan.heads, plan.key_dim, plan.value_dim, plan.lower_bound_gate
    at = plan_layout(plan)
    cu = I32 if plan.varlen else F32  # an absent tensor is the fp32 workspace
    shared = dict(ws_bf16=BF16, ws_fp32=F32, seq_len=plan.seq_len, C=plan.chunk, IS_VARLEN=plan.varlen, EMULATE=False)
    precision = dict(DOT_PRECISION=plan.dot_precision)  # the kernels with fp32 products
    beta = dict(beta=BF16, stride_beta_tok=H, stride_beta_head=1, BETA_SIGMOID=beta_sigmoid)
    inverse = dict(  # what the solve kernel, or the first kernel under inverse_in_prepare, takes for the inverse
        cu_seqlens=I32 if plan.varlen or plan.equal_rows else F32, errors=I32 if plan.equal_rows else F32,
        order_at=at.order, order_count=plan.program_rows, segment_chunks=plan.segment_chunks,
        LONGEST_FIRST=plan.longest_first, SEGMENTED=plan.sequence_parallel, EQUAL_ROWS=plan.equal_rows,
        HORNER=plan.horner_inverse, EARLY_CHUNKS_LAST=plan.early_chunks_last)
    # the first kernel takes the inverse's own arguments only where it inverts, else launch_prepare's stand-ins
    unread = dict(cu_seqlens=cu, errors=F32, order_at=0, order_count=0, segment_chunks=0,
                  **prepare.UNREAD_INVERSE_CONSTANTS, EARLY_CHUNKS_LAST=plan.early_chunks_last)
    prepare_args = dict(
        shared, **beta, **precision, **(inverse if plan.inverse_in_prepare else unread), q=BF16, k=BF16,
        g=BF16 if gate else F32, A_log=F32, dt_bias=F32,
        qg_at=at.qg, kg_at=at.kg, A_at=at.A, scratch_at=at.scratch, stride_q=H * K, stride_k=H * K, stride_g=H * K,
        num_seqs=plan.num_seqs, lower_bound=LOWER_BOUND if gate else 0.0, scale=K ** -0.5, H=H, K=K, BC=plan.block,
        BK=plan.prepare_channels, LOWER_BOUND_GATE=gate, L2NORM=l2norm, RUN=plan.prepare_token_run,
        INVERT=plan.inverse_in_prepare)
    solve_args = dict(
        {name: value for name, value in shared.items() if name != "ws_bf16"}, **beta, **precision, **inverse,
        scratch_at=at.scratch, num_seqs=plan.num_seqs, H=H, BC=plan.block)
    recurrence_args = dict(
        shared, qg_at=at.qg, kg_at=at.kg, A_at=at.A, scratch_at=at.scratch, entries_at=at.entries, order_at=at.order,
        out=BF16, initial_state=F32, final_state=F32, cu_seqlens=cu, errors=I32,
        ckpt_offsets=I32 if checkpoints else F32, ckpt_states=F32, stride_out=H * V, num_seqs=plan.num_seqs,
        stride_ckpt_n=checkpoints if checkpoints > 1 else int(checkpoints == 1),
        stride_ckpt_j=int(checkpoints > 0), v=BF16, stride_v=H * V, H=H, K=K, V=V, BV=plan.slice_width,
        HAS_INITIAL=True, HAS_FINAL=True, NUM_CKPT=checkpoints, STATE_ROWS_V=plan.state_rows_v,
        segment_chunks=plan.segment_chunks, SEGMENTED=plan.sequence_parallel, LONGEST_FIRST=plan.longest_first)
    found = dict(prepare=(prepare.prepare_kernel, prepare_args, plan.prepare_warps, plan.prepare_stages,
                          plan.prepare_registers or None),
                 solve=(solve.solve_kernel, solve_args, plan.solve_warps, plan.solve_stages,
                        plan.solve_registers or None),
                 recurrence=(recurrence.recurrence_kernel, recurrence_args, plan.recurrence_warps,
                             plan.recurrence_stages, None))
    triton_only = ("STATE_ROWS_V", "EMULATE")  # the Gluon kernels take STAGES in place of these constexprs
    if plan.warpgroup_recurrence:
        from fastkda.ops.prefill import recurrence_warpgroup

        found["recurrence"] = (recurrence_warpgroup.warpgroup_recurrence_kernel,
                               dict({k: v for k, v in recurrence_args.items() if k not in triton_only},
                                    STAGES=plan.recurrence_stages),
                               plan.recurrence_warps, plan.recurrence_stages, None)
    if plan.sequence_parallel:
        transition_args = dict(
            shared, kg_at=at.kg, scratch_at=at.scratch, transitions_at=at.transitions, order_at=at.order,
            initial_state=F32, cu_seqlens=cu, num_seqs=plan.num_seqs, v=BF16, stride_v=H * V, H=H, K=K, V=V,
            BV=plan.transition_width, HAS_INITIAL=True, STATE_ROWS_V=plan.transition_rows_v,
            segment_chunks=plan.segment_chunks, OPEN_ENTRY=False, LONGEST_FIRST=plan.transitions_in_order)
        scan_args = dict(ws_fp32=F32, transitions_at=at.transitions, entries_at=at.entries, order_at=at.order,
                         initial_state=F32, exit_maps=F32, final_state=F32, cu_seqlens=cu, errors=I32,
                         seq_len=plan.seq_len, num_seqs=plan.num_seqs, segment_chunks=plan.segment_chunks,
                         order_count=plan.program_rows,
                         run_rows=plan.transition_rows, rerun_rows=plan.rerun_rows, H=H, K=K, V=V,
                         SW=plan.scan_width, C=plan.chunk, IS_VARLEN=plan.varlen, HAS_INITIAL=True,
                         DOT_PRECISION=plan.dot_precision, OPEN_ENTRY=False, COMPOSE=False,
                         ORDERED=plan.transitions_in_order, FINAL_FALLBACK=plan.rerun_in_order,
                         IN_ORDER=plan.scan_in_order)
        transition = (recurrence.transition_kernel, transition_args, plan.transition_warps, plan.transition_stages,
                      None)
        if plan.warpgroup_transition:
            from fastkda.ops.prefill import recurrence_warpgroup

            transition = (recurrence_warpgroup.warpgroup_transition_kernel,
                          dict({k: v for k, v in transition_args.items() if k not in triton_only},
                               STAGES=plan.transition_stages),
                          plan.transition_warps, plan.transition_stages, None)
        found.update(transition=transition,
                     scan=(scan.segment_scan_kernel, scan_args, plan.scan_warps, plan.scan_stages, None))
    if plan.inverse_in_prepare:  # the first kernel does the solve's work: no solve launch
        del found["solve"]
    return found


def decode_launch(plan, tokens=1, key_dim=DIM, per_token_slots=False, accepted=False, pool=F32):
    """``(fn, args, num_warps, num_stages, maxnreg)`` of the decode kernel as ``recurrent_kda_decode`` launches it under
    ``plan`` (a :class:`fastkda.DecodePlan`) for ``tokens`` tokens per sequence on contiguous inputs, a ``pool``
    of that pointer type with a slot per token and a spare (as the bench's), slots ``[N]`` or ``[N, T]``;
    ``num_stages`` is Triton's default, as the launch sets none."""
    from fastkda.ops.decode import decode_kernel

    H, K, V = plan.heads, key_dim, plan.value_dim
    args = dict(
        q=BF16, k=BF16, v=BF16, g=BF16, beta=BF16, A_log=F32, dt_bias=F32, pool=pool, slots=I32, num_accepted=I32,
        out=BF16, errors=I32, pool_slots=plan.num_seqs * tokens + 1, stride_q=H * K, stride_k=H * K, stride_v=H * V,
        stride_g=H * K, stride_beta_n=tokens * H, stride_beta_t=H, stride_beta_h=1,
        stride_slot_n=tokens if per_token_slots else 1, stride_slot_t=1 if per_token_slots else 0,
        lower_bound=LOWER_BOUND, scale=K ** -0.5, T=tokens, H=H, K=K, V=V, BV=plan.slice_width, LOWER_BOUND_GATE=True,
        L2NORM=True, BETA_SIGMOID=True, PER_TOKEN_SLOTS=per_token_slots,
        T_SLOTS=triton.next_power_of_2(tokens) if per_token_slots else 1, HAS_ACCEPTED=accepted, EMULATE=False)
    return decode_kernel, args, plan.warps, 3, None


def decode_step_launch(plan, key_dim=DIM, width=4, pool=F32):
    """``(fn, args, num_warps, num_stages, maxnreg)`` of the fused decode step as ``fused_decode_step`` launches it
    under ``plan`` (:func:`fastkda.plan.choose_decode_step_plan`'s) on contiguous inputs: the conv's input rows
    ``[N, 2·H·K + H·V]``, a bf16 conv pool ``[slots, channels, width − 1]`` held channel-last (the bench's, as
    ``fastkda.cache.conv_state_pool`` holds it) and a state ``pool`` of that pointer type, one slot per sequence and
    a spare."""
    from fastkda.ops.decode_step import decode_step_kernel, head_step_kernel

    H, K, V = plan.heads, key_dim, plan.value_dim
    channels = 2 * H * K + H * V
    args = dict(
        mixed=BF16, conv_pool=BF16, conv_weight=BF16, g=BF16, beta=BF16, out_gate=BF16, norm_weight=F32,
        A_log=F32, dt_bias=F32, pool=pool, slots=I32, partial=F32, out=BF16, errors=I32,
        stride_mixed=channels, stride_cp=channels * (width - 1), stride_cc=1, stride_cj=channels,
        stride_wc=width, stride_wj=1, stride_g=H * K, stride_beta=H, stride_beta_h=1, stride_gate=H * V,
        stride_slot=1, lower_bound=LOWER_BOUND, scale=K ** -0.5, eps=1e-5, pool_slots=plan.num_seqs + 1,
        H=H, K=K, V=V, W=width, LOWER_BOUND_GATE=True, L2NORM=True, BETA_SIGMOID=True, EMULATE=False)
    if plan.v_slices == 1:  # one program a head (fused_decode_step's dispatch)
        return head_step_kernel, dict(args, BC=decode_step_chunk(V)), plan.warps, 3, None
    return decode_step_kernel, dict(args, sums=F32, tickets=I32, BV=plan.slice_width, SLICES=plan.v_slices), \
        plan.warps, 3, None


def add_plan_arguments(parser):
    """The shape a plan is made for (a workload of the shipped file, or heads, sequences and tokens) and the
    changes to it (``--set``, ``--decode-set``)."""
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD,
                        help=f"a prefill workload of the shipped workloads file (default {DEFAULT_WORKLOAD}), or "
                             "a one-token fp32-pool decode workload; --heads and --seqs replace it")
    parser.add_argument("--heads", type=int, help="heads (with --seqs and --tokens instead of --workload)")
    parser.add_argument("--seqs", type=int, default=1, help="sequences")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--fixed", action="store_true", help="equal-length rows instead of one varlen row")
    parser.add_argument("--dim", type=int, default=DIM, choices=(64, 128), help="K = V")
    parser.add_argument("--precomputed-gate", action="store_true", help="g is the log-decay itself")
    parser.add_argument("--sms", type=int, default=132, help="SMs of the GPU planned for (the H200's by default)")
    parser.add_argument("--checkpoints", type=int, default=0, choices=(0, 1, 2), help="checkpoints per sequence")
    add_set_argument(parser)
    from fastkda.plan import DecodePlan

    add_set_argument(parser, DecodePlan, dest="decode_set", flag="--decode-set", what="launch numbers of decode's plan")


def workload_shape(name):
    """``(heads, lengths, varlen)`` of a workload of the shipped file: a prefill workload's own, or a decode
    workload's sequences of one token each (the decode launch compiled here is the one-token step on an fp32
    pool, :func:`decode_launch`, so a speculative or bf16-pool workload is refused rather than compiled as
    another kernel)."""
    workloads = load_workloads()
    found = {w["name"]: w for w in workloads["prefill"]}
    if name in found:
        return found[name]["H"], found[name]["lengths"], is_varlen(found[name])
    decode = {w["name"]: w for w in workloads["decode"]}
    if name not in decode:
        raise SystemExit(f"no prefill or decode workload {name!r} in fastkda's workloads file")
    w = decode[name]
    if w["tokens_per_seq"] != 1 or w.get("state_dtype", "fp32") != "fp32":
        raise SystemExit(f"decode workload {name!r} is not a one-token step on an fp32 pool, the decode launch "
                         "compiled here; give --heads and --seqs for its plan instead")
    return w["H"], [1] * w["N"], False


def plans_from_arguments(args):
    """(prefill plan, decode plan) for the parsed :func:`add_plan_arguments`: the automatic plans an sm_90 GPU
    makes (its warpgroup MMA, so the Gluon kernels where the plan takes them), with the longest length as the
    ``max_seqlen`` hint of a varlen shape, as the bench's inputs carry it."""
    if args.heads is not None:
        heads, lengths, varlen = args.heads, [args.tokens] * args.seqs, not args.fixed
    else:
        heads, lengths, varlen = workload_shape(args.workload)
    seq_len = sum(lengths) if varlen else lengths[0]
    plan = choose_plan(len(lengths), heads, seq_len, args.dim, args.dim, args.sms, varlen=varlen,
                       lower_bound_gate=not args.precomputed_gate, max_seqlen=max(lengths) if varlen else None,
                       warpgroup_mma=True)  # compiled for sm_90a
    decode = choose_decode_plan(len(lengths), heads, args.dim, args.sms)
    changes, decode_changes = combined(args.set), combined(args.decode_set)
    return (plan.replace(**changes) if changes else plan,
            decode.replace(**decode_changes) if decode_changes else decode)


def launches(plan, decode_plan, kernels=KERNELS, checkpoints=0):
    """``{kernel: (fn, args, num_warps, num_stages, maxnreg)}`` of the named kernels under the two plans."""
    found = prefill_launches(plan, checkpoints) if set(kernels) & set(PREFILL_KERNELS) else {}
    if "decode" in kernels:
        found["decode"] = decode_launch(decode_plan, key_dim=plan.key_dim)
    if "decode_step" in kernels:  # the fused step's own plan for decode's shape (none past four heads an SM)
        step = choose_decode_step_plan(decode_plan.num_seqs, decode_plan.heads, decode_plan.value_dim, plan.sms)
        if step is not None:
            found["decode_step"] = decode_step_launch(step, key_dim=plan.key_dim)
    return {name: found[name] for name in kernels if name in found}  # the SP kernels only under an SP plan


def ptxas_report(kernel):
    """What ptxas says of a compiled kernel (``ptxas -v`` on its PTX for sm_90a)."""
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        return subprocess.run([str(BIN / "ptxas"), "--gpu-name", "sm_90a", "-v", str(ptx), "-o",
                               str(Path(folder) / "kernel.cubin")], capture_output=True, text=True).stderr


def compile_stats(fn, args, num_warps, num_stages, maxnreg=None):
    """Registers, spills, shared memory, barriers and wgmma instructions of ``fn`` compiled for sm_90a."""
    kernel = compile_for_hopper(fn, args, num_warps, num_stages, maxnreg)
    ptx, report = kernel.asm["ptx"], ptxas_report(kernel)
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return dict(regs=int(regs.group(1)) if regs else None, spill_st=int(spills.group(1)) if spills else 0,
                spill_ld=int(spills.group(2)) if spills else 0, shared=kernel.metadata.shared,
                barriers=len(re.findall(r"bar\.sync|barrier\.sync", ptx)), wgmma=ptx.count("wgmma.mma_async"))


def sass(fn, args, num_warps, num_stages, maxnreg=None, line_info=False):
    """The SASS of ``fn`` compiled for sm_90a (``nvdisasm``; with ``line_info``, each instruction's source line)."""
    kernel = compile_for_hopper(fn, args, num_warps, num_stages, maxnreg)
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(BIN / "nvdisasm"), "-c", *(["-g"] if line_info else []), str(cubin)],
                              capture_output=True, text=True).stdout
