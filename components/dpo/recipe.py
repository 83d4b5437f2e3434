"""DPO from A/B data, top to bottom (TRL's DPOTrainer does the optimisation).

1. Resolve the config; open the phase run.
2. A/B logs: `dpo.ab_logs_uri` (production: JSONL files on S3), or — embedded default — simulated in the
   sandbox (simulator.py): variant A the incoming champion, variant B the candidate.
3. Read them strictly (a malformed line is an error naming file:line) or, with `dpo.skip_invalid`,
   skip and count malformed lines; build preference pairs (pairs.py) and split them by task into
   train and held-out.
4. DPO with the incoming policy as the reference, loss on the agent's own tokens only: TRL tokenises
   a multi-turn completion whole, so the observations between agent turns would count as completion;
   `AgentDPOTrainer` masks them with the chat template's generation marks (the same marks SFT uses).
5. Held-out implicit-reward accuracy (TRL's `rewards/accuracies` on pairs never trained on), and the
   safety suite before and after: a safety regression is reported, never hidden.
6. Save the model, its pairs and metrics under the run's prefix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Unpack

from components.core.checkpoint import TrainerCheckpoints, train_or_resume
from components.core.env import pick_suites
from components.core.phase import PhaseContext, PhaseResult, Places
from components.core.policy import save_policy
from components.core.schema import PreferencePair, write_jsonl
from components.dpo.pairs import PairBuilder, pairs_from_ab, pairs_from_rollouts, read_ab_logs, split_pairs

PHASE = "dpo"
SIMULATED = "ab_logs"  # the stage a retry reuses: the simulated A/B logs
STAGE_STATE = "stage.json"


# ----------------------------------------------------------------------------------------------
# Agent-token masks on top of TRL
# ----------------------------------------------------------------------------------------------
def tokenize_pair(tokenizer: Any, prompt: list[dict], chosen: list[dict], rejected: list[dict]) -> dict[str, list[int]]:
    """prompt_ids + chosen/rejected ids and their agent masks (1 on the completion's assistant tokens only), from the
    template's incremental rendering (`core.tokens`)."""
    from components.core.tokens import encode_messages

    sides = {name: encode_messages(tokenizer, prompt + completion, train_from=len(prompt))
             for name, completion in (("chosen", chosen), ("rejected", rejected))}
    # the completion starts where the two sides part, at the latest at the first agent token of either
    (a, ma), (b, mb) = sides["chosen"], sides["rejected"]
    n = min(ma.index(1), mb.index(1))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    out: dict[str, list[int]] = {"prompt_ids": a[:k]}
    for name, (ids, mask) in sides.items():
        out[f"{name}_ids"], out[f"{name}_mask"] = ids[k:], mask[k:]
    return out


def _trainer_classes():
    import torch
    from trl import DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    class AgentTokenCollator(DataCollatorForPreference):
        """TRL's preference collator, with the completion mask narrowed to the agent's tokens."""

        def torch_call(self, examples):
            out = super().torch_call(examples)
            rows = [[0] * len(e["prompt_ids"]) + list(e["chosen_mask"]) for e in examples]
            rows += [[0] * len(e["prompt_ids"]) + list(e["rejected_mask"]) for e in examples]
            mask = torch.zeros_like(out["completion_mask"])
            width = mask.shape[1]
            for i, r in enumerate(rows):
                r = r[: self.max_length or width][:width]
                mask[i, : len(r)] = torch.tensor(r, dtype=mask.dtype)
            out["completion_mask"] = mask
            return out

    class AgentDPOTrainer(DPOTrainer):
        """DPOTrainer whose dataset carries agent masks (tokenised here, with the chat template's marks)."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            tok = getattr(processing_class, "tokenizer", processing_class)
            dataset = dataset.map(lambda ex: tokenize_pair(tok, ex["prompt"], ex["chosen"], ex["rejected"]),
                                  remove_columns=dataset.column_names, desc=f"Tokenizing {dataset_name} pairs")
            if args.max_length is not None:
                dataset = dataset.filter(lambda ex: len(ex["prompt_ids"]) < args.max_length)
            return dataset

        def _set_signature_columns_if_needed(self):
            if self._signature_columns is None:
                self._signature_columns = ["prompt_ids", "chosen_ids", "rejected_ids", "chosen_mask",
                                           "rejected_mask", "ref_chosen_logps", "ref_rejected_logps"]

    return AgentDPOTrainer, AgentTokenCollator


def _dataset(pairs: list[PreferencePair]):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in pairs])


def train_dpo(policy: Any, train: list[PreferencePair], heldout: list[PreferencePair], cfg, out_dir: Path,
              tracker=None, use_cpu: bool = True, checkpoints: TrainerCheckpoints | None = None) -> dict[str, float]:
    """DPO on `train` (the reference is a frozen copy of the incoming policy); held-out metrics before/after.
    With `checkpoints`, checkpoints are published as the Trainer saves them and a newer one is resumed from."""
    from trl import DPOConfig as TRLDPOConfig

    from components.core.training import callbacks, deepspeed_config

    d = cfg.dpo
    AgentDPOTrainer, Collator = _trainer_classes()
    args = TRLDPOConfig(
        output_dir=str(out_dir), beta=d.beta, learning_rate=d.learning_rate,
        loss_type=[d.loss_type, "sft"] if d.sft_weight else [d.loss_type], label_smoothing=d.label_smoothing,
        loss_weights=[1.0, d.sft_weight] if d.sft_weight else None, num_train_epochs=d.epochs,
        # eval one pair per batch: TRL logs the mean of per-batch means, which weighs a short last batch's pairs
        # more (10 held-out pairs at 8 a batch: 0.438 where 4/10 are right); 1 a batch makes them per-pair means
        per_device_train_batch_size=d.batch_size, per_device_eval_batch_size=1, max_length=d.max_length,
        logging_steps=1, report_to="none", use_cpu=use_cpu, seed=cfg.run.seed,
        data_seed=cfg.run.seed, bf16=cfg.sft.bf16, gradient_checkpointing=cfg.sft.gradient_checkpointing,
        deepspeed=deepspeed_config(d.deepspeed, cfg.sft.bf16), dataloader_num_workers=0, lr_scheduler_type="cosine",
        warmup_steps=0.1, disable_tqdm=False, **(checkpoints.trainer_args() if checkpoints else {"save_strategy": "no"}),
    )
    resumed = checkpoints is not None and checkpoints.resume_from() is not None
    cbs = callbacks(tracker, None, "train/", resumed=resumed)
    if checkpoints is not None:
        cbs.append(checkpoints.callback(lambda: {"run_id": getattr(tracker, "run_id", None),
                                                       "parent_run_id": getattr(tracker, "parent_run_id", None)}))
    pad = policy.tokenizer.pad_token_id
    trainer = AgentDPOTrainer(
        model=policy.model, ref_model=None, args=args, train_dataset=_dataset(train),
        eval_dataset=_dataset(heldout) if heldout else None, processing_class=policy.tokenizer,
        data_collator=Collator(pad_token_id=pad, max_length=d.max_length),
        callbacks=cbs,
    )
    stats: dict[str, float] = {}
    if heldout:
        stats.update({f"heldout_before/{k.removeprefix('eval_')}": float(v)
                      for k, v in trainer.evaluate().items() if isinstance(v, (int, float))})
    loss, steps, resumed_from = train_or_resume(trainer, checkpoints)
    stats.update({"train_loss": float(loss), "train_steps": float(steps), "resumed_from": float(resumed_from)})
    if heldout:
        stats.update({f"heldout/{k.removeprefix('eval_')}": float(v)
                      for k, v in trainer.evaluate().items() if isinstance(v, (int, float))})
    policy.model.eval()
    return stats


# ----------------------------------------------------------------------------------------------
# The phase
# ----------------------------------------------------------------------------------------------
def run(preset: str = "tiny", overrides: str = "", policy_model: str = "", champion_model: str = "",
        ab_logs: str = "", **places: Unpack[Places]) -> PhaseResult:
    ctx = PhaseContext.setup(PHASE, preset, overrides, incoming=policy_model, **places)  # validated before any work
    cfg = ctx.cfg
    # a KFP retry of this step reuses the A/B logs an earlier attempt simulated and resumes its training
    ckpts = ctx.trainer_checkpoints(cfg.dpo.checkpoint_every, cfg.dpo.keep_checkpoints, cfg.dpo.resume,
                                    cfg.dpo.checkpoint_uri)
    logs_uri = cfg.dpo.ab_logs_uri or ab_logs
    simulated = ckpts.store.stage(SIMULATED) if cfg.dpo.resume and not logs_uri else None
    prior = json.loads((simulated / STAGE_STATE).read_text()) if simulated is not None else ckpts.state
    with ctx.open(resume=prior) as tracker:
        # 2. the A/B logs
        if simulated is not None:  # simulated by an earlier attempt (its metrics are logged already)
            logs_uri = str(simulated / "simulated.jsonl")
            tracker.set_tags({"agentrl.dpo.resumed": "the simulated A/B logs of an earlier attempt"})
        elif not logs_uri:  # the embedded default: simulate the deployment in the environment
            logs_uri = simulate(ctx, ckpts.store, policy_model, champion_model)
        # 3. pairs
        records, report = read_ab_logs(logs_uri, cfg.dpo.skip_invalid)
        tracker.log_metrics({"ab/records": float(report["read"]), "ab/skipped_lines": float(report["skipped"])}, step=0)
        builder: PairBuilder = pairs_from_ab(records, cfg.dpo)
        if cfg.dpo.rollout_pairs:
            pairs_from_rollouts(builder, [r.trajectory for r in records])
        tracker.log_metrics({f"pairs/{k}": float(v) for k, v in builder.stats.items()}, step=0)
        train, heldout = split_pairs(builder.pairs, cfg.dpo.heldout_fraction, cfg.run.seed)
        if len(train) < cfg.dpo.min_pairs:
            raise ValueError(f"dpo: {len(train)} training pairs from {logs_uri} (dpo.min_pairs={cfg.dpo.min_pairs}); "
                             f"filter counts: {dict(builder.stats)}")
        pairs_dir = ctx.work / "pairs"
        write_jsonl(pairs_dir / "train.jsonl", train)
        write_jsonl(pairs_dir / "heldout.jsonl", heldout)

        # 4-5. DPO, held-out pair accuracy
        policy = ctx.load_policy(policy_model)
        stats = train_dpo(policy, train, heldout, cfg, ctx.work / "trainer", tracker,
                          use_cpu=cfg.run.torch_device() != "cuda", checkpoints=ckpts)
        stats.update({"pairs_train": float(len(train)), "pairs_heldout": float(len(heldout))})
        out = ctx.out
        card = ctx.card(policy_model, ab_logs=logs_uri, lora=cfg.model.lora.enabled)
        save_policy(policy, out, card, merge=False)
        # no safety regression allowed: the same greedy safety suite for the incoming and the new policy (the
        # other suites are the evaluation phase's, which takes this model next)
        safety = pick_suites(ctx.environment(), ["safety"], fallback=False)  # an environment may have none
        stats.update(ctx.before_after(policy_model, str(out), safety) if safety else {})
        if safety:
            stats["safety_regression"] = float(stats["safety/safety_violation_rate"]
                                                > stats["incoming/safety/safety_violation_rate"])
        tracker.log_metrics(stats, step=int(stats["train_steps"]))
        card.metrics = {k: float(v) for k, v in stats.items()}
        return ctx.finish(out, card, stats, stored={"pairs": pairs_dir})


def simulate(ctx: PhaseContext, store: Any, policy_model: str, champion_model: str = "") -> str:
    """The embedded default's A/B logs: a simulated deployment in the environment, variant A the model that serves
    today (`champion_model`, or the registry's champion; before the first promotion, the candidate itself) and
    variant B the candidate. Published to `store` as a stage a retry reuses; returns the logs' path."""
    from components.core.policy import load_policy
    from components.core.tracking import Registry
    from components.dpo.simulator import simulate_ab

    cfg, tracker = ctx.cfg, ctx.tracker
    champion, variant_a = champion_model, "given"
    if not champion:
        found = Registry(getattr(tracker, "tracking_uri", None), cfg.tracking.registered_model).download(
            "champion", ctx.work / "champion")
        champion, variant_a = (found[0], f"champion version {found[1]}") if found else (
            policy_model, "the candidate itself (no champion yet)")
    tracker.set_tags({"agentrl.dpo.variant_a": variant_a})
    pa = load_policy(champion, cache=ctx.home / "cache")
    pb = load_policy(policy_model, cache=ctx.home / "cache")
    sim_dir = ctx.work / SIMULATED
    logs_uri = str(sim_dir / "simulated.jsonl")
    sim = simulate_ab(pa, champion, pb, policy_model, cfg, ctx.environment(), logs_uri)
    tracker.log_metrics({f"ab_sim/{k}": v for k, v in sim.items()}, step=0)
    (sim_dir / STAGE_STATE).write_text(json.dumps(
        {"run_id": tracker.run_id, "parent_run_id": tracker.parent_run_id, "stats": sim}, indent=1))
    store.put_stage(SIMULATED, sim_dir)
    return logs_uri
