"""The layer's kernels and the decode kernel compile for sm_90a here, without a GPU (Triton's own ptxas): the
interpreter runs code a GPU compile refuses (a name given a tensor of another shape inside an ``if`` did, in the
conv at cac2a73), so each kernel is compiled as its launch would compile it, for both gate modes and the warps the
plans pick. Run in a process of its own: the tests interpret the kernels, and compiling must not."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="compiles with Triton's ptxas")

COMPILE = r"""
import sys
sys.path.insert(0, ".")
from tools.profiling.hopper import compile_for_hopper
from fastkda.ops.conv import conv_kernel, conv_update_kernel
from fastkda.ops.decode import decode_kernel
from fastkda.ops.decode_step import decode_step_kernel, head_step_kernel
from fastkda.ops.norm import gated_rmsnorm_kernel
from fastkda.plan import conv_update_launch, decode_step_chunk

H, K, V, W, C = 12, 128, 128, 4, 3 * 12 * 128
B, F, I = "*bf16", "*fp32", "*i32"
for gate in (True, False):
    stride_cc, stride_cj = (1, C) if gate else (W - 1, 1)  # conv pools channel-last (KDACache's), then contiguous
    for slices, warps in ((8, 1), (8, 2), (4, 4), (1, 8), (1, 4)):  # one slice: one program a head
        step = dict(
            mixed=B, conv_pool=F, conv_weight=B, g=B if gate else F, beta=B, out_gate=B, norm_weight=F, A_log=F,
            dt_bias=F, pool=F, slots=I, partial=F, out=B, errors=I, stride_mixed=C,
            stride_cp=C * (W - 1), stride_cc=stride_cc, stride_cj=stride_cj, stride_wc=W, stride_wj=1, stride_g=H * K,
            stride_beta=H, stride_beta_h=1, stride_gate=H * V, stride_slot=1, lower_bound=-5.0, scale=K ** -0.5,
            eps=1e-5, pool_slots=33, H=H, K=K, V=V, W=W, LOWER_BOUND_GATE=gate, L2NORM=True, BETA_SIGMOID=True,
            EMULATE=False)
        if slices == 1:
            compile_for_hopper(head_step_kernel, dict(step, BC=decode_step_chunk(V)), warps, 3)
        else:
            compile_for_hopper(decode_step_kernel, dict(step, sums=F, tickets=I, BV=V // slices, SLICES=slices), warps,
                               3)
        print("decode_step", gate, slices, warps, flush=True)
    compile_for_hopper(decode_kernel, dict(
        q=B, k=B, v=B, g=B if gate else F, beta=B, A_log=F, dt_bias=F, pool=F, slots=I, num_accepted=I, out=B,
        errors=I, pool_slots=33, stride_q=H * K, stride_k=H * K, stride_v=H * V, stride_g=H * K, stride_beta_n=H,
        stride_beta_t=H, stride_beta_h=1, stride_slot_n=1, stride_slot_t=0, lower_bound=-5.0, scale=K ** -0.5, T=1,
        H=H, K=K, V=V, BV=16, LOWER_BOUND_GATE=gate, L2NORM=True, BETA_SIGMOID=True, PER_TOKEN_SLOTS=False, T_SLOTS=1,
        HAS_ACCEPTED=False, EMULATE=False), 1, 3)
    print("decode", gate, flush=True)
for varlen, block_t, states in ((True, 32, True), (False, 4, True), (True, 32, False)):
    compile_for_hopper(conv_kernel, dict(
        x=B, weight=B, bias=B, states=F, slots=I, has_initial=I, cu_seqlens=I, out=B, stride_xb=0 if varlen else C,
        stride_xt=C, stride_xc=1, stride_wc=W, stride_wj=1, stride_bias=1, stride_sp=C * (W - 1), stride_sc=W - 1,
        stride_sj=1, stride_slot=1, stride_initial=1, seq_len=8192, num_seqs=8, channels=C, pool_rows=8, W=W,
        S=W - 1, BT=block_t, BC=128, SP=4, IS_VARLEN=varlen, HAS_BIAS=False, HAS_STATES=states, HAS_SLOTS=states,
        HAS_INITIAL_FLAGS=states, SILU=True, EMULATE=False), 4, 3)
    print("conv", varlen, block_t, states, flush=True)
for states, kept in (("*bf16", W - 1), ("*fp32", W - 1), ("*bf16", W)):  # S = W: transformers' conv states
    for channel_last, (stride_sc, stride_sj) in ((False, (kept, 1)), (True, (1, C))):  # as the plan takes each
        seqs, block, warps = conv_update_launch(256, C, channel_last)
        compile_for_hopper(conv_update_kernel, dict(
            x=B, weight=B, bias=B, states=states, slots=I, out=B, stride_xn=C, stride_xc=1, stride_wc=W,
            stride_wj=1, stride_bias=1, stride_sp=C * kept, stride_sc=stride_sc, stride_sj=stride_sj,
            stride_slot=1, num_seqs=256, channels=C, pool_rows=257, W=W, S=kept, BS=seqs, BC=block, HAS_BIAS=False,
            HAS_SLOTS=True, SILU=True, EMULATE=False), warps, 3)
        print("conv update", states, kept, channel_last, flush=True)
compile_for_hopper(gated_rmsnorm_kernel, dict(
    x=B, gate=B, weight=F, out=B, rows=8192 * H, size1=1, size2=H, stride_x0=H * V, stride_x1=H * V, stride_x2=V,
    stride_xd=1, stride_g0=H * V, stride_g1=H * V, stride_g2=V, stride_gd=1, stride_w=1, eps=1e-5, D=V, BR=32, BD=V,
    SILU=False, EMULATE=False), 4, 3)
print("norm", flush=True)
"""


def test_layer_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("decode_step") == 10 and done.stdout.count("conv") == 9
    assert done.stdout.count("conv update") == 6 and "norm" in done.stdout
