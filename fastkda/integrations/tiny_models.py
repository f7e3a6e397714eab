"""Tiny randomly initialised transformers models with KDA layers (Kimi-Linear, GLM-5.3-Flash): no weights to
download, a few seconds on a CPU. For the integration's tests, its README example and the model benchmark."""

import torch

MODEL_KINDS = ("kimi_linear", "glm5_next")


def tiny_model(kind="kimi_linear", *, head_dim=64, heads=2, layers=2, moe=True, dtype=torch.float32, device="cpu",
               seed=0):
    """A ``KimiLinearForCausalLM`` (``kind="kimi_linear"``) or ``Glm5NextForConditionalGeneration``
    (``"glm5_next"``: its lower-bound gate at λ = −5) of hidden size 64 and ``layers`` layers, alternating KDA and
    full attention (the first is KDA), with a small vocabulary and, unless ``moe=False`` (dense MLPs: no expert
    routing, whose top-k choice flips under rounding), a small MoE; in eval mode."""
    import transformers

    if kind not in MODEL_KINDS:
        raise ValueError(f"tiny_model: kind must be one of {MODEL_KINDS}, got {kind!r}")
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=layers, mlp_layer_types=["dense"] + ["sparse" if moe else "dense"] * (layers - 1),
                  num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
                  num_experts_per_tok=2, n_group=1, topk_group=1, linear_num_heads=heads, linear_head_dim=head_dim,
                  linear_conv_kernel_dim=4, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(seed)
    if kind == "kimi_linear":
        config = transformers.KimiLinearConfig(
            **common, layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(layers)],
            q_lora_rank=None, qk_rope_head_dim=8, num_local_experts=4, bos_token_id=1)
        model = transformers.KimiLinearForCausalLM(config)
    else:
        text = dict(common, layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(layers)],
                    q_lora_rank=32, qk_rope_head_dim=0, n_routed_experts=4, index_topk=16, index_kpool=4,
                    index_head_dim=16, index_n_heads=2, hc_mult=2, linear_lower_bound=-5.0)
        config = transformers.Glm5NextConfig(
            text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                                                 out_hidden_size=64, projection_intermediate_size=64))
        model = transformers.Glm5NextForConditionalGeneration(config)
    return model.to(device=device, dtype=dtype).eval()
