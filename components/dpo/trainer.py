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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.core import storage
from components.core.checkpoint import TrainerCheckpoints, phase_root, train_or_resume
from components.core.policy import load_policy, save_policy, trainable_lora
from components.core.schema import ModelCard, PreferencePair, write_jsonl
from components.core.tracking import phase_run, setup_phase
from components.dpo.pairs import PairBuilder, pairs_from_ab, pairs_from_rollouts, read_ab_logs, split_pairs

PHASE = "dpo"
SIMULATED = "ab_logs"  # the stage a retry reuses: the simulated A/B logs
STAGE_STATE = "stage.json"


@dataclass
class DPOResult:
    parent_run_id: str
    run_id: str
    model_dir: str
    model_uri: str
    metrics: dict[str, float] = field(default_factory=dict)


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

    from components.sft.trainer import _callbacks, deepspeed_config

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
    callbacks = _callbacks(tracker, None, "train/", resumed=resumed)
    if checkpoints is not None:
        callbacks.append(checkpoints.callback(lambda: {"run_id": getattr(tracker, "run_id", None),
                                                       "parent_run_id": getattr(tracker, "parent_run_id", None)}))
    pad = policy.tokenizer.pad_token_id
    trainer = AgentDPOTrainer(
        model=policy.model, ref_model=None, args=args, train_dataset=_dataset(train),
        eval_dataset=_dataset(heldout) if heldout else None, processing_class=policy.tokenizer,
        data_collator=Collator(pad_token_id=pad, max_length=d.max_length),
        callbacks=callbacks,
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
def run(
    preset: str = "tiny",
    overrides: str = "",
    policy_model: str = "",
    champion_model: str = "",
    ab_logs: str = "",
    world: str = "",
    tasks_dir: str = "",
    parent_run_id: str | None = None,
    model_out: str | None = None,
) -> DPOResult:
    cfg, home, storage_root = setup_phase(preset, overrides)  # validated before any work
    if not policy_model:
        raise ValueError("dpo: no incoming policy (policy_model) to start from")
    from components.evaluation.evaluate import quick_eval
    from components.sandbox.suites import load_sandbox, world_beside

    # a KFP retry of this step reuses the A/B logs an earlier attempt simulated and resumes its training
    ckpts = TrainerCheckpoints(phase_root(storage_root, parent_run_id, PHASE, cfg.dpo.checkpoint_uri),
                               home / "staging" / PHASE / (parent_run_id or "standalone"), cfg.dpo.checkpoint_every,
                               cfg.dpo.keep_checkpoints, cfg.dpo.resume)
    logs_uri = cfg.dpo.ab_logs_uri or ab_logs
    simulated = ckpts.store.stage(SIMULATED) if cfg.dpo.resume and not logs_uri else None
    prior = json.loads((simulated / STAGE_STATE).read_text()) if simulated is not None else ckpts.state
    with phase_run(PHASE, config=cfg, parent_run_id=parent_run_id or prior.get("parent_run_id") or None,
                   close_parent=False, resume_run_id=prior.get("run_id")) as tracker:
        work = Path(os.environ.get("AGENTRL_DPO_WORKDIR") or home / "runs" / tracker.run_id / PHASE)
        work.mkdir(parents=True, exist_ok=True)
        world = world_beside(tasks_dir, world) or ""
        if simulated is not None:  # simulated by an earlier attempt (its metrics are logged already)
            logs_uri = str(simulated / "simulated.jsonl")
            tracker.set_tags({"agentrl.dpo.resumed": "the simulated A/B logs of an earlier attempt"})
        elif not logs_uri:  # the embedded default: simulate the deployment in the sandbox
            from components.dpo.simulator import simulate_ab

            sandbox = load_sandbox(cfg, world or None, tasks_dir or None)
            champion, variant_a = champion_model, "given"
            if not champion:  # A is what serves today: the registry's champion; before the first promotion, none
                from components.core.tracking import Registry

                found = Registry(getattr(tracker, "tracking_uri", None), cfg.tracking.registered_model).download(
                    "champion", work / "champion")
                champion, variant_a = (found[0], f"champion version {found[1]}") if found else (
                    policy_model, "the candidate itself (no champion yet)")
            tracker.set_tags({"agentrl.dpo.variant_a": variant_a})
            pa = load_policy(champion, cache=home / "cache")
            pb = load_policy(policy_model, cache=home / "cache")
            sim_dir = work / SIMULATED
            logs_uri = str(sim_dir / "simulated.jsonl")
            sim = simulate_ab(pa, champion, pb, policy_model, cfg, sandbox, logs_uri)
            tracker.log_metrics({f"ab_sim/{k}": v for k, v in sim.items()}, step=0)
            (sim_dir / STAGE_STATE).write_text(json.dumps(
                {"run_id": tracker.run_id, "parent_run_id": tracker.parent_run_id, "stats": sim}, indent=1))
            ckpts.store.put_stage(SIMULATED, sim_dir)
            del pa, pb
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
        write_jsonl(work / "pairs" / "train.jsonl", train)
        write_jsonl(work / "pairs" / "heldout.jsonl", heldout)

        policy = load_policy(policy_model, dtype="bfloat16" if cfg.sft.bf16 else "float32", trainable=True,
                             cache=home / "cache")
        if cfg.model.lora.enabled:
            policy = trainable_lora(policy, cfg.model.lora)
        stats = train_dpo(policy, train, heldout, cfg, work / "trainer", tracker, use_cpu=cfg.run.torch_device() != "cuda",
                          checkpoints=ckpts)
        stats.update({"pairs_train": float(len(train)), "pairs_heldout": float(len(heldout))})
        out = Path(model_out) if model_out else work / "model"
        card = ModelCard(base_model=policy_model, phase=PHASE, parent_run_id=tracker.parent_run_id,
                         run_id=tracker.run_id, extra={"ab_logs": logs_uri, "lora": cfg.model.lora.enabled})
        save_policy(policy, out, card, merge=False)
        # no safety regression allowed: the same greedy safety suite for the incoming and the new policy (the
        # other suites are the evaluation phase's, which takes this model next)
        before = quick_eval(policy_model, cfg, tasks_dir or None, ["safety"], world or None)
        after = quick_eval(str(out), cfg, tasks_dir or None, ["safety"], world or None)
        stats.update({f"incoming/{k}": v for k, v in before.items()})
        stats.update(after)
        stats["safety_regression"] = float(after["safety/safety_violation_rate"]
                                            > before["safety/safety_violation_rate"])
        tracker.log_metrics(stats, step=int(stats["train_steps"]))
        card.metrics = {k: float(v) for k, v in stats.items()}
        uri = tracker.store_model(out, storage_root, card)
        storage.put_dir(work / "pairs", tracker.storage_uri(storage_root, "pairs"))
        return DPOResult(tracker.parent_run_id, tracker.run_id, str(out), uri, stats)
