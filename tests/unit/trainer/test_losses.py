"""Losses against hand-computed references: values and gradients, token by token."""

import math

import pytest
import torch

from agentrl.trainer.losses import (LossConfig, aggregation_weights, grpo_advantages, k3_kl, policy_loss,
                                    read_sums)
from agentrl.types import Status, Trajectory

# A toy micro-batch: two sequences (tokens 0-2 and 3-5); token 2 is a prompt token (not trained).
LOGP = [-1.0, -0.5, -2.0, -0.2, -1.5, -0.7]
INFER = [-1.3, -0.45, -2.0, -0.9, -1.45, -0.1]
ADV = [1.0, 1.0, 1.0, -0.5, -0.5, -0.5]
MASK = [1, 1, 0, 1, 1, 1]
SEQ = [0, 0, 0, 1, 1, 1]
W = [0.2, 0.2, 0.0, 0.2, 0.2, 0.2]  # token-mean over 5 trained tokens


def run(config: LossConfig, ref=None, entropy=None, old=None):
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    out = policy_loss(logp_T=logp, entropy_T=entropy, infer_T=torch.tensor(INFER, dtype=torch.float64),
                      adv_T=torch.tensor(ADV, dtype=torch.float64), weights_T=torch.tensor(W, dtype=torch.float64),
                      mask_T=torch.tensor(MASK, dtype=torch.bool), seq_T=torch.tensor(SEQ), num_seqs=2,
                      config=config, ref_T=None if ref is None else torch.tensor(ref, dtype=torch.float64),
                      recorded_old_T=None if old is None else torch.tensor(old, dtype=torch.float64))
    out.loss.backward()
    return out, logp.grad.tolist()


def test_token_level_grpo_against_the_behaviour_policy_with_clip_higher():
    eps_low, eps_high = 0.2, 0.28
    out, grad = run(LossConfig(old_logprobs="inference", eps_low=eps_low, eps_high=eps_high))
    loss, want_grad, clipped = 0.0, [], 0
    for lp, inf, a, m, w in zip(LOGP, INFER, ADV, MASK, W):
        r = math.exp(lp - inf)
        unclipped, clip = r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a
        loss += -w * m * min(unclipped, clip)
        active = m and clip < unclipped  # the clipped branch is the min: no gradient through r
        clipped += int(active)
        want_grad.append(0.0 if (active or not m) else -w * a * r)
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    # token 0: r = e^0.3 > 1.28 with A > 0 → clipped; token 3: r = e^0.7 with A < 0 → not; token 5: r = e^-0.6
    # < 0.8 with A < 0 → clipped
    assert clipped == 2 and out.host_sums()["clipped"] == 2 and out.host_sums()["tokens"] == 5


def test_on_policy_grpo_is_the_plain_policy_gradient():
    out, grad = run(LossConfig(old_logprobs="current"))
    assert out.loss.item() == pytest.approx(-sum(w * m * a for w, m, a in zip(W, MASK, ADV)), abs=1e-12)
    assert grad == pytest.approx([-w * m * a for w, m, a in zip(W, MASK, ADV)], abs=1e-12)
    assert out.host_sums()["clipped"] == 0


def test_a_recorded_old_policy_is_pi_old_of_the_ratio_and_of_the_mismatch():
    # a later PPO mini-batch: the policy moved since the step's first update, π_old is the recorded pre-step policy
    old = [lp - d for lp, d in zip(LOGP, (0.3, -0.1, 0.0, -0.4, 0.05, 0.0))]
    eps_low, eps_high, cap = 0.2, 0.28, 1.5
    out, grad = run(LossConfig(eps_low=eps_low, eps_high=eps_high, tis_cap=cap), old=old)
    loss, want_grad, tis_truncated, clipped = 0.0, [], 0, 0
    for lp, o, inf, a, m, w in zip(LOGP, old, INFER, ADV, MASK, W):
        r, c = math.exp(lp - o), min(math.exp(o - inf), cap)  # TIS measures the pre-step policy, not the drift
        tis_truncated += int(m and math.exp(o - inf) > cap)
        unclipped, clip = r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a
        loss += -w * m * c * min(unclipped, clip)
        clipped += int(m and clip < unclipped)
        want_grad.append(0.0 if (not m or clip < unclipped) else -w * c * a * r)
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    assert out.host_sums()["tis_truncated"] == tis_truncated > 0
    # token 0: r = e^0.3 > 1.28 with A > 0; token 3: r = e^-0.4 < 0.8 with A < 0
    assert out.host_sums()["clipped"] == clipped == 2
    # recorded equal to the forward's own log-probs, it is the one-update step exactly
    same, same_grad = run(LossConfig(eps_low=eps_low, eps_high=eps_high, tis_cap=cap), old=LOGP)
    plain, plain_grad = run(LossConfig(eps_low=eps_low, eps_high=eps_high, tis_cap=cap))
    assert same.loss.item() == pytest.approx(plain.loss.item(), abs=1e-12)
    assert same_grad == pytest.approx(plain_grad, abs=1e-12)


def test_gspo_sequence_ratio_loss_and_gradient():
    eps = 0.1
    out, grad = run(LossConfig(kind="gspo", old_logprobs="inference", eps_low=eps, eps_high=eps))
    loss, want = 0.0, [0.0] * 6
    for seq in (0, 1):
        idx = [t for t in range(6) if SEQ[t] == seq and MASK[t]]
        s = math.exp(sum(LOGP[t] - INFER[t] for t in idx) / len(idx))
        a = ADV[idx[0]]
        weight = sum(W[t] for t in range(6) if SEQ[t] == seq)
        clip = min(max(s, 1 - eps), 1 + eps) * a
        loss += -weight * min(s * a, clip)
        if not clip < s * a:
            for t in idx:
                want[t] = -weight * a * s / len(idx)
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert grad == pytest.approx(want, abs=1e-12)
    # seq 0: s = exp((0.3 − 0.05)/2) ≈ 1.133 > 1.1 with A > 0 → clipped, no gradient; seq 1: s = exp(0.05/3)
    assert out.host_sums()["clipped_seqs"] == 1 and out.host_sums()["sequences"] == 2
    assert grad[0] == 0.0 and grad[3] != 0.0


def test_truncated_importance_sampling_weights_by_the_capped_mismatch():
    cap = 1.5
    out, grad = run(LossConfig(tis_cap=cap))
    want, loss, truncated = [], 0.0, 0
    for lp, inf, a, m, w in zip(LOGP, INFER, ADV, MASK, W):
        c = min(math.exp(lp - inf), cap)
        truncated += int(m and math.exp(lp - inf) > cap)
        loss += -w * m * c * a  # r = 1 in value (π_old = the pre-step policy)
        want.append(-w * m * c * a)
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert grad == pytest.approx(want, abs=1e-12)
    assert truncated == 1 and out.host_sums()["tis_truncated"] == 1  # token 3: e^0.7 ≈ 2.01 > 1.5


def test_icepop_drops_tokens_outside_the_band():
    out, grad = run(LossConfig(icepop_band=(0.8, 1.25)))
    keep = [0.8 <= math.exp(lp - inf) <= 1.25 for lp, inf in zip(LOGP, INFER)]
    want = [-w * m * a if k else 0.0 for w, m, a, k in zip(W, MASK, ADV, keep)]
    assert grad == pytest.approx(want, abs=1e-12)
    assert out.loss.item() == pytest.approx(sum(want), abs=1e-12)
    # tokens 0 (e^0.3), 3 (e^0.7) and 5 (e^-0.6) are outside; token 2 is outside too but not trained
    assert keep == [False, True, True, False, True, False] and out.host_sums()["icepop_masked"] == 3
    assert grad[0] == grad[3] == grad[5] == 0.0


def test_gspo_with_icepop_and_sequence_tis():
    cap = 1.05
    out, grad = run(LossConfig(kind="gspo", icepop_band=(0.8, 1.25), tis_cap=cap, eps_low=0.5, eps_high=0.5))
    kept = {0: [1], 1: [4]}  # only tokens 1 and 4 survive IcePop
    want, loss = [0.0] * 6, 0.0
    for seq, idx in kept.items():
        c = min(math.exp(sum(LOGP[t] - INFER[t] for t in idx) / len(idx)), cap)
        weight = sum(W[t] for t in range(6) if SEQ[t] == seq)
        a = ADV[idx[0]]
        loss += -weight * c * a
        for t in idx:
            want[t] = -weight * c * a / len(idx)
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert grad == pytest.approx(want, abs=1e-12)


def test_k3_kl_and_entropy_terms():
    ref = [-1.2, -0.5, -3.0, -0.1, -1.0, -0.9]
    entropy = torch.tensor([2.0, 1.0, 5.0, 0.5, 0.25, 3.0], dtype=torch.float64, requires_grad=True)
    beta, coef = 0.1, 0.01
    out, grad = run(LossConfig(kl_coef=beta, entropy_coef=coef), ref=ref, entropy=entropy)
    kl = [math.exp(r - lp) - (r - lp) - 1 for r, lp in zip(ref, LOGP)]
    pg = -sum(w * m * a for w, m, a in zip(W, MASK, ADV))
    want_loss = pg + beta * sum(w * m * k for w, m, k in zip(W, MASK, kl)) - coef * sum(
        w * m * h for w, m, h in zip(W, MASK, entropy.tolist()))
    assert out.loss.item() == pytest.approx(want_loss, abs=1e-12)
    want = [-w * m * a + beta * w * m * (1 - math.exp(r - lp)) for w, m, a, r, lp in zip(W, MASK, ADV, ref, LOGP)]
    assert grad == pytest.approx(want, abs=1e-12)
    assert entropy.grad.tolist() == pytest.approx([-coef * w * m for w, m in zip(W, MASK)], abs=1e-12)
    assert out.host_sums()["kl"] == pytest.approx(sum(m * k for m, k in zip(MASK, kl)))
    assert all(v >= 0 for v in k3_kl(torch.randn(100), torch.randn(100)).tolist())


def test_sft_is_masked_cross_entropy():
    out, grad = run(LossConfig(kind="sft"))
    assert out.loss.item() == pytest.approx(-sum(w * m * lp for w, m, lp in zip(W, MASK, LOGP)), abs=1e-12)
    assert grad == pytest.approx([-w * m for w, m in zip(W, MASK)], abs=1e-12)


def test_aggregation_weights():
    lengths = [2, 3, 5]
    assert aggregation_weights(lengths, "token-mean") == pytest.approx([0.1] * 3)
    assert aggregation_weights(lengths, "seq-mean-token-mean") == pytest.approx([1 / 6, 1 / 9, 1 / 15])
    assert aggregation_weights(lengths, "seq-mean-token-sum") == pytest.approx([1 / 3] * 3)
    assert aggregation_weights(lengths, "seq-mean-token-sum-norm", 100) == pytest.approx([1 / 300] * 3)


def _t(tid, group, reward, status=Status.COMPLETED):
    return Trajectory(trajectory_id=tid, task_id=group, group_id=group, env_id="e", reward=reward, status=status)


def test_group_advantages_with_and_without_std_and_failed_members():
    trajs = [_t("a", "g1", 1.0), _t("b", "g2", 0.0), _t("c", "g1", 0.0), _t("d", "g1", 0.5),
             _t("e", "g2", 2.0), _t("f", "g1", 9.0, Status.FAILED)]
    dr = grpo_advantages(trajs, normalize_std=False)
    assert dr[:5] == pytest.approx([0.5, -1.0, -0.5, 0.0, 1.0]) and dr[5] is None
    std = grpo_advantages(trajs, normalize_std=True)
    s1 = math.sqrt(((0.5) ** 2 + 0.5 ** 2 + 0) / 3)
    assert std[0] == pytest.approx(0.5 / (s1 + 1e-6)) and std[1] == pytest.approx(-1.0 / (1.0 + 1e-6))


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="reinforce"), "kind"), (dict(aggregation="mean"), "aggregation"),
    (dict(aggregation="seq-mean-token-sum-norm"), "norm_constant"), (dict(tis_cap=0.0), "tis_cap"),
    (dict(tis_cap=2.0, old_logprobs="inference"), "twice"), (dict(icepop_band=(1.2, 2.0)), "icepop_band"),
    (dict(old_logprobs="engine"), "old_logprobs"), (dict(eps_low=-0.1), "eps_low"), (dict(kl_coef=-1.0), "kl_coef"),
    (dict(mini_batches=0), "mini_batches"),
])
def test_config_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


@pytest.mark.parametrize("kind", ["ppo", "gspo", "sft"])
def test_the_loss_leaves_its_sums_on_the_device_and_read_sums_reads_them(kind):
    """No metric is read back inside the loss (each read would wait for the GPU, ~10 per micro-batch); `read_sums`
    gives the same floats as reading each one."""
    out, _ = run(LossConfig(kind=kind, kl_coef=0.1), ref=[x - 0.1 for x in LOGP], entropy=torch.ones(6))
    assert out.sums and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.sums.values())
    assert out.host_sums() == {k: float(v) for k, v in out.sums.items()}
    mixed = {"count": torch.tensor(3), "half": torch.tensor(0.5, dtype=torch.float32), "python": 2, "float": 1.5}
    assert list(read_sums(mixed).items()) == [("count", 3.0), ("half", 0.5), ("python", 2.0), ("float", 1.5)]
