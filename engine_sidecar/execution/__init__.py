"""Running a FusionPlan on the model: fused prefill and batched decode, layer-wise prefetch, token-selection policies, costs and attention temperatures."""
