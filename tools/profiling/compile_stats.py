"""Compile the prefill kernels for sm_90a on any machine (no GPU needed) and report what ptxas says:
registers, spills, shared memory, barrier and wgmma counts. Costs no device time.

python scripts/compile_stats.py [--warps N]"""

import argparse
import os
import re
import subprocess
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fastkda import plan  # noqa: E402
from fastkda.ops import decode, prefill  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # ptxas, nvdisasm
PTXAS = BIN / "ptxas"
BF16, F32 = "*bf16", "*fp32"
# the arguments of both preparation kernels (compile_for_hopper drops those a kernel does not take)
PREPARATION_SIGNATURE = dict(q=BF16, k=BF16, v=BF16, g=BF16, beta=BF16, A_log=F32, dt_bias=F32, cu_seqlens="*i32",
                             ws_bf16=BF16, ws_fp32=F32, stride_q="i32", stride_k="i32", stride_v="i32", stride_g="i32",
                             stride_beta_tok="i32", stride_beta_head="i32", seq_len="i32", num_seqs="i32",
                             rows="i32", total_slots="i32", lower_bound="fp32", scale="fp32")


def compile_for_hopper(fn, signature, constants, num_warps, num_stages=3):
    """Compile a Triton kernel for sm_90a on this machine (no GPU); ``signature`` and ``constants`` may name
    more arguments than ``fn`` takes (those are dropped); a constant for a runtime argument becomes an i32.
    ``num_stages`` defaults to Triton's own default, what a launch that does not set it gets."""
    runtime = {p.name for p in fn.params if not p.is_constexpr}  # e.g. the prefill kernels' H: an i32 argument
    signature = {k: v for k, v in signature.items() if k in fn.arg_names}
    signature.update({k: "i32" for k in constants if k in runtime})
    constants = {k: v for k, v in constants.items() if k in fn.arg_names and k not in runtime}
    signature.update({k: "constexpr" for k in constants})
    # what a launch on real tensors specialises on: 16-byte aligned pointers, strides divisible by 16 (without
    # these hints every bf16 access compiles to a 2-byte load or store)
    aligned = [k for k, v in signature.items() if v.startswith("*") or k.startswith("stride")]
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()},
                    attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_stats(fn, signature, constants, num_warps, num_stages=3):
    kernel = compile_for_hopper(fn, signature, constants, num_warps, num_stages)
    ptx = kernel.asm["ptx"]
    path = Path("/tmp/fastkda_stats.ptx")
    path.write_text(ptx)
    report = subprocess.run([str(PTXAS), "--gpu-name", "sm_90a", "-v", str(path), "-o", "/tmp/fastkda_stats.cubin"],
                            capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return dict(regs=int(regs.group(1)) if regs else None, spill_st=int(spills.group(1)) if spills else 0,
                spill_ld=int(spills.group(2)) if spills else 0, shared=kernel.metadata.shared,
                barriers=len(re.findall(r"bar\.sync|barrier\.sync", ptx)), wgmma=ptx.count("wgmma.mma_async"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--warps", type=int, default=prefill.PREPARE_WARPS)
    parser.add_argument("--channels", type=int, help="preparation channels per step (default: what the launch uses)")
    args = parser.parse_args()
    for gate in (True, False):
        for dim in (128, 64):
            channels = min(args.channels, dim) if args.channels else prefill.prepare_channels(dim, gate)
            consts = dict(H=12, K=dim, V=dim, C=prefill.CHUNK, BC=prefill.BLOCK, BK=channels,
                          IS_VARLEN=True, LOWER_BOUND_GATE=gate, L2NORM=True, BETA_SIGMOID=True,
                          RUN=prefill.token_run(dim), DOT_PRECISION="tf32", EMULATE=False)
            stats = compile_stats(prefill._prepare_kernel, PREPARATION_SIGNATURE, consts, args.warps,
                                  prefill.PREPARE_STAGES)
            print(f"prepare K=V={dim} lower_bound_gate={gate} channels={channels} warps={args.warps}: {stats}")
    for dim in (128, 64):
        for form_w_u in (True, False):
            consts = dict(H=12, K=dim, V=dim, C=prefill.CHUNK, BC=prefill.BLOCK, BK=min(prefill.SOLVE_CHANNELS, dim),
                          IS_VARLEN=True, BETA_SIGMOID=True, DOT_PRECISION="tf32", EMULATE=False, FORM_W_U=form_w_u)
            stats = compile_stats(prefill._solve_kernel, PREPARATION_SIGNATURE, consts, prefill.SOLVE_WARPS,
                                  prefill.SOLVE_STAGES)
            print(f"solve K=V={dim} warps={prefill.SOLVE_WARPS} form_w_u={form_w_u}: {stats}")
    recurrence_sig = dict(ws_bf16=BF16, ws_fp32=F32, out=BF16, initial_state=F32, final_state=F32,
                          cu_seqlens="*i32", ckpt_offsets="*i32", ckpt_states=F32, stride_out="i32", seq_len="i32",
                          rows="i32", total_slots="i32", stride_ckpt_n="i32", stride_ckpt_j="i32", v=BF16,
                          stride_v="i32")
    for slices, checkpoints, w_u_formed in ((1, 0, True), (1, 0, False), (2, 0, True), (2, 0, False), (4, 0, True),
                                            (4, 2, True)):
        width = 128 // slices
        consts = dict(H=12, K=128, V=128, BV=width, C=prefill.CHUNK, IS_VARLEN=True, HAS_INITIAL=True,
                      HAS_FINAL=True, NUM_CKPT=checkpoints, STATE_ROWS_V=prefill.state_rows_v(width),
                      W_U_FORMED=w_u_formed, DOT_PRECISION="tf32", EMULATE=False)
        stats = compile_stats(prefill._recurrence_kernel, recurrence_sig, consts, prefill.recurrence_warps(width),
                              prefill.RECURRENCE_STAGES)  # as recur() launches it
        print(f"recurrence K=V=128 v_slices={slices} checkpoints={checkpoints} w_u_formed={w_u_formed}: {stats}")
    decode_sig = dict(q=BF16, k=BF16, v=BF16, g=BF16, beta=BF16, A_log=F32, dt_bias=F32, pool=F32, slots="*i32",
                      num_accepted="*i32", out=BF16, stride_q="i32", stride_k="i32", stride_v="i32", stride_g="i32",
                      stride_beta_n="i32", stride_beta_t="i32", stride_beta_h="i32", stride_slot_n="i32",
                      stride_slot_t="i32", lower_bound="fp32", scale="fp32", T="i32")
    width, warps = plan.DECODE_SLICE_WIDTH, decode.decode_warps(plan.DECODE_SLICE_WIDTH)
    for per_token in (False, True):
        consts = dict(H=12, K=128, V=128, BV=width, LOWER_BOUND_GATE=True, L2NORM=True, BETA_SIGMOID=True,
                      PER_TOKEN_SLOTS=per_token, HAS_ACCEPTED=per_token, EMULATE=False)
        print(f"decode BV={width} warps={warps} per_token_slots={per_token}: "
              f"{compile_stats(decode._decode_kernel, decode_sig, consts, warps)}")


if __name__ == "__main__":
    main()
