"""Both gradient norms of a ZeRO-1/2 step, for the tests that compare them (on CPU and on CUDA): trainer/zero.py's
one-pass norm and DeepSpeed's own per-tensor method, on the same gradients of every parameter group."""


def record_both_norms(optimizer) -> list[tuple[float, float]]:
    """From now on, each time the optimizer's step computes its gradient norm, appends (one-pass, DeepSpeed's) for
    every parameter group to the returned list."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert "get_grad_norm_direct" in vars(optimizer)  # the one-pass method stands in for the class's
    seen: list[tuple[float, float]] = []
    group_norms = optimizer.scaled_global_norm

    def both(norm_type=2):
        for i in range(len(optimizer.bit16_groups)):
            grads, params = optimizer.averaged_gradients[i], optimizer.params_in_partition[i]
            seen.append((float(optimizer.get_grad_norm_direct(grads, params)),
                         float(DeepSpeedZeroOptimizer.get_grad_norm_direct(optimizer, grads, params))))
        return group_norms(norm_type)

    optimizer.scaled_global_norm = both
    return seen
