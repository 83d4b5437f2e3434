"""The GRPO loop's small pieces: advantages, curriculum, loss, monitor, checkpoints."""

from __future__ import annotations

import json
import random

import pytest
import torch

from components.core.checkpoint import Checkpoints
from components.core.config import CollapseMonitorConfig, CurriculumConfig
from components.core.schema import Task, Turn, Verifier
from components.grpo.advantages import group_advantages, returns_to_go, turn_advantages, zero_variance
from components.grpo.curriculum import Curriculum
from components.grpo.loss import (
    Sample,
    collate,
    grpo_loss,
    importance_weights,
    sample_from_turns,
    token_logprobs,
)
from components.grpo.monitor import CollapseMonitor


def test_group_advantages_estimators():
    r = [1.0, 0.0, 0.0, 1.0]
    a = group_advantages(r, "grpo")
    assert sum(a) == pytest.approx(0.0, abs=1e-9) and a[0] > 0 > a[1]
    std = (sum((x - 0.5) ** 2 for x in r) / 3) ** 0.5
    assert a[0] == pytest.approx(0.5 / std, rel=1e-5)
    assert group_advantages(r, "drgrpo") == [0.5, -0.5, -0.5, 0.5]
    # leave-one-out: 1 - mean(0, 0, 1) = 2/3
    assert group_advantages(r, "rloo")[0] == pytest.approx(2 / 3)
    assert group_advantages([0.3, 0.3], "grpo") == [0.0, 0.0]
    assert zero_variance([0.3, 0.3]) and not zero_variance([0.3, 0.4])
    with pytest.raises(ValueError, match="grpo.advantage"):
        group_advantages(r, "ppo")


def test_turn_advantages_use_returns_to_go():
    assert returns_to_go([0.1, 0.2, 1.0]) == pytest.approx([1.3, 1.2, 1.0])
    adv = turn_advantages([[0.0, 1.0], [0.0, -1.0]], "drgrpo")
    # returns: [1, 1] and [-1, -1]; mean 0
    assert adv == [[1.0, 1.0], [-1.0, -1.0]]
    assert [len(x) for x in turn_advantages([[1.0], [0.0, 0.0, 0.0]], "grpo")] == [1, 3]


def _episode(success: bool, subgoals: int, total: float):
    from components.core.schema import RewardBreakdown, Trajectory, Verdict

    return Trajectory(task_id="t", policy="p", turns=[Turn("assistant", "x", tokens=[1], mask=[1])],
                      verdict=Verdict(success, [f"g{i}" for i in range(subgoals)]), reward=RewardBreakdown(total))


def test_progress_filter_leaves_groups_that_differ_only_by_shaping_without_advantage():
    """All four solved the task and reached the same subgoals; only the shaping terms differ (API calls,
    efficiency): the std division would make them +-1 advantages. The progress filter zeroes them and keeps the
    group whose samples differ in success."""
    from components.core.config import PipelineConfig
    from components.core.rollout import Group
    from components.core.schema import RewardBreakdown
    from components.grpo.recipe import advantages_for

    task = _tasks()[1][0]
    shaped = Group([task], [[_episode(True, 2, 1.4 + 0.05 * i)] for i in range(4)])
    mixed = Group([task], [[_episode(i % 2 == 0, 1, float(i % 2 == 0))] for i in range(4)])

    def adv(samples):  # each sample carries its advantage on its agent tokens (one token per test episode)
        return [s.advantages[0] for s in samples]

    # one advantage per episode (trajectory credit): the test episodes carry no per-turn credit
    plain = PipelineConfig.model_validate({"grpo": {"group_filter": "none", "credit": "trajectory"}})
    batch, zero, filtered = advantages_for([shaped, mixed], plain)
    assert len(batch) == 8 and max(abs(a) for a in adv(batch[:4])) > 1.0 and zero == 0.0 and filtered == 0.0
    cfg = PipelineConfig.model_validate({"grpo": {"group_filter": "progress", "credit": "trajectory"}})
    batch, zero, filtered = advantages_for([shaped, mixed], cfg)
    assert adv(batch[:4]) == [0.0] * 4 and filtered == 0.5
    assert [a > 0 for a in adv(batch[4:])] == [True, False, True, False]
    # SAGE: all four chains solved both tasks, two reused the first task's skill (R = 2) and two did not (R = 1):
    # that is SAGE's signal, not shaping, and stays; the rollout's chain-reward hook set those rewards
    chains = Group([task, task], [[_episode(True, 1, 0.0), _episode(True, 1, 0.0)] for _ in range(4)])
    for sample, r in zip(chains.samples, [2.0, 1.0, 2.0, 1.0], strict=True):
        for t in sample:
            t.reward = RewardBreakdown(r, {"sage": r})
    sage = PipelineConfig.model_validate({"grpo": {"group_filter": "progress", "sage": {"enabled": True}}})
    batch, _, filtered = advantages_for([chains], sage)
    # samples in rollout order: chain 0 task 1, chain 0 task 2, chain 1 task 1, ...
    assert filtered == 0.0 and [a > 0 for a in adv(batch[1::2])] == [True, False, True, False]


def _tasks():
    return {lv: [Task(id=f"t{lv}-{i}", scenario_id=f"s{lv}", level=lv, suite="train", instruction="x",
                      user_id="u", verifier=Verifier("state", {})) for i in range(3)] for lv in range(1, 6)}


def test_curriculum_starts_easy_moves_up_and_keeps_easy_tasks():
    cfg = CurriculumConfig(start_mix={1: 0.4, 2: 0.4, 3: 0.2}, window=10)
    cur = Curriculum(cfg)
    assert cur.frontier == 3 and cur.mix() == pytest.approx({1: 0.4, 2: 0.4, 3: 0.2})
    drawn = cur.sample(_tasks(), 2000, random.Random(0))
    assert {t.level for t in drawn} == {1, 2, 3}
    assert sum(t.level <= 2 for t in drawn) / 2000 == pytest.approx(0.8, abs=0.03)
    for _ in range(10):
        cur.record(3, True)
    assert cur.update() and cur.frontier == 4
    mix = cur.mix()
    assert 4 in mix and cfg.easy_fraction_min <= mix[1] <= cfg.easy_fraction_max and sum(mix.values()) == pytest.approx(1)
    for _ in range(10):
        cur.record(4, False)
    assert not cur.update() and cur.frontier == 4  # not mastered: stays
    state = json.loads(json.dumps(cur.state_dict()))
    again = Curriculum(cfg)
    again.load_state_dict(state)
    assert again.frontier == 4 and again.success(4) == 0.0 and again.mix() == mix
    cur.frontier = 5
    assert cur.mix() == pytest.approx(cfg.final_mix)


def test_curriculum_draws_each_scenario_family_of_a_level_alike_or_each_task():
    """Within a level a family of 2 tasks is practised as often as one of 30 ('scenario', the default), or in
    proportion to its tasks ('task')."""
    big = [Task(id=f"b{i}", scenario_id=f"big:u{i}", level=3, suite="practice", instruction="x") for i in range(30)]
    small = [Task(id=f"s{i}", scenario_id=f"small:u{i}", level=3, suite="practice", instruction="x") for i in range(2)]
    pool = {3: big + small}
    share = {}
    for balance in ("scenario", "task"):
        cur = Curriculum(CurriculumConfig(start_mix={3: 1.0}, balance=balance))
        drawn = cur.sample(pool, 4000, random.Random(0))
        share[balance] = sum(t.id.startswith("s") for t in drawn) / len(drawn)
    assert share["scenario"] == pytest.approx(0.5, abs=0.03) and share["task"] == pytest.approx(2 / 32, abs=0.02)


def test_validation_split_spreads_over_levels_caps_each_and_is_the_same_for_every_seed():
    from components.grpo.recipe import split_validation

    sizes = {1: 200, 2: 200, 3: 161, 4: 15, 5: 12}  # the default world's practice pool per level
    pool = [Task(id=f"p-{lv}-{i}", instruction="x", suite="practice", level=lv) for lv, n in sizes.items()
            for i in range(n)]
    train, val = split_validation(pool, 24)
    per = {lv: sum(t.level == lv for t in val) for lv in sizes}
    assert per == {1: 6, 2: 6, 3: 6, 4: 3, 5: 3} and len(train) + len(val) == len(pool)
    assert not {t.id for t in train} & {t.id for t in val}
    again = split_validation(list(reversed(pool)), 24)[1]  # a function of the pool, not of its order or the run
    assert {t.id for t in again} == {t.id for t in val}
    # within a level, over its families: a family of 5 gives 1, one of 3 (with the other small ones) none here
    fams = {"big": 40, "mid": 12, "five": 5, "three": 3}
    mixed = [Task(id=f"f-{f}-{i}", scenario_id=f"{f}:u{i}", instruction="x", suite="practice", level=3)
             for f, k in fams.items() for i in range(k)]
    held = split_validation(mixed, 6)[1]
    assert sorted(t.scenario_id.split(":")[0] for t in held) == ["big", "big", "big", "five", "mid", "mid"]
    unique = [Task(id=f"u-{i}", scenario_id=f"s{i}", instruction="x", suite="practice", level=2) for i in range(20)]
    assert len(split_validation(unique, 24)[1]) == 5  # a scenario per task: a quarter of the level, as before
    few = [Task(id=f"q-{i}", instruction="x", suite="practice", level=4) for i in range(3)]
    small = split_validation(few + pool[:8], 24)[1]  # 8 tasks at L1: a quarter of them; 3 at L4: none
    assert len(small) == 2 and all(t.level == 1 for t in small)


def test_sample_masks_and_turn_advantages():
    turns = [Turn("system", "s", tokens=[], mask=[]), Turn("user", "u", tokens=[1, 2, 3], mask=[0, 0, 0]),
             Turn("assistant", "a", tokens=[4, 5], mask=[1, 1]), Turn("tool", "o", tokens=[6], mask=[0]),
             Turn("assistant", "b", tokens=[7, 8], mask=[1, 1])]
    s = sample_from_turns(turns, [0.5, -1.0])
    assert s.ids == [1, 2, 3, 4, 5, 6, 7, 8] and s.mask == [0, 0, 0, 1, 1, 0, 1, 1]
    assert s.advantages == [0, 0, 0, 0.5, 0.5, 0, -1.0, -1.0] and s.n_agent == 4
    b = collate([s, Sample([1, 2], [0, 1], [0, 2.0])], pad_id=0)
    assert b.targets.shape == (2, 7) and b.mask[1].tolist() == [1, 0, 0, 0, 0, 0, 0]  # padding is never a target


def test_loss_on_policy_is_minus_mean_advantage_and_clips():
    torch.manual_seed(0)
    adv = torch.tensor([[1.0, -1.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    b = type("B", (), {"mask": mask, "advantages": adv})()
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    loss, st = grpo_loss(logp, logp, None, b, clip_eps=0.2, clip_eps_high=0.2, beta=0.0, aggregation="token_mean",
                         norm=3.0)
    assert float(loss) == pytest.approx(-(1 - 1 + 2) / 3) and st["clip_fraction"] == 0.0 and st["kl"] == 0.0
    # ratio 2 on a positive advantage is clipped at 1.2; on a negative one it is not
    loss, st = grpo_loss(logp + torch.log(torch.tensor(2.0)), logp, None, b, clip_eps=0.2, clip_eps_high=0.2,
                         beta=0.0, aggregation="token_mean", norm=3.0)
    assert float(loss) == pytest.approx(-(1.2 * 1 + 2 * -1 + 1.2 * 2) / 3)
    assert st["clip_fraction"] == pytest.approx(2 / 3)
    # k3 KL: 0 at the reference, > 0 away from it
    _, st = grpo_loss(logp, logp, logp - 0.5, b, clip_eps=0.2, clip_eps_high=0.2, beta=0.1, aggregation="token_mean",
                      norm=3.0)
    assert st["kl"] == pytest.approx(float(torch.exp(torch.tensor(-0.5)) + 0.5 - 1), rel=1e-5)


def test_samples_carry_the_samplers_logprobs_and_experts_have_none():
    turns = [Turn("user", "u", tokens=[1, 2], mask=[0, 0]),
             Turn("assistant", "a", tokens=[3, 4], mask=[1, 1], logprobs=[-0.5, -1.5]),
             Turn("tool", "o", tokens=[5], mask=[0])]
    s = sample_from_turns(turns, 1.0)
    assert s.behavior[2:4] == [-0.5, -1.5] and all(x != x for x in s.behavior[:2] + s.behavior[4:])  # NaN elsewhere
    expert = sample_from_turns([Turn("assistant", "", tokens=[1, 2, 3], mask=[0, 1, 1])], 1.0)  # no logprobs
    b = collate([s, expert], pad_id=0)
    assert b.behavior.shape == b.mask.shape and torch.isnan(b.behavior[1]).all()


def test_importance_weights_truncate_mask_and_leave_unknown_tokens_alone():
    # three agent targets with sampler log-probs; one row (an expert's) without
    s1 = Sample([9, 1, 2, 3], [0, 1, 1, 1], [0, 1.0, 1.0, 1.0], [0.0, -1.0, -1.0, -1.0])
    s2 = Sample([9, 1, 2, 3], [0, 1, 1, 1], [0, 1.0, 1.0, 1.0], None)
    b = collate([s1, s2], pad_id=0)
    # the learner before the update: ratios e^0 = 1, e^1.5 = 4.5 (above the cap of 2), e^-0.5 = 0.61
    old = torch.tensor([[-1.0, 0.5, -1.5], [-2.0, -2.0, -2.0]])
    w, st = importance_weights(old, b, "tis", "token", cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 2.0, float(torch.exp(torch.tensor(-0.5)))])
    assert w[1].tolist() == [1.0, 1.0, 1.0]  # unknown sampler: weight 1
    assert st["is_truncated_fraction"] == pytest.approx(1 / 6) and st["known_fraction"] == pytest.approx(0.5)
    assert st["logprob_gap"] == pytest.approx((0 + 1.5 + 0.5) / 3)
    w, _ = importance_weights(old, b, "mis", "token", cap=2.0)
    assert w[0, 1] == 0.0 and w[0, 0] == 1.0  # masked, not truncated
    w, _ = importance_weights(old, b, "tis", "sequence", cap=2.0)
    geo = float(torch.exp(torch.tensor((0 + 1.5 - 0.5) / 3)))
    assert w[0].tolist() == pytest.approx([geo] * 3)
    none, st = importance_weights(old, b, "none", "token", cap=2.0)
    assert none is None and "is_weight_mean" not in st and st["logprob_gap"] > 0
    # the weights scale the surrogate; with all ones the loss is the on-policy one
    logp = old.clone()
    base, _ = grpo_loss(logp, old, None, b, clip_eps=0.2, clip_eps_high=0.2, beta=0.0, aggregation="token_mean",
                        norm=6.0)
    ones, _ = grpo_loss(logp, old, None, b, clip_eps=0.2, clip_eps_high=0.2, beta=0.0, aggregation="token_mean",
                        norm=6.0, is_weights=torch.ones_like(old))
    half, _ = grpo_loss(logp, old, None, b, clip_eps=0.2, clip_eps_high=0.2, beta=0.0, aggregation="token_mean",
                        norm=6.0, is_weights=torch.full_like(old, 0.5))
    assert float(ones) == pytest.approx(float(base)) and float(half) == pytest.approx(float(base) / 2)


def test_micro_batches_add_up_to_the_full_batch_gradient(tiny_model_dir):
    from components.core.policy import load_policy

    policy = load_policy(str(tiny_model_dir), trainable=True)
    rng = random.Random(0)
    samples = [Sample(ids := [rng.randrange(5, 200) for _ in range(rng.randrange(6, 14))],
                      m := [0, 0] + [1] * (len(ids) - 2), [rng.uniform(-1, 1) * x for x in m]) for _ in range(4)]
    norm = float(sum(s.n_agent for s in samples))

    def grads(groups):
        policy.model.zero_grad()
        for grp in groups:
            b = collate(grp, pad_id=0)
            lp, _ = token_logprobs(policy.model, b)
            loss, _ = grpo_loss(lp, lp.detach(), None, b, clip_eps=0.2, clip_eps_high=0.2, beta=0.0,
                                aggregation="token_mean", norm=norm)
            loss.backward()
        return torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])

    whole, parts = grads([samples]), grads([samples[:1], samples[1:3], samples[3:]])
    assert torch.allclose(whole, parts, atol=1e-6)


def test_logprobs_are_those_of_the_sampling_temperature(tiny_model_dir):
    """Rollouts sampled at temperature T: the ratio and the KL use log softmax(logits / T), as TRL does."""
    from components.core.policy import load_policy

    policy = load_policy(str(tiny_model_dir))
    b = collate([Sample([5, 9, 17, 33, 60, 71], [0, 0, 1, 1, 1, 1], [1.0] * 6)], pad_id=0)
    with torch.no_grad():
        logits = policy.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
        lp1, _ = token_logprobs(policy.model, b)
        lp7, _ = token_logprobs(policy.model, b, temperature=0.7)
    expect = torch.log_softmax(logits / 0.7, -1).gather(-1, b.targets[..., None])[..., 0]
    assert torch.allclose(lp7, expect, atol=1e-6)
    assert not torch.allclose(lp1, lp7, atol=1e-3)


def test_monitor_alarms():
    mon = CollapseMonitor(CollapseMonitorConfig())
    assert mon.check({"format_error_rate": 0.0, "entropy": 1.0, "kl": 0.01, "zero_variance_groups": 0.2}) == []
    assert mon.control_ratio(0.8, None) == 1.0  # the first measurement is the SFT baseline
    assert mon.control_ratio(0.2, None) == pytest.approx(0.25)
    alarms = mon.check({"control_prob_ratio": 0.25, "format_error_rate": 0.9, "entropy": 0.0, "kl": 5.0,
                        "zero_variance_groups": 1.0})
    assert alarms == ["control_prob", "format_error", "entropy", "kl", "zero_variance"]
    assert mon.state_dict()["alarms_total"]["kl"] == 1


def test_entropy_alarm_is_relative_to_the_incoming_policy():
    # a sharp SFT model (the tiny one's entropy is 0.01-0.04) is not a collapse; halving its entropy is
    mon = CollapseMonitor(CollapseMonitorConfig(entropy_drop=0.5))
    assert mon.check({"entropy": 0.03}) == [] and mon.check({"entropy": 0.02}) == []
    assert mon.check({"entropy": 0.01}) == ["entropy"]
    again = CollapseMonitor(CollapseMonitorConfig(entropy_drop=0.5))  # a resumed run keeps the baseline
    again.load_state_dict(mon.state_dict())
    assert again.check({"entropy": 0.012}) == ["entropy"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_checkpoints_are_atomic_and_pruned(tmp_path, where, request):
    root = str(tmp_path / "ckpt") if where == "local" else f"s3://{request.getfixturevalue('bucket')}/run/grpo"
    ck = Checkpoints(root, staging=tmp_path / "staging", keep=2)
    assert ck.latest() is None
    for step in (1, 2, 3):
        ck.save(step, lambda d, n=step: (d / "weights.bin").write_bytes(b"w" * n), {"run_id": "r", "x": step})
    assert [s for s, _ in ck.complete()] == [2, 3]  # the oldest went
    # a half-written newer checkpoint (no manifest) is ignored
    from components.core import storage

    storage.write_bytes(storage.join(root, "step-00000009", "weights.bin"), b"partial")
    step, uri = ck.latest()
    assert step == 3
    local, state = ck.fetch(uri)
    assert state == {"step": 3, "run_id": "r", "x": 3} and (local / "weights.bin").read_bytes() == b"www"
