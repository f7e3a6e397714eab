"""tools/peer_tests.py: the rewrite points the peer's test at fastkda, and refuses a file it cannot rewrite."""

import pytest

from tools.peer_tests import rewritten


def test_rewrites_the_import_under_test_only():
    text = "from fla.ops.kda import chunk_kda, fused_recurrent_kda\nfrom fla.ops.kda.naive import naive_chunk_kda\n"
    out = rewritten("fla", text)
    assert out.splitlines()[:2] == ["from fastkda.compat.fla import chunk_kda, fused_recurrent_kda",
                                    "from fla.ops.kda.naive import naive_chunk_kda"]


def test_forward_only_shims_skip_gradients_but_not_outputs():
    import torch

    scope = {"torch": torch, "calls": []}
    scope["assert_close"] = lambda *args, **kwargs: scope["calls"].append(args[0])
    original = torch.Tensor.backward
    try:
        exec(rewritten("fla", "from fla.ops.kda import chunk_kda, fused_recurrent_kda\n").split("\n", 1)[1], scope)
        scope["assert_close"]("dq", torch.zeros(1), None)
        scope["assert_close"]("o", torch.zeros(1), torch.zeros(1))
        scope["assert_close"]("ht", torch.zeros(1), None)  # a missing forward output is still compared
        torch.zeros(1).backward()  # no grad: nothing happens
        x = torch.ones(1, requires_grad=True)
        (2 * x).sum().backward()
    finally:
        torch.Tensor.backward = original
    assert scope["calls"] == ["o", "ht"] and x.grad.item() == 2


def test_refuses_a_file_without_the_import():
    with pytest.raises(SystemExit, match="not found"):
        rewritten("fla", "from fla.ops.kda import chunk_kda\n")
