"""Context parallelism in the trainer: two DeepSpeed ranks (gloo, Ray actors) split every micro-batch's tokens and
train as one process on the whole batch would — loss and gradient norm — under ZeRO-2 and ZeRO-3, with sequences
that cross the ranks' boundary and one longer than either rank's share."""

import pytest

from agentrl.trainer import create_trainer_group
from tests.integration.test_trainer import config, make_groups, model_dir, on_all, reference_step  # noqa: F401


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_context_parallel_ranks_train_as_one_process(ray_session, model_dir, tmp_path, zero_stage):  # noqa: F811
    # 96 tokens per rank: the group packs micro-batches of 192 (the 250-token trajectory alone, split in two)
    cfg = config(tmp_path, zero_stage=zero_stage, context_parallel=2, micro_batch_tokens=96)
    group = create_trainer_group(cfg, model_dir, num_ranks=2)
    try:
        batch = make_groups(0, 2, seed=4)
        state = on_all(group, "full_state_dict")[0]
        want_loss, want_norm = reference_step(state, model_dir, batch, cfg.loss)
        metrics = on_all(group, "step", batch)
        checks = on_all(group, "replica_checksum")
    finally:
        group.shutdown()
    m = metrics[0]
    assert m["loss"] == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
    assert m["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    assert m["num_sequences"] == 8 and m["micro_batches"] >= 2
    assert checks[0] == checks[1]  # both ranks hold the same weights after the step
