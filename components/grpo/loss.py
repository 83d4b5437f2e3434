"""Episodes -> padded token batches, and the clipped GRPO objective on agent tokens only.

Written by hand because the unit is a whole multi-turn episode: observations sit between agent turns
and must be context but never targets, and each agent turn may carry its own advantage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    ids: list[int]
    mask: list[int]  # 1 = an agent token (trained on)
    advantages: list[float]  # per token (0 where mask is 0)
    behavior: list[float] | None = None  # the sampler's log-prob of each token (NaN where unknown: an expert's)

    @property
    def n_agent(self) -> int:
        return sum(self.mask)


def sample_from_turns(turns, turn_advantages: list[float] | float) -> Sample:
    """One episode's tokens from its turns; `turn_advantages` is one number per agent turn, or one for all."""
    ids: list[int] = []
    mask: list[int] = []
    adv: list[float] = []
    behavior: list[float] = []
    k = 0
    for t in turns:
        toks = list(t.tokens or [])
        m = list(t.mask or [0] * len(toks))
        if t.role == "assistant":
            a = turn_advantages if isinstance(turn_advantages, (int, float)) else turn_advantages[k]
            k += 1
        else:
            a = 0.0
        ids += toks
        mask += m
        adv += [float(a) if x else 0.0 for x in m]
        lps = list(t.logprobs or []) if t.role == "assistant" else []
        behavior += lps if len(lps) == len(toks) else [math.nan] * len(toks)
    return Sample(ids, mask, adv, behavior)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor
    targets: torch.Tensor  # (B, T-1): input_ids shifted
    mask: torch.Tensor  # (B, T-1) float: 1 on agent targets
    advantages: torch.Tensor  # (B, T-1)
    behavior: torch.Tensor  # (B, T-1): the sampler's log-prob of each target (NaN where unknown)

    def to(self, device) -> Batch:
        return Batch(*(x.to(device) for x in (self.input_ids, self.attention_mask, self.targets, self.mask,
                                               self.advantages, self.behavior)))


def collate(samples: list[Sample], pad_id: int) -> Batch:
    width = max(len(s.ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.float32)
    adv = torch.zeros((B, width), dtype=torch.float32)
    beh = torch.full((B, width), math.nan, dtype=torch.float32)
    for r, s in enumerate(samples):
        n = len(s.ids)
        ids[r, :n] = torch.tensor(s.ids)
        attn[r, :n] = 1
        mask[r, :n] = torch.tensor(s.mask, dtype=torch.float32)
        adv[r, :n] = torch.tensor(s.advantages, dtype=torch.float32)
        if s.behavior is not None:
            beh[r, :n] = torch.tensor(s.behavior, dtype=torch.float32)
    # position t predicts token t+1: the targets and their masks move one to the left
    return Batch(ids, attn, ids[:, 1:], mask[:, 1:], adv[:, 1:], beh[:, 1:])


def importance_weights(old_logp: torch.Tensor, batch: Batch, mode: str, level: str, cap: float):
    """Weights pi_old/pi_sampler for a batch sampled by another policy (an older one, or another engine), and what
    they did. `old_logp`: the learner's log-probs before this step's update (detached). 'tis' truncates a weight at
    `cap`; 'mis' gives a weight above `cap` zero (its token no gradient). `level='sequence'`: one weight per episode,
    the geometric mean of its tokens' ratios. Tokens without a sampler log-prob (an expert's) get weight 1.
    Returns (weights (B, T-1), stats); weights is None for mode 'none'."""
    m = batch.mask
    known = ~torch.isnan(batch.behavior) & (m > 0)
    diff = torch.where(known, old_logp - torch.nan_to_num(batch.behavior), torch.zeros_like(old_logp))
    n_known = known.sum().clamp(min=1)
    stats = {"logprob_gap": float(diff.abs().sum() / n_known), "known_fraction": float(known.sum() / m.sum().clamp(min=1))}
    if mode == "none":
        return None, stats
    if level == "sequence":
        per_seq = diff.sum(-1) / known.sum(-1).clamp(min=1)
        raw = torch.exp(per_seq)[:, None].expand_as(diff)
    else:
        raw = torch.exp(diff)
    raw = torch.where(known, raw, torch.ones_like(raw))
    over = (raw > cap) & known
    w = torch.clamp(raw, max=cap) if mode == "tis" else torch.where(over, torch.zeros_like(raw), raw)
    stats.update({"is_weight_mean": float((w * m).sum() / m.sum().clamp(min=1)),
                  "is_weight_max": float((raw * m).max()) if m.any() else 1.0,
                  "is_truncated_fraction": float((over.float() * m).sum() / m.sum().clamp(min=1))})
    return w.detach(), stats


def token_logprobs(model, batch: Batch, with_entropy: bool = False, temperature: float = 1.0):
    """log p(target) at every position (B, T-1); with the mean entropy on agent targets if asked.
    `temperature`: the rollouts' sampling temperature, so the ratio and the KL are those of the policy that
    sampled (logits / T, as TRL's GRPOTrainer does); supervised losses keep 1."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.targets[..., None])[..., 0]
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)
        entropy = (ent * batch.mask).sum() / batch.mask.sum().clamp(min=1)
    return logp, entropy


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, batch: Batch, *,
              clip_eps: float, clip_eps_high: float, beta: float, aggregation: str, norm: float,
              is_weights: torch.Tensor | None = None):
    """Clipped surrogate (PPO/GRPO) minus beta x k3 KL, on agent tokens; returns (loss, stats).

    `norm` makes micro-batches add up to the mean over the whole step batch: the step's agent-token count
    for token_mean, its number of sequences for seq_mean. `is_weights` (from `importance_weights`): the
    decoupled objective of an off-policy batch — the clip stays around the learner's pre-update policy `old_logp`
    (the proximal policy), and the weight corrects from there to the policy that sampled.
    """
    m = batch.mask
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * batch.advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * batch.advantages
    per_token = -torch.min(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights
    kl = None
    if ref_logp is not None and beta > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1  # k3: unbiased, always >= 0 (Schulman, 2020)
        per_token = per_token + beta * kl
    if aggregation == "token_mean":
        loss = (per_token * m).sum() / norm
    else:  # seq_mean: each sequence's token mean, then the mean over sequences
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / norm
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        is_clipped = ((ratio < 1 - clip_eps) & (batch.advantages < 0)) | ((ratio > 1 + clip_eps_high) & (batch.advantages > 0))
        stats = {"clip_fraction": float((is_clipped.float() * m).sum() / n),
                 "kl": float((kl * m).sum() / n) if kl is not None else 0.0,
                 "ratio_mean": float((ratio * m).sum() / n)}
    return loss, stats


def nll_loss(logp: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Supervised loss on agent tokens (the repair SFT steps)."""
    return -(logp * batch.mask).sum() / batch.mask.sum().clamp(min=1)


def control_prob(logp: torch.Tensor, batch: Batch, control_ids: set[int]) -> tuple[float, float]:
    """(sum of p(control token), count) at agent positions whose target is a control token."""
    sel = torch.zeros_like(batch.mask, dtype=torch.bool)
    for i in control_ids:
        sel |= batch.targets == i
    sel &= batch.mask > 0
    return float(logp.detach().exp()[sel].sum()), float(sel.sum())
