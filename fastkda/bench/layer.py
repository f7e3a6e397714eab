"""``python -m fastkda.bench.layer``: the KDA layer end to end, fastkda against transformers' own layer.

The workload is a serving step's: a prefill of the chunked mix (``H12_chunked_mix``'s sequence lengths, packed),
then ``--steps`` decode steps of one token for every sequence. fastkda runs :class:`fastkda.layers.
KimiDeltaAttention` over a :class:`fastkda.cache.KDACache` (the packed prefill in one call; each decode step eager
and as a CUDA-graph replay) with ``fused_decode=False``, then again with its default decode step
(:func:`fastkda.kda_decode_step`). The peer is
transformers' ``KimiLinearDeltaAttention`` (GLM-5.3-Flash's layer with a lower bound: ``--gate lower_bound``)
on the same weights, with the KDA functions transformers bound at import (FLA's where installed) and, if asked,
its PyTorch fallbacks: its layer takes no packed batch, so each sequence is prefilled alone and the decode steps
run batched, its conv and recurrent states stacked in a small cache object with transformers' cache interface.
Every path's decode outputs are compared with fastkda's.

Writes ``OUT/<date>-<device>-layer.{json,md}``; eager times are medians of ``--repeats`` runs, CUDA-synchronised.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch

from ..cache import KDACache
from ..layers import KimiDeltaAttention
from .arguments import checked_device, positive_float, positive_int
from .models import binds_fla, bound_functions, device_name, modeling_module, use_path
from .report import git_commit, run_id
from .runners import relative_error
from .timing import synced_median_ms, time_graph
from .workloads import load_workloads

HEAD_DIM = 128


class StackedCache:
    """transformers' linear-attention cache interface for one layer (``get_conv_state``, ``get_recurrent_state``,
    ``update_conv_state``, ``update_recurrent_state``, and since transformers 5.25 ``is_recording_past``,
    ``increase_count`` and ``get_recurrent_states_to_keep``) over plain tensors, so that sequences prefilled one at
    a time can decode as one batch (:meth:`stack`). Conv state ``[B, C, W]`` (the last W inputs), recurrent ``[B,
    H, K, V]`` fp32, as transformers keeps them; one state per layer (``state_idx`` 0), no past recorded."""

    def __init__(self, conv=None, recurrent=None):
        self.conv, self.recurrent = conv, recurrent

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.conv

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.recurrent

    def is_recording_past(self, layer_idx):
        return False

    def increase_count(self, layer_idx, state_idx=0):
        """transformers counts the tokens a decode step's in-place conv update adds; nothing here reads a count."""

    def get_recurrent_states_to_keep(self, layer_idx=None):
        return 0

    def update_conv_state(self, mixed, layer_idx, conv_kernel_size, state_idx=0):
        """The conv's input with the W earlier inputs in front (zeros on a first prefill, as transformers pads);
        keeps the last W inputs."""
        earlier = self.conv if self.conv is not None else mixed.new_zeros(*mixed.shape[:2], conv_kernel_size)
        full = torch.cat([earlier, mixed], dim=-1)
        self.conv = full[..., -conv_kernel_size:].contiguous()
        return full

    def update_recurrent_state(self, state, layer_idx):
        self.recurrent = state.float().contiguous()

    @staticmethod
    def stack(caches):
        return StackedCache(torch.cat([c.conv for c in caches]), torch.cat([c.recurrent for c in caches]))


def transformers_layer(gate, heads, hidden, device, dtype):
    """transformers' KDA layer of Kimi-Linear (``gate="softplus"``) or GLM-5.3-Flash (``"lower_bound"``, λ = −5),
    random weights."""
    import transformers

    common = dict(hidden_size=hidden, linear_num_heads=heads, linear_head_dim=HEAD_DIM, linear_conv_kernel_dim=4,
                  num_hidden_layers=1, layer_types=["linear_attention"])
    if gate == "softplus":
        Layer = modeling_module("kimi_linear").KimiLinearDeltaAttention
        config = transformers.KimiLinearConfig(**common)
    else:
        Layer = modeling_module("glm5_next").Glm5NextTextLinearAttention
        config = transformers.Glm5NextTextConfig(**common, linear_lower_bound=-5.0, num_attention_heads=2,
                                                 num_key_value_heads=2)
    torch.manual_seed(0)
    layer = Layer(config, 0)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0, 0.02)
        layer.forget_gate.A_log.uniform_(0, 1)
        layer.forget_gate.dt_bias.uniform_(0, 1)
        layer.o_norm.weight.fill_(1.0)
    return layer.to(device=device, dtype=dtype).eval()


def _timed(prefill, decode_steps, states, device, repeats):
    """``(prefill ms, decode ms per step, decode outputs)``: the decode steps timed from the state right after the
    prefill, restored (untimed) before each repeat from a copy of ``states()``'s tensors."""
    with torch.no_grad():
        prefill()  # warm-up: compiles
        prefill_ms = synced_median_ms(prefill, device, repeats)
        prefill()
        saved = [t.clone() for t in states()]
        outputs = decode_steps()  # warm-up, and the outputs compared

        def restore():
            for t, copy in zip(states(), saved):
                t.copy_(copy)

        steps_ms = synced_median_ms(decode_steps, device, repeats, before=restore)
    return prefill_ms, steps_ms, torch.cat(outputs, 1)


def run_fastkda(layer, prompts, steps_in, device, repeats):
    """Prefill the packed prompts, then the decode steps; returns times and the decode outputs."""
    lengths = [p.shape[0] for p in prompts]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    packed = torch.cat(prompts)
    cache = KDACache(len(prompts), 1, layer.num_heads, layer.head_dim, layer.conv_channels, layer.conv_kernel,
                     conv_dtype=prompts[0].dtype, device=device)  # conv states in the activations' dtype
    slots = cache.allocate(len(prompts))

    def prefill():
        return layer(packed, cache, slots=slots, cu_seqlens=cu, max_seqlen=max(lengths),
                     has_initial_state=torch.zeros(len(prompts), dtype=torch.bool, device=device))

    prefill_ms, steps_ms, outputs = _timed(
        prefill, lambda: [layer(step, cache, slots=slots, decode=True) for step in steps_in],
        lambda: (cache.recurrent, cache.conv), device, repeats)
    graph_step_ms = None
    if device.type == "cuda":
        step = steps_in[0].clone()
        with torch.no_grad():
            graph_step_ms = time_graph(lambda: layer(step, cache, slots=slots, decode=True))
    return dict(prefill_ms=prefill_ms, decode_step_ms=steps_ms / len(steps_in),
                graph_decode_step_ms=graph_step_ms), outputs


def run_transformers(layer, prompts, steps_in, device, repeats):
    """transformers' layer: each prompt prefilled alone, then batched decode steps over the stacked states."""
    state = {}

    def prefill():
        caches = []
        for prompt in prompts:
            cache = StackedCache()
            layer(prompt[None], cache=cache)
            caches.append(cache)
        state["cache"] = StackedCache.stack(caches)

    prefill_ms, steps_ms, outputs = _timed(
        prefill, lambda: [layer(step, cache=state["cache"]) for step in steps_in],
        lambda: (state["cache"].conv, state["cache"].recurrent), device, repeats)
    return dict(prefill_ms=prefill_ms, decode_step_ms=steps_ms / len(steps_in), graph_decode_step_ms=None), outputs


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastkda.bench.layer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    prefill = {w["name"]: w for w in load_workloads()["prefill"]}
    parser.add_argument("--workload", default="H12_chunked_mix", choices=list(prefill), metavar="NAME",
                        help="a prefill workload whose lengths and heads are used")
    parser.add_argument("--hidden", type=positive_int, default=2048)
    parser.add_argument("--steps", type=positive_int, help="decode steps (default 64; 8 on a CPU)")
    parser.add_argument("--gate", choices=("lower_bound", "softplus"), default="lower_bound")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--pytorch", action="store_true", help="also time transformers' PyTorch fallbacks")
    parser.add_argument("--scale", type=positive_float,
                        help="multiply the sequence lengths (default 1; 0.05 on a CPU, where transformers' PyTorch "
                             "path takes minutes at full length)")
    parser.add_argument("--out", default="fastkda-results")
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    on_gpu = device.type == "cuda"
    args.steps = args.steps if args.steps is not None else 64 if on_gpu else 8
    args.scale = args.scale if args.scale is not None else 1.0 if on_gpu else 0.05
    dtype = torch.bfloat16 if on_gpu else torch.float32
    workload = prefill[args.workload]
    heads = workload["H"]
    lengths = [max(1, round(n * args.scale)) for n in workload["lengths"]]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randn(n, args.hidden, generator=gen).to(device, dtype) for n in lengths]
    steps_in = [torch.randn(len(lengths), 1, args.hidden, generator=gen).to(device, dtype) for _ in range(args.steps)]
    theirs = transformers_layer(args.gate, heads, args.hidden, device, dtype)
    ours = KimiDeltaAttention.from_transformers(theirs)
    module = modeling_module("kimi_linear" if args.gate == "softplus" else "glm5_next")
    bound = bound_functions(module)
    rows, commit, run = [], git_commit(), run_id()
    ours.fused_decode = False  # first the three ops one by one, then the layer's default decode step
    times, reference = run_fastkda(ours, prompts, steps_in, device, args.repeats)
    rows.append(dict(path="fastkda", **times, decode_rel_err=0.0))
    ours.fused_decode = True
    times, outputs = run_fastkda(ours, prompts, steps_in, device, args.repeats)
    reference = reference.double()  # the errors below: against the unfused outputs, in float64
    rows.append(dict(path="fastkda fused step", **times, decode_rel_err=relative_error(outputs, reference)))
    with_fla = binds_fla(bound["chunk_kimi_delta_attention"])
    for path in (["fla"] if with_fla else []) + (["pytorch"] if args.pytorch or not with_fla else []):
        use_path(module, path, bound)
        times, outputs = run_transformers(theirs, prompts, steps_in, device, args.repeats)
        rows.append(dict(path=f"transformers+{path}", **times, decode_rel_err=relative_error(outputs, reference)))
    use_path(module, "fla", bound)
    meta = dict(workload=args.workload, heads=heads, lengths=lengths, hidden=args.hidden, steps=args.steps,
                gate=args.gate, dtype=str(dtype).replace("torch.", ""), device=device_name(device), commit=commit,
                run=run, date=date.today().isoformat())
    for row in rows:
        print(f"[layer] {row['path']:22s} prefill {row['prefill_ms']:9.3f} ms  decode step {row['decode_step_ms']:8.3f}"
              f" ms  (graph {row['graph_decode_step_ms'] or float('nan'):.4f})  decode rel err "
              f"{row['decode_rel_err']:.1e}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{meta['date']}-{meta['device'].replace(' ', '_')}-layer"
    stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    stem.with_suffix(".md").write_text(markdown(meta, rows))
    print(f"[layer] wrote {stem}.json")


def markdown(meta, rows):
    lines = [f"# KDA layer end to end, {meta['device']}, {meta['date']}, commit {meta['commit']}", "",
             f"{meta['workload']} lengths {meta['lengths']} at H = {meta['heads']}, D = {HEAD_DIM}, hidden "
             f"{meta['hidden']}, {meta['gate']} gate, {meta['dtype']}: one prefill, then {meta['steps']} decode steps "
             "of one token per sequence. Eager medians (ms); the graph column replays one fastkda decode step.", "",
             "| path | prefill ms | decode ms/step | graph decode ms/step | decode outputs vs fastkda |",
             "|---|---:|---:|---:|---:|"]
    for row in rows:
        graph = f"{row['graph_decode_step_ms']:.4f}" if row["graph_decode_step_ms"] else ""
        lines.append(f"| {row['path']} | {row['prefill_ms']:.3f} | {row['decode_step_ms']:.3f} | {graph} | "
                     f"{row['decode_rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
