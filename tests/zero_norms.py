"""Both gradient norms of a ZeRO step, for the tests that compare them (on CPU and on CUDA): trainer/zero.py's
one-pass norm and DeepSpeed's own per-tensor method, on the same gradients of every parameter group."""


def record_both_norms(optimizer) -> list[tuple[float, float]]:
    """From now on, each time the optimizer's step computes its gradient norm, appends (one-pass, DeepSpeed's) for
    every parameter group to the returned list (ZeRO-1/2 and ZeRO-3)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert "get_grad_norm_direct" in vars(optimizer)  # the one-pass method stands in for the class's
    seen: list[tuple[float, float]] = []

    def record(cls, gradients, params):
        seen.append((float(optimizer.get_grad_norm_direct(gradients, params)),
                     float(cls.get_grad_norm_direct(optimizer, gradients, params))))

    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        group_norms = optimizer._get_norm_groups

        def both_stage3():
            for i in range(len(optimizer.fp16_groups)):
                record(DeepSpeedZeroOptimizer_Stage3, optimizer.averaged_gradients[i], optimizer.fp16_groups[i])
            return group_norms()

        optimizer._get_norm_groups = both_stage3
        return seen
    group_norms = optimizer.scaled_global_norm

    def both(norm_type=2):
        for i in range(len(optimizer.bit16_groups)):
            record(DeepSpeedZeroOptimizer, optimizer.averaged_gradients[i], optimizer.params_in_partition[i])
        return group_norms(norm_type)

    optimizer.scaled_global_norm = both
    return seen
