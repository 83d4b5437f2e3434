"""The `sandbox_build` phase, top to bottom (the workspace; another environment: `build_other`).

1. Resolve and validate the config; open the phase run.
2. Generate the world and the task suites (train, easy, hard, safety, robustness) from the seed.
3. Solve every task with the expert, in JSON and in code form: solvability per suite, and the expert
   demonstrations of the train suite (Trajectory JSONL) for SFT.
4. Run the reward-hacking probes on every task: each must fail everywhere.
5. Write the world, the tasks, the demonstrations and a text corpus (for the embedded tokenizer);
   measure prompt and trajectory lengths; log metrics, an HTML report and the files to MLflow and to
   storage under the run's prefix.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from components.core import storage
from components.core.config import PipelineConfig
from components.core.phase import setup_phase
from components.core.reporting import Report, bar_chart, histogram
from components.core.schema import Task, Trajectory, write_jsonl
from components.core.tracking import PhaseRun
from components.sandbox import expert
from components.sandbox.skills import SkillLibrary
from components.sandbox.suites import ALL
from components.sandbox.tasks import generate_tasks
from components.sandbox.workspace import WorkspaceEnv
from components.sandbox.world import World, generate_world

PHASE = "sandbox_build"


@dataclass
class BuildResult:
    parent_run_id: str
    run_id: str
    out_dir: str
    uri: str
    metrics: dict[str, float] = field(default_factory=dict)


def solve_all(world: World, cfg: PipelineConfig, suites: dict[str, list[Task]]):
    """Expert trajectories per (suite, form); the skill library carries over within each suite and form."""
    out: dict[tuple[str, str], list[Trajectory]] = {}
    total = sum(len(v) for v in suites.values()) * 2
    with tqdm(total=total, desc="expert", unit="task", disable=None) as bar:
        for form in ("json", "code"):
            for suite, tasks in suites.items():
                env = WorkspaceEnv(world, cfg.sandbox, cfg.rewards, SkillLibrary(), action_format=form)
                solve = expert.solve_json if form == "json" else expert.solve_code
                trajs = []
                try:
                    for t in tasks:
                        trajs.append(solve(env, t, policy=f"expert-{form}")[0])
                        bar.update()
                finally:
                    env.close()
                out[(suite, form)] = trajs
    return out


def probe_all(world: World, cfg: PipelineConfig, suites: dict[str, list[Task]]) -> dict[str, float]:
    env = WorkspaceEnv(world, cfg.sandbox, cfg.rewards)
    passed: Counter[str] = Counter()
    n = 0
    try:
        for tasks in suites.values():
            for t in tasks:
                n += 1
                for name, probe in expert.PROBES.items():
                    passed[name] += int(probe(env, t)[1].success)
    finally:
        env.close()
    return {name: passed[name] / max(1, n) for name in expert.PROBES}


def corpus_lines(world: World, trajs: list[Trajectory]) -> list[str]:
    """Text for the embedded tokenizer: the agent's conversations (chat-formatted) and the world's words."""
    lines = []
    for tr in trajs:
        for turn in tr.turns:
            lines.append(f"<|{turn.role}|>\n{turn.text}<|end|>")
    for m in world.mail.values():
        lines.append(f"{m['id']} {m['from']} {m['subject']} {m['body']}")
    for f in world.files.values():
        lines.append(f"{f['id']} {f['name']} {f['content']}")
    for c in world.channels.values():
        lines.append(f"{c['id']} {c['name']} " + " ".join(x["text"] for x in c["messages"]))
    return lines


def token_lengths(model_dir: str | None, trajs: list[Trajectory]) -> dict[str, list[int]]:
    if not model_dir:
        return {}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt, total = [], []
    for tr in trajs:
        msgs = [{"role": t.role, "content": t.text} for t in tr.turns]
        prompt.append(len(tok.apply_chat_template(msgs[:2], tokenize=True, add_generation_prompt=True)))
        total.append(len(tok.apply_chat_template(msgs, tokenize=True)))
    return {"prompt_tokens": prompt, "trajectory_tokens": total}


def build_report(cfg, suites, solved, probes, lengths, world: World) -> str:
    rep = Report(f"agentrl sandbox build — seed {cfg.sandbox.seed}")
    rep.text(f"World {world.digest()[:16]}: {len(world.users)} users, {len(world.mail)} emails, {len(world.files)} files, "
             f"{len(world.events)} events, {len(world.channels)} channels.")
    rep.heading("Tasks per suite and level")
    levels = [1, 2, 3, 4, 5]
    counts = {s: [sum(1 for t in suites[s] if t.level == lv) for lv in levels] for s in ALL}
    rep.table(["suite", *[f"L{lv}" for lv in levels], "total"], [[s, *counts[s], sum(counts[s])] for s in ALL])
    rep.figure(bar_chart([f"L{lv}" for lv in levels], {s: counts[s] for s in ALL}, "tasks", "Tasks per level"),
               "tasks per level and suite")
    rep.heading("Solvability (expert success rate)")
    rows = [[s, *(sum(t.verdict.success for t in solved[(s, f)]) / max(1, len(solved[(s, f)])) for f in ("json", "code"))]
            for s in ALL]
    rep.table(["suite", "json", "code"], rows)
    rep.figure(bar_chart(list(ALL), {f: [r[i + 1] for r in rows] for i, f in enumerate(("json", "code"))},
                         "success rate", "Expert success per suite"), "expert success")
    rep.heading("Reward-hacking probes (pass rate; must be 0)")
    rep.table(["probe", "pass rate"], sorted(probes.items()))
    rep.heading("Lengths of the train demonstrations")
    for name, values in lengths.items():
        if values:
            rep.figure(histogram(values, name, name.replace("_", " ")), name)
    rep.heading("Example expert trajectory (code form)")
    ex = next((t for t in solved[("train", "code")] if t.skills_used), solved[("train", "code")][0])
    rep.pre("\n\n".join(f"[{t.role}] {t.text}" for t in ex.turns[1:]))
    return rep.render()


def run(
    preset: str = "tiny",
    overrides: str = "",
    out_dir: str | None = None,
    parent_run_id: str | None = None,
    model_dir: str | None = None,
    report_path: str | None = None,
) -> BuildResult:
    cfg, home, storage_root = setup_phase(preset, overrides, torch_threads=False)  # validated before any work
    with PhaseRun(PHASE, config=cfg, parent_run_id=parent_run_id or None, close_parent=False) as tracker:
        if cfg.env.name != "workspace":
            out = Path(out_dir) if out_dir else home / "runs" / tracker.run_id / PHASE
            metrics, html = build_other(cfg, out)
            return _store(tracker, storage_root, out, metrics, html, report_path)
        t0 = time.perf_counter()
        world = generate_world(cfg.sandbox)
        suites = generate_tasks(world, cfg.sandbox)
        metrics: dict[str, float] = {"generate_seconds": time.perf_counter() - t0}
        for s in ALL:
            metrics[f"tasks_{s}"] = len(suites[s])
        tracker.log_metrics(metrics, step=0)

        solved = solve_all(world, cfg, suites)
        for (suite, form), trajs in solved.items():
            metrics[f"expert_success_{suite}_{form}"] = sum(t.verdict.success for t in trajs) / max(1, len(trajs))
        probes = probe_all(world, cfg, suites)
        metrics.update({f"probe_pass_{k}": v for k, v in probes.items()})

        demos = solved[("train", cfg.sandbox.action_format)]
        lengths = {"turns": [len(t.turns) for t in demos], "trajectory_chars": [sum(len(x.text) for x in t.turns) for t in demos]}
        lengths.update(token_lengths(model_dir, demos))
        for name, values in lengths.items():
            metrics[f"{name}_mean"] = statistics.fmean(values)
            metrics[f"{name}_max"] = float(max(values))
        tracker.log_metrics(metrics, step=1)

        out = Path(out_dir) if out_dir else home / "runs" / tracker.run_id / PHASE
        out.mkdir(parents=True, exist_ok=True)
        (out / "world.json").write_text(world.to_json())
        for s in ALL:
            write_jsonl(out / "tasks" / f"{s}.jsonl", suites[s])
        for form in ("json", "code"):
            write_jsonl(out / "demos" / f"train_{form}.jsonl", solved[("train", form)])
        write_jsonl(out / "demos" / "train.jsonl", demos)  # the configured form: what SFT reads by default
        (out / "corpus.txt").write_text("\n".join(corpus_lines(world, solved[("train", "json")] + solved[("train", "code")])))
        html = build_report(cfg, suites, solved, probes, lengths, world)
        return _store(tracker, storage_root, out, metrics, html, report_path)


def _store(tracker: PhaseRun, storage_root: str, out: Path, metrics: dict[str, float], html: str,
           report_path: str | None) -> BuildResult:
    """The report, metrics and digests beside the outputs; the folder stored under the run's prefix; MLflow."""
    (out / "report.html").write_text(html)
    if report_path:
        Path(report_path).write_text(html)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))
    world = json.loads((out / "world.json").read_text())
    digests = {"world": world.get("digest") or hashlib.sha256((out / "world.json").read_bytes()).hexdigest(),
               "tasks": _digest_dir(out / "tasks")}
    (out / "digests.json").write_text(json.dumps(digests, indent=1))
    uri = tracker.storage_uri(storage_root, "sandbox")
    storage.put_dir(out, uri)
    tracker.log_artifact(out / "report.html")
    tracker.log_artifact(out / "metrics.json")
    tracker.log_artifact(out / "digests.json")
    tracker.set_tags({"agentrl.world_digest": digests["world"], "agentrl.sandbox_uri": uri,
                      "agentrl.environment": tracker_env(out)})
    return BuildResult(tracker.parent_run_id, tracker.run_id, str(out), uri, metrics)


def tracker_env(out: Path) -> str:
    return str(json.loads((out / "world.json").read_text()).get("environment", "workspace"))


def build_other(cfg: PipelineConfig, out: Path) -> tuple[dict[str, float], str]:
    """Any environment other than the workspace, through `core.env.load`: its suites, the expert's solutions (the
    train suite's are the SFT demos; every suite's measure its solvability), the tokenizer corpus and a report.
    world.json describes the environment (`describe()`), which the phases' loader checks."""
    from components.core.env import load
    from components.core.tokens import render_tools

    env = load(cfg)
    metrics: dict[str, float] = {}
    solved: dict[str, list[Trajectory]] = {}
    make = env.factory()
    with tqdm(total=sum(len(v) for v in env.suites.values()), desc="expert", unit="task", disable=None) as bar:
        for suite, tasks in env.suites.items():
            one = make()
            try:
                solved[suite] = [x for x in (env.expert(one, t) for t in tasks) if x is not None]
            finally:
                one.close()
            bar.update(len(tasks))
            metrics[f"tasks_{suite}"] = float(len(tasks))
            metrics[f"expert_success_{suite}"] = sum(t.verdict.success for t in solved[suite]) / max(1, len(tasks))
    demos = solved.get("train") or []
    if not demos:
        raise ValueError(f"env.name={cfg.env.name!r}: the train suite has no expert solutions (SFT needs demos)")
    out.mkdir(parents=True, exist_ok=True)
    describe = getattr(env, "describe", None)
    (out / "world.json").write_text(json.dumps(describe() if describe else {"environment": cfg.env.name}, indent=1))
    for s, tasks in env.suites.items():
        write_jsonl(out / "tasks" / f"{s}.jsonl", tasks)
    write_jsonl(out / "demos" / "train.jsonl", demos)
    lines = [f"<|{t.role}|>\n{t.text}<|end|>" for tr in demos for t in tr.turns]
    lines += sorted({render_tools(t.info["tools"]) for tr in demos for t in tr.turns if t.info.get("tools")})
    (out / "corpus.txt").write_text("\n".join(lines))
    lengths = [len(t.turns) for t in demos]
    metrics.update({"turns_mean": statistics.fmean(lengths), "turns_max": float(max(lengths))})

    rep = Report(f"agentrl sandbox build — environment {cfg.env.name}")
    levels = sorted({t.level for ts in env.suites.values() for t in ts})
    rep.heading("Tasks per suite and level")
    rep.table(["suite", *[f"L{lv}" for lv in levels], "held out", "expert success"],
              [[s, *[sum(t.level == lv for t in ts) for lv in levels], "yes" if s in env.heldout else "",
                round(metrics[f"expert_success_{s}"], 3)] for s, ts in env.suites.items()])
    rep.heading("Example expert trajectory")
    ex = max(demos, key=lambda t: len(t.turns))
    rep.pre("\n\n".join(f"[{t.role}] {t.text}" for t in ex.turns))
    return metrics, rep.render()


def _digest_dir(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(path).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()
