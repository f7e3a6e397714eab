"""Graph-replay times of the layer's kernels on the device: the conv over 8192 tokens in 8 sequences (with conv
states), the gated norm over the same tokens, and a 256-sequence conv update, at 12 and 96 heads of 128, each
against the copy rate measured in the same run; conv pools in KDACache's layout (channel-last memory).

python tools/profiling/layer_kernels.py"""
import argparse
import sys

import torch

import fastkda
from fastkda.bench.timing import copy_bandwidth_gbps, time_graph
from fastkda.cache import conv_state_pool

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
if not torch.cuda.is_available():
    sys.exit("layer_kernels.py times the GPU kernels: it needs a CUDA GPU")
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s")
for heads in (12, 96):
    C, T, N = 3 * heads * 128, 8192, 8
    x = torch.randn(T, C, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(C, 4, device="cuda", dtype=torch.bfloat16)
    cu = torch.linspace(0, T, N + 1, device="cuda").round().to(torch.int32)
    pool = conv_state_pool(N, channels=C, kernel=4, dtype=torch.float32, device="cuda")
    slots = torch.arange(N, device="cuda", dtype=torch.int32)
    ms = time_graph(lambda: fastkda.causal_conv1d(x, w, conv_states=pool, slots=slots, cu_seqlens=cu))
    gb = 2 * T * C * 2 / 1e9
    rate = gb / ms * 1e3
    print(f"conv H{heads} T{T}: {ms * 1e3:.1f} us, {rate:.0f} GB/s ({rate / copy * 100:.0f}% of copy)")
    o = torch.randn(T, heads, 128, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn_like(o)
    nw = torch.ones(128, device="cuda")
    ms = time_graph(lambda: fastkda.gated_rmsnorm(o, gate, nw, 1e-5))
    gb = 3 * o.numel() * 2 / 1e9
    rate = gb / ms * 1e3
    print(f"norm H{heads} T{T}: {ms * 1e3:.1f} us, {rate:.0f} GB/s ({rate / copy * 100:.0f}% of copy)")
    xd = torch.randn(256, C, device="cuda", dtype=torch.bfloat16)
    dpool = conv_state_pool(256, channels=C, kernel=4, dtype=torch.bfloat16, device="cuda")
    dslots = torch.arange(256, device="cuda", dtype=torch.int32)
    ms = time_graph(lambda: fastkda.causal_conv1d_update(xd, dpool, w, slots=dslots))
    gb = (2 * 256 * C * 2 + 2 * 256 * C * 3 * 2) / 1e9
    print(f"conv update H{heads} N256: {ms * 1e3:.1f} us, {gb / ms * 1e3:.0f} GB/s")
