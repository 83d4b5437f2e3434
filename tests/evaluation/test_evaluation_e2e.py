"""Evaluation on real episodes: deterministic greedy numbers, and the gate moving registry aliases."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from components.core.config import load_config
from components.core.evaluate import evaluate_policy
from components.core.policy import load_policy
from components.core.tiny import build_tiny_model
from components.core.tracking import PhaseRun, Registry
from components.evaluation.gate import decide
from components.evaluation.recipe import register_candidate
from components.sandbox.expert import render_json
from components.sandbox.suites import load_sandbox
from tests.helpers.scripted import ScriptedBackend, code_script, expert_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    cfg = load_config(overrides_json=json.dumps({
        "run": {"home": str(home)}, "sandbox": {"max_turns": 4}, "generation": {"max_new_tokens": 24},
        "eval": {"pass_k": 2, "bootstrap_samples": 100}, "model": {"tiny": {"pretrain_steps": 0}}}))
    sandbox = load_sandbox(cfg)
    model = build_tiny_model(home / "tiny", cfg.model.tiny, seed=0)
    return cfg, sandbox, str(model)


def test_untrained_base_scores_zero_and_greedy_is_deterministic(setup):
    cfg, sandbox, model = setup
    pol = load_policy(model)
    a = evaluate_policy(pol, cfg, sandbox, ["easy", "safety"], max_tasks=8, progress=False)
    b = evaluate_policy(pol, cfg, sandbox, ["easy", "safety"], max_tasks=8, progress=False)
    assert a["metrics"] == b["metrics"]
    assert a["metrics"]["easy"]["tgc"]["value"] == 0.0
    assert [t.turns[2].text for t in a["trajectories"]["easy"]] == [t.turns[2].text for t in b["trajectories"]["easy"]]


def _unsafe_script(sandbox):
    owner_mail = {}
    for m in sandbox.world.mail.values():
        owner_mail.setdefault(m["owner"], m["id"])

    def script(prompt: str) -> str:
        user = re.search(r"You are (\w+)'s assistant", prompt).group(1)
        if "<|tool|>" in prompt:
            return render_json("Done.", "finish", {})
        return render_json("I will clean up for good.", "mail.delete", {"ids": [owner_mail[user]], "permanent": True})

    return script


def _idle_script(prompt: str) -> str:
    return render_json("Nothing to do.", "finish", {})


def test_gate_promotes_improvements_refuses_unsafe_and_moves_aliases(setup):
    cfg, sandbox, model = setup
    cfg = cfg.model_copy(update={"sandbox": cfg.sandbox.model_copy(update={"max_turns": 12})})
    sandbox = dataclasses.replace(sandbox, config=cfg)  # its episodes run with the longer limit too
    pol = load_policy(model)
    registry = Registry(PhaseRun("eval", config=cfg).tracking_uri, cfg.tracking.registered_model)

    def evaluate_and_gate(script):
        res = evaluate_policy(pol, cfg, sandbox, ["easy", "hard", "safety", "robustness"], max_tasks=6, progress=False,
                              backend=ScriptedBackend(pol.tokenizer, script))
        champ = registry.get_alias("champion")
        base = json.loads(champ.tags["metrics"]) if champ is not None else None
        decision = decide(res["metrics"], base, cfg.eval.gate)
        with PhaseRun("eval", config=cfg) as tracker:
            mv = register_candidate(tracker, registry, model, res["metrics"], decision, promote=True)
            registry.client.set_model_version_tag(registry.name, mv.version, "metrics", json.dumps(res["metrics"]))
        return res["metrics"], decision, mv

    idle, d1, v1 = evaluate_and_gate(_idle_script)
    assert idle["easy"]["tgc"]["value"] == 0.0 and d1.promote  # safe, and there was no champion yet
    assert registry.get_alias("champion").version == v1.version

    good, d2, v2 = evaluate_and_gate(expert_script(sandbox))
    assert good["hard"]["tgc"]["value"] == 1.0 and good["safety"]["safety_violation_rate"]["value"] == 0.0
    assert d2.promote and registry.get_alias("champion").version == v2.version

    bad, d3, v3 = evaluate_and_gate(_unsafe_script(sandbox))
    assert bad["safety"]["safety_violation_rate"]["value"] == 1.0
    assert not d3.promote and any("safety violation rate" in r for r in d3.reasons)
    assert registry.get_alias("champion").version == v2.version  # the champion did not move
    assert registry.get_alias("challenger").version == v3.version


def test_report_embeds_its_plots(setup):
    import base64

    from components.evaluation.gate import Decision
    from components.evaluation.report import render_report

    cfg, sandbox, model = setup
    pol = load_policy(model)
    res = evaluate_policy(pol, cfg, sandbox, ["easy", "hard"], max_tasks=3, pass_k=1, progress=False,
                          backend=ScriptedBackend(pol.tokenizer, expert_script(sandbox)))
    progress = {"sft": {"easy/tgc": 0.1}, "grpo": {"easy/tgc": 0.3, "hard/tgc": 0.1}, "eval": {"easy/tgc": 0.3}}
    html = render_report(res, res, Decision(True, ["promoted to champion"]), "champion (version 1)",
                         {"easy/tgc": 0.0}, progress)
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(imgs) == 5 and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in imgs)
    assert "PROMOTE to champion" in html and "easy: solved" in html
    assert "Learning from phase to phase" in html and html.index(">sft<") < html.index(">grpo<")
    # per level, per suite: the hard suite's levels apart, the scripted expert solving each (candidate [baseline])
    assert "TGC per level, per suite" in html
    hard_levels = sorted(res["levels"]["hard"])
    assert hard_levels and min(hard_levels) >= 3 and "1.000 [1.000]" in html


def test_chains_carry_the_skill_library_so_reuse_is_measured(setup):
    from components.core.evaluate import scenario_chains

    cfg, sandbox, model = setup
    tasks = sandbox.suites["easy"]
    chains = scenario_chains(tasks, 2)
    assert sorted(t.id for ch in chains for t in ch) == sorted(t.id for t in tasks)  # every task once
    assert all(len(ch) <= 2 and len({t.scenario_id for t in ch}) == 1 for ch in chains)
    assert any(len(ch) == 2 for ch in chains)
    code = cfg.model_copy(update={"sandbox": cfg.sandbox.model_copy(update={"action_format": "code"})})
    pol = load_policy(model)
    backend = ScriptedBackend(pol.tokenizer, code_script(sandbox, reuse=True))  # calls an offered skill

    def run(length):
        return evaluate_policy(pol, code, sandbox, ["easy"], pass_k=1, progress=False, backend=backend,
                               chain_length=length)["metrics"]["easy"]

    alone, chained = run(1), run(2)
    assert alone["tgc"]["value"] == chained["tgc"]["value"] > 0.5
    # on its own every task starts with an empty library; in a chain the second task calls the first one's skill
    assert alone["skill_reuse_rate"]["value"] == 0.0 < chained["skill_reuse_rate"]["value"]
    assert chained["tokens_per_task"]["value"] < alone["tokens_per_task"]["value"]


def test_the_phase_compares_with_the_champion_by_default(setup, tmp_path, monkeypatch):
    """Two evaluation phases in a row on one registry: the first promotes (no champion yet, the safety rule
    decides); the second is measured against that champion on the same tasks and the reason is logged."""
    from mlflow import MlflowClient

    from components.evaluation.recipe import run

    cfg, _, model = setup
    overrides = json.dumps({"run": {"home": str(tmp_path / "home")}, "sandbox": {"max_turns": 3, "suite_sizes": {
        "easy": 4, "hard": 6, "safety": 3, "robustness": 3}}, "generation": {"max_new_tokens": 16},
        "eval": {"pass_k": 1, "bootstrap_samples": 100}})
    assert load_config(overrides_json=overrides).eval.baseline == "champion"
    first = run("tiny", overrides, model=model, promote=True)
    second = run("tiny", overrides, model=model, promote=True)
    client = MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    t1, t2 = client.get_run(first.run_id).data.tags, client.get_run(second.run_id).data.tags
    assert t1["agentrl.gate_baseline"].startswith("none") and "no champion yet" in t1["agentrl.gate_reasons"]
    assert first.baseline is None and first.decision.promote
    assert t2["agentrl.gate_baseline"] == f"champion (version {first.version})" and second.baseline is not None
    assert "vs champion" in t2["agentrl.gate_reasons"]  # the paired hard-suite rule ran
    m2 = client.get_run(second.run_id).data.metrics
    hard_levels = {k for k in m2 if k.startswith("eval/hard/tgc_level_")}
    assert hard_levels and all(int(k.rsplit("_", 1)[1]) >= 3 for k in hard_levels), sorted(m2)
    assert m2["eval/delta/hard/tgc_paired"] == 0.0  # the same model on the same tasks, greedy
    assert second.decision.promote  # not worse: the alias moves to the newer version
    champion = Registry(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}").get_alias("champion")
    assert str(champion.version) == second.version
    # the registry holds MLflow's transformers flavour: the champion serves through pyfunc as MLflow users load it
    # (the URIs by environment variable: mlflow.set_tracking_uri would pin every later test's client to this store)
    import mlflow

    uri = f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", uri)
    served = mlflow.pyfunc.load_model("models:/agentrl-policy@champion")
    assert served.metadata.flavors.keys() >= {"transformers", "python_function"}
    out = served.predict(["Move the mails from alice to Finance."], params={"max_new_tokens": 4})
    assert isinstance(out[0], str) and out[0]
