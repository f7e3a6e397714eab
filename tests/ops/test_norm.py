"""The KDA layer's gated RMSNorm (spec §9 step 6): the reference against ``torch.nn.functional.rms_norm``, the
Triton kernel on the CPU interpreter against the reference (fp32: the interpreter's bf16 arithmetic is wrong,
triton issue 11584), strided views, and the public API's validation."""

import pytest
import torch
import torch.nn.functional as F

import fastkda
from fastkda.api import _row_levels
from fastkda.reference import gated_rmsnorm_reference
from helpers import needs_interpreter

ACTIVATIONS = {"sigmoid": torch.sigmoid, "silu": F.silu}


@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_reference_is_rms_norm_times_the_gate(activation):
    gen = torch.Generator().manual_seed(0)
    x, gate = torch.randn(2, 5, 3, 48, generator=gen).double(), torch.randn(2, 5, 3, 48, generator=gen).double()
    weight = torch.rand(48, generator=gen).double()
    expected = F.rms_norm(x, (48,), weight, eps=1e-5) * ACTIVATIONS[activation](gate)
    got = gated_rmsnorm_reference(x, gate, weight, 1e-5, activation=activation, dtype=torch.float64)
    torch.testing.assert_close(got, expected)


def test_leading_dimensions_merge_into_levels():
    """Size-1 dimensions dropped, neighbours merged where both tensors allow it, at most three levels."""
    base = torch.zeros(4, 5, 6, 8)
    assert _row_levels(base, base) == [(1, 0, 0), (1, 0, 0), (120, 8, 8)]
    assert _row_levels(base[:1, :, :1], base[:1, :, :1]) == [(1, 0, 0), (1, 0, 0), (5, 48, 48)]
    wide = torch.zeros(7, 3 * 4 * 16)[:, 64:128].view(7, 4, 16)  # the heads of a projection's second third
    assert _row_levels(wide, torch.zeros(7, 4, 16)) == [(1, 0, 0), (7, 192, 64), (4, 16, 16)]
    swapped = base.transpose(0, 1)
    assert _row_levels(swapped, swapped) == [(5, 48, 48), (4, 240, 240), (6, 8, 8)]
    scattered = torch.zeros(2, 3, 5, 7, 9)[:, :, :4, :6, :2].permute(3, 2, 1, 0, 4)
    with pytest.raises(ValueError, match="three strided levels"):
        _row_levels(scattered, scattered)


def run_both(x, gate, weight, eps=1e-6, activation="sigmoid"):
    """The kernel into a NaN-poisoned output and the reference; checks that they agree."""
    from fastkda.ops.norm import gated_rmsnorm_forward

    out = torch.full(x.shape, float("nan"))
    gated_rmsnorm_forward(x, gate, weight, eps, activation == "silu", _row_levels(x, gate), out)
    torch.testing.assert_close(out, gated_rmsnorm_reference(x, gate, weight, eps, activation=activation),
                               rtol=1e-5, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_kernel_matches_the_reference(activation):
    """D of 64 and ones that are not powers of two, a single row, many rows, a large eps."""
    gen = torch.Generator().manual_seed(1)
    for shape in ((37, 4, 64), (100,), (3, 5, 2, 48), (9, 130)):
        x, gate = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
        run_both(x, gate, torch.randn(shape[-1], generator=gen), activation=activation)
    x = torch.randn(6, 32, generator=gen) * 1e-3
    run_both(x, torch.randn(6, 32, generator=gen), torch.ones(32), eps=1e-2, activation=activation)


@needs_interpreter
def test_kernel_reads_strided_views():
    """x and gate as head views of thirds of a ``[T, 3·H·D]`` projection, a transposed ``[H, T, D]`` view, a
    strided last dimension and broadcast weight, and an empty batch."""
    gen = torch.Generator().manual_seed(2)
    heads, dim, tokens = 3, 32, 21
    wide = torch.randn(tokens, 3 * heads * dim, generator=gen)
    thirds = [part.view(tokens, heads, dim) for part in wide.split(heads * dim, 1)]
    run_both(thirds[0], thirds[2], torch.randn(dim, generator=gen))
    run_both(thirds[1].transpose(0, 1), torch.randn(heads, tokens, dim, generator=gen), torch.rand(dim, generator=gen))
    strided = torch.randn(tokens, 2 * dim, generator=gen)[:, ::2]
    run_both(strided, thirds[1][:, 0], torch.randn(1, generator=gen).expand(dim), activation="silu")
    run_both(torch.randn(0, 4, dim), torch.randn(0, 4, dim), torch.randn(dim, generator=gen))


def test_api_runs_the_reference_on_the_cpu():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 3 * 16, generator=gen).bfloat16()[..., 16:32]
    gate = torch.randn(5, 2, 16, generator=gen)
    weight = torch.rand(16, generator=gen)
    for activation in ("sigmoid", "silu"):
        out = fastkda.gated_rmsnorm(x, gate, weight, 1e-5, activation=activation)
        assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.shape == x.shape
        assert torch.equal(out, gated_rmsnorm_reference(x, gate, weight, 1e-5, activation=activation).bfloat16())


@pytest.mark.parametrize("overrides, word", [
    (dict(x=torch.randn(4, 8).int()), "x"),
    (dict(x=torch.randn(4, 0), gate=torch.randn(4, 0)), "D in"),
    (dict(x=torch.randn(1, 16385), gate=torch.randn(1, 16385)), "D in"),
    (dict(gate=torch.randn(4, 7)), "gate"),
    (dict(gate=torch.randn(4, 8).to("meta")), "where x is"),
    (dict(gate=torch.randn(4, 7).to("meta")), "gate must be on cpu"),  # the device first, not the shape after it
    (dict(weight=torch.randn(7)), "weight"),
    (dict(weight=torch.randn(8).long()), "weight"),
    (dict(eps=-1.0), "eps"),
    (dict(eps=torch.tensor(1e-6)), "eps"),
    (dict(activation="relu"), "activation"),
    (dict(activation=None), "activation"),
])
def test_bad_norm_call_is_rejected(overrides, word):
    kw = dict(x=torch.randn(4, 8), gate=torch.randn(4, 8), weight=torch.randn(8), eps=1e-6, activation="sigmoid")
    kw.update(overrides)
    with pytest.raises(ValueError, match=word):
        fastkda.gated_rmsnorm(kw.pop("x"), kw.pop("gate"), kw.pop("weight"), kw.pop("eps"), **kw)


def test_torch_compile_traces_the_norm_as_an_op():
    gen = torch.Generator().manual_seed(4)
    x, gate, weight = torch.randn(6, 2, 16, generator=gen), torch.randn(6, 2, 16, generator=gen), torch.rand(16)

    def norm(x, gate):
        return fastkda.gated_rmsnorm(x * 2, gate, weight, activation="silu") + 1

    assert torch.equal(torch.compile(norm, fullgraph=True)(x, gate), norm(x, gate))
