"""The cluster path: GPU placement (pure plan + Ray placement groups), the training ranks as Ray actors, and
the colocation lifecycle (sleep / offload / wake order, around the weight sync of ``openrlhf_shape/weight_sync``)."""
