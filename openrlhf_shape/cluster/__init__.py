"""The cluster path: GPU placement (pure plan + Ray placement groups), streamed weight sync from
Megatron ranks into vLLM engines, and the colocation lifecycle (sleep / offload / wake order)."""
