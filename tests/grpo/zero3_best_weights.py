"""Run by test_distributed under torchrun (2 CPU processes, gloo): the best model's trainable tensors saved from
ZeRO-3 shards, the shards trained away from them, then loaded back into the shards (`_load_trainable(sharded=True)`):
the gathered weights must equal the saved ones. argv: model dir, work dir. DeepSpeed's CPU accelerator
(DS_ACCELERATOR=cpu) stands in for the GPUs: `Accelerator(cpu=True)` would leave DeepSpeed out."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

from components.core.config import GRPOConfig
from components.core.phase import leave_process_group
from components.core.policy import load_policy
from components.core.tracking import rank
from components.grpo.recipe import _ds_config, _load_trainable, _save_trainable


def main(model_dir: str, work: str) -> None:
    g = GRPOConfig(deepspeed="zero3", micro_batch_size=1)
    conf = _ds_config(g)
    conf["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even the tiny model's tensors
    acc = Accelerator(cpu=False, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=conf))
    model = load_policy(model_dir).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    best = Path(work) / "best"
    _save_trainable(acc, model, best)
    acc.wait_for_everyone()
    saved = torch.load(best / "trainable.pt", map_location="cpu")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    for _ in range(2):  # move the shards away from the saved weights
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    moved = acc.get_state_dict(model)  # a collective gather: the main process gets the tensors, the others None
    if rank() == 0:
        assert any(not torch.equal(moved[n], saved[n]) for n in saved), "training did not move the weights"
    shapes = {tuple(p.shape) for p in acc.unwrap_model(model).parameters()}
    assert shapes == {(0,)}, f"ZeRO-3 left whole tensors in the module: {sorted(shapes)[:3]}"
    _load_trainable(acc.unwrap_model(model), saved, sharded=True)
    back = acc.get_state_dict(model)
    if rank() == 0:
        bad = [n for n in saved if not torch.equal(back[n], saved[n])]
        assert not bad, f"not restored: {bad[:3]}"
        print(f"restored {len(saved)} tensors on {torch.distributed.get_world_size()} processes")


if __name__ == "__main__":
    try:
        main(*sys.argv[1:3])
    finally:
        # as the phases' entry point does: a rank left to the interpreter's teardown with its gloo/DeepSpeed threads
        # alive can abort ("terminate called without an active exception": rank 1 of this script in CI, 2026-12-07)
        leave_process_group()
