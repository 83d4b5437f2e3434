"""`agentrl`: run the pipeline locally (kfp.local), compile it, inspect the config, open the MLflow UI."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from components.core.config import PRESETS, ConfigError, load_config


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="config preset: tiny (default, the embedded toy), small (SmolLM2-135M-Instruct), h100")
    p.add_argument("--config", "-c", action="append", default=[], metavar="FILE", help="YAML config file(s)")
    p.add_argument("--set", "-s", dest="set_pairs", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set grpo.group_size=16")
    p.add_argument("--overrides", default=None, help="JSON object of overrides")


def _resolve(args):
    return load_config(preset=args.preset, files=args.config, overrides_json=args.overrides,
                       set_pairs=args.set_pairs)


def _home(cfg) -> Path:
    home = Path(cfg.run.home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["AGENTRL_HOME"] = str(home)
    return home


def cmd_config(args) -> int:
    cfg = _resolve(args)
    print(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
    return 0


def _phase_summary(tracking_uri: str, parent_run_id: str) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    parent = client.get_run(parent_run_id)
    runs = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'"
    )
    phases = {}
    for r in sorted(runs, key=lambda r: r.info.start_time):
        phase = r.data.tags.get("agentrl.phase", r.info.run_name)
        end = r.info.end_time or int(time.time() * 1000)
        skipped = r.data.tags.get("agentrl.skipped") == "true"
        phases[phase] = {
            "run_id": r.info.run_id,
            "status": "SKIPPED" if skipped and r.info.status == "FINISHED" else r.info.status,
            "wall_s": round((end - r.info.start_time) / 1000, 2),
            "metrics": {k.split("/", 1)[-1]: v for k, v in sorted(r.data.metrics.items())},
        }
        if "agentrl.error" in r.data.tags:
            phases[phase]["error"] = r.data.tags["agentrl.error"]
    return phases


def _switches(pairs: list[str]) -> dict[str, bool]:
    """`agentrl run --param run_dpo=false`: the run form's phase switches (config fields go through --set)."""
    from components.prepare.form import KNOBS, SWITCHES

    known = {switch for switch, _ in SWITCHES.values()}
    paths = {k.name: k.path for k in KNOBS}
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if key in paths:
            raise ValueError(f"--param {key}: a config field here; use --set {paths[key]}={value}")
        if not sep or key not in known:
            raise ValueError(f"--param {pair!r}: expected NAME=true|false with NAME one of {sorted(known)}")
        if value.lower() not in ("true", "false"):
            raise ValueError(f"--param {key}={value}: expected true or false")
        out[key] = value.lower() == "true"
    return out


def cmd_run(args) -> int:
    """The pipeline through kfp.local: every task in this environment, or (`--runner docker`) each in its image."""
    from components.core.tracking import end_run, resolve_tracking_uri, start_pipeline_run
    from pipelines import local
    from pipelines.agent_rl import agent_rl

    cfg = _resolve(args)  # validated before anything starts
    try:
        cfg.check_base_model()
        switches = _switches(args.param or [])
    except ValueError as exc:
        print(f"agentrl run: {exc}", file=sys.stderr)
        return 2
    home = _home(cfg)
    cfg.run.home = str(home)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri, home)
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # a task that crashes in native code leaves its Python stack
    # in containers the pipeline root is the one folder kfp.local mounts: it is the home itself
    root = home / "pipeline_root" if args.runner == "subprocess" else home
    local.init(root, runner=args.runner)
    if args.runner == "docker":
        from pipelines.agent_rl import build
        from pipelines.placement import load_plan

        agent_rl = build(load_plan("containers"))

    parent_id = start_pipeline_run(tracking_uri, cfg.tracking.experiment, "agentrl-local",
                                   tags={"agentrl.runner": "kfp.local", "agentrl.preset": cfg.preset})
    started = time.time()
    status = "FAILED"
    from contextlib import nullcontext

    from pipelines.progress import QuietRun

    quiet = None if args.verbose else QuietRun(home / "logs" / f"run-{time.strftime('%Y%m%d-%H%M%S')}.log", root,
                                               run_prefix="agentrl-")
    failure = ""
    try:
        with quiet or nullcontext():
            agent_rl(preset=cfg.preset, overrides=json.dumps(cfg.to_dict()), experiment=cfg.tracking.experiment,
                     parent_run_id=parent_id, **switches)
        status = "FINISHED"
    except RuntimeError as exc:
        import re

        failure = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # kfp.local's message carries ANSI colours
    finally:
        end_run(tracking_uri, parent_id, status)
    if failure:
        if quiet is not None:  # the component's own traceback went to the log: its end, here
            print(f"--- the last lines of {quiet.log} ---\n{quiet.tail()}\n---", file=sys.stderr)
        print("\nagentrl run failed: " + failure, file=sys.stderr)
    from components.core.tracking import flush_pending

    # what a phase left buffered (its tracking server was down at its end), sent now if the server is back
    left = {k: v["left"] for k, v in flush_pending(home / "metric_buffer").items() if v["left"] != (0, 0)}
    phases = _phase_summary(tracking_uri, parent_id)
    report = {
        "parent_run_id": parent_id,
        "tracking_uri": tracking_uri,
        "status": status,
        "wall_s": round(time.time() - started, 2),
        "phases": {k: {"run_id": v["run_id"], "wall_s": v["wall_s"], "status": v["status"],
                       **({"error": v["error"]} if "error" in v else {})}
                   for k, v in phases.items()},
        "metrics": {k: v["metrics"] for k, v in phases.items()},
        "tracking_buffered": {k: {"metrics": m, "calls": c} for k, (m, c) in left.items()},
    }
    (home / "last_run.json").write_text(json.dumps(report, indent=1))
    _print_table(report)
    if left:
        print(f"agentrl run: tracking calls of {len(left)} runs are still buffered in {home / 'metric_buffer'} "
              "(the MLflow server is unreachable): `agentrl flush` sends them", file=sys.stderr)
    for phase, info in report["phases"].items():  # the component's own words, last, where they are seen
        if info.get("error"):
            print(f"agentrl run: phase {phase} failed: {info['error']}", file=sys.stderr)
    return 0 if status == "FINISHED" else 1


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"agentrl run {report['parent_run_id']} — {report['status']} in {report['wall_s']} s")
    table.add_column("phase")
    table.add_column("status")
    table.add_column("wall s", justify="right")
    table.add_column("metrics")
    for phase, info in report["phases"].items():
        items = list(report["metrics"][phase].items())
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in items[:6])
        if len(items) > 6:
            metrics += f" (+{len(items) - 6} more in MLflow)"
        table.add_row(phase, info["status"], f"{info['wall_s']:.1f}", metrics)
    console = Console()
    console.print(table)
    console.print(f"MLflow: {report['tracking_uri']}  (agentrl ui)")


def cmd_flush(args) -> int:
    """Send the metrics, tags, artifacts and run statuses that phases left buffered while MLflow was unreachable."""
    from components.core.tracking import flush_pending

    home = Path(args.home or os.environ.get("AGENTRL_HOME", ".agentrl")).resolve()
    result = flush_pending(home / "metric_buffer", args.tracking_uri, quiet=True)
    for run_id, r in result.items():
        print(f"run {run_id}: sent {r['sent'][0]} metrics and {r['sent'][1]} calls; left {r['left'][0]} and "
              f"{r['left'][1]}")
    left = [k for k, r in result.items() if r["left"] != (0, 0)]
    if left:
        print(f"agentrl flush: {len(left)} runs still buffered in {home / 'metric_buffer'} (server unreachable?)",
              file=sys.stderr)
        return 1
    print(f"agentrl flush: nothing left buffered in {home / 'metric_buffer'}")
    return 0


def cmd_model_import(args) -> int:
    """Resolve a model from any source, check its tokenizer fits agent episodes, and upload it to storage with a
    manifest (written last), ready to be a cluster run's `base_model_uri`."""
    import shutil
    import tempfile

    from components.core import storage
    from components.core.config import ModelConfig
    from components.core.policy import ModelLoadError, load_tokenizer, resolve_model_dir, save_tokenizer
    from components.core.sources import COMPLETE

    home = Path(os.environ.get("AGENTRL_HOME", ".agentrl"))
    try:
        chat = ModelConfig(chat_template=args.chat_template, observation_role=args.observation_role)
        src = resolve_model_dir(args.src, home / "cache")
        tok = load_tokenizer(src, chat)
    except (ModelLoadError, ValueError) as exc:
        print(f"agentrl model import: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=home if home.exists() else None) as tmp:
        staged = Path(tmp) / "model"
        shutil.copytree(src, staged, ignore=shutil.ignore_patterns(COMPLETE, storage.MANIFEST))
        save_tokenizer(tok, staged)  # the chat template and observation role travel with the weights
        manifest = storage.put_dir(staged, args.dest)
    size = sum(e["size"] for e in manifest["files"]) / 2**20
    print(f"imported {args.src} -> {args.dest}: {len(manifest['files'])} files, {size:.1f} MiB, observation role "
          f"{tok.agentrl_chat['observation_role']!r}; use it as model.base_uri={args.dest}")
    return 0


PIPELINES = ("agent_rl", "retrain")


def _compile_to(name: str, plan, out: Path, preset: str) -> Path:
    from importlib import import_module

    from kfp import compiler

    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(import_module(f"pipelines.{name}").build(plan, preset), str(out))
    return out


def _plan(args):
    from pipelines.placement import load_plan

    return load_plan(args.placement, args.placement_file)


def _form_preset(args) -> str:
    """The preset whose values the run form shows: --preset, else h100 for the cluster plan, else tiny."""
    return args.preset or ("h100" if args.placement == "h100" else "tiny")


def cmd_compile(args) -> int:
    try:
        plan = _plan(args)
    except (ValueError, OSError) as exc:
        print(f"agentrl compile: {exc}", file=sys.stderr)
        return 2
    names = PIPELINES if args.pipeline == "all" else (args.pipeline,)
    for name in names:
        out = Path(args.output) if args.output and len(names) == 1 else Path(args.output_dir) / f"{name}.yaml"
        _compile_to(name, plan, out, _form_preset(args))
        extra = f" + {args.placement_file}" if args.placement_file else ""
        print(f"compiled {out} (placement {args.placement}{extra}, run form defaults of preset {_form_preset(args)})")
        _say_caching(out)
    return 0


def cmd_form(args) -> int:
    """The run form a compiled pipeline shows in the Kubeflow UI, as a Markdown table."""
    from pipelines.run_form import markdown

    print(markdown(args.pipeline, _form_preset(args)))
    return 0


def cron_to_kfp(expr: str) -> str:
    """A standard 5-field cron ('m h dom mon dow') -> KFP's 6-field, seconds-first form; 6 fields pass through."""
    fields = expr.split()
    if len(fields) == 5:
        return " ".join(["0", *fields])
    if len(fields) == 6:
        return " ".join(fields)
    raise ValueError(f"cron {expr!r}: expected 5 fields (minute hour day-of-month month day-of-week) or 6 (seconds first)")


def _kfp_client(args):
    import kfp

    return kfp.Client(host=args.host, namespace=args.namespace, existing_token=os.environ.get("KFP_TOKEN") or None)


def _arguments(args) -> dict:
    """--param NAME=VALUE pairs as the run form's typed values (KFP refuses '50' for an integer parameter)."""
    import yaml

    from pipelines.run_form import params

    types = {p.name: p.type for p in params(args.pipeline, _form_preset(args))}
    out = {}
    for pair in args.param or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--param {pair!r}: expected NAME=VALUE")
        if key not in types:
            raise ValueError(f"--param {key}: not a parameter of {args.pipeline}; expected one of {sorted(types)}")
        kind = types[key]
        if kind is str:
            out[key] = value
            continue
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = yaml.safe_load(value)  # true/false/[easy, hard]
        if kind is float and isinstance(parsed, int) and not isinstance(parsed, bool):
            parsed = float(parsed)
        if not isinstance(parsed, kind) or (kind is int and isinstance(parsed, bool)):
            raise ValueError(f"--param {key}={value}: expected {kind.__name__}")
        out[key] = parsed
    if args.overrides:
        json.loads(args.overrides)  # a clear error before anything is sent
        out["overrides"] = args.overrides
    return out


def cache_summary(package: str | Path) -> dict[str, list[str]]:
    """The tasks of a compiled pipeline KFP may serve from its cache, and those that always run."""
    import yaml

    spec = next(d for d in yaml.safe_load_all(Path(package).read_text()) if d and "root" in d)
    dags = [spec["root"]["dag"]] + [c["dag"] for c in spec.get("components", {}).values() if "dag" in c]
    out: dict[str, set[str]] = {"cached": set(), "always_run": set()}
    for dag in dags:
        for name, task in dag.get("tasks", {}).items():
            if "componentRef" in task and "dag" in spec["components"].get(task["componentRef"]["name"], {}):
                continue  # a condition group, not a container
            key = "cached" if task.get("cachingOptions", {}).get("enableCache") else "always_run"
            out[key].add(name)
    return {k: sorted(v) for k, v in out.items()}


def _say_caching(package: str | Path) -> None:
    c = cache_summary(package)
    print(f"KFP cache: may serve {', '.join(c['cached']) or 'nothing'}; always run: {', '.join(c['always_run'])}")


def cmd_submit(args) -> int:
    import tempfile

    try:
        params, plan = _arguments(args), _plan(args)
    except (ValueError, OSError) as exc:
        print(f"agentrl submit: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        pkg = _compile_to(args.pipeline, plan, Path(d) / f"{args.pipeline}.yaml", _form_preset(args))
        _say_caching(pkg)
        res = _kfp_client(args).create_run_from_pipeline_package(
            str(pkg), arguments=params, run_name=args.run_name, experiment_name=args.experiment)
    print(f"submitted run {res.run_id} to {args.host}")
    return 0


def cmd_schedule(args) -> int:
    import tempfile

    try:
        cron, params, plan = cron_to_kfp(args.cron), _arguments(args), _plan(args)
    except (ValueError, OSError) as exc:
        print(f"agentrl schedule: {exc}", file=sys.stderr)
        return 2
    client = _kfp_client(args)
    try:
        exp = client.get_experiment(experiment_name=args.experiment)
    except ValueError:  # the SDK's "no experiment with this name"
        exp = client.create_experiment(args.experiment)
    flt = json.dumps({"predicates": [{"key": "display_name", "operation": "EQUALS", "string_value": args.name}]})
    existing = client.list_recurring_runs(experiment_id=exp.experiment_id, filter=flt).recurring_runs or []
    for old in existing:  # one schedule per name: re-running (e.g. on a helm upgrade) replaces it
        client.delete_recurring_run(old.recurring_run_id)
        print(f"replaced schedule {old.recurring_run_id}")
    with tempfile.TemporaryDirectory() as d:
        pkg = _compile_to(args.pipeline, plan, Path(d) / f"{args.pipeline}.yaml", _form_preset(args))
        _say_caching(pkg)
        job = client.create_recurring_run(exp.experiment_id, args.name, cron_expression=cron, params=params,
                                          pipeline_package_path=str(pkg), max_concurrency=1, no_catchup=True)
    print(f"scheduled {args.pipeline} as {job.recurring_run_id} ({cron!r}, KFP's seconds-first cron)")
    return 0


def cmd_upload(args) -> int:
    """Upload the compiled pipelines to KFP: a new pipeline, or a new version of an existing one."""
    import tempfile

    from components.core import images

    try:
        plan = _plan(args)
    except (ValueError, OSError) as exc:
        print(f"agentrl upload: {exc}", file=sys.stderr)
        return 2
    client = _kfp_client(args)
    names = PIPELINES if args.pipeline == "all" else (args.pipeline,)
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            pkg = _compile_to(name, plan, Path(d) / f"{name}.yaml", _form_preset(args))
            display = f"agentrl-{name.replace('_', '-')}"
            pid = client.get_pipeline_id(display)
            if pid is None:
                got = client.upload_pipeline(str(pkg), pipeline_name=display)
                print(f"uploaded {display} ({got.pipeline_id})")
            else:
                version = args.version or f"{images.TAG}-{time.strftime('%Y%m%d-%H%M%S')}"
                client.upload_pipeline_version(str(pkg), pipeline_version_name=version, pipeline_id=pid)
                print(f"uploaded {display} version {version}")
    return 0


def cmd_compare(args) -> int:
    """Runs side by side from MLflow: each pipeline run's phases and their held-out metrics."""
    from rich.console import Console
    from rich.table import Table

    from components.core.tracking import resolve_tracking_uri

    cfg = load_config()
    uri = resolve_tracking_uri(args.tracking_uri or cfg.tracking.tracking_uri, _home(cfg))
    reports = {rid: _phase_summary(uri, rid) for rid in args.run_ids}
    keys = sorted({(ph, k) for r in reports.values() for ph, v in r.items() for k in v["metrics"]
                   if not args.metric or any(m in f"{ph}/{k}" for m in args.metric)})
    table = Table(title="agentrl runs")
    table.add_column("metric")
    for rid in args.run_ids:
        table.add_column(rid[:12], justify="right")
    for ph, k in keys:
        row = [reports[rid].get(ph, {}).get("metrics", {}).get(k) for rid in args.run_ids]
        table.add_row(f"{ph}/{k}", *("" if v is None else f"{v:.4g}" for v in row))
    Console(width=200).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": reports}, indent=1))
    return 0


def cmd_ui(args) -> int:
    cfg = load_config()
    home = _home(cfg)
    from components.core.tracking import local_tracking_uri

    cmd = [str(Path(sys.executable).with_name("mlflow")), "ui", "--backend-store-uri", local_tracking_uri(home),
           "--host", args.host, "--port", str(args.port)]
    print("$ " + " ".join(cmd))
    return subprocess.call(cmd)


def cmd_sandbox_serve(args) -> int:
    """The sandbox HTTP server (the Kubernetes sandbox Deployment runs exactly this)."""
    from components.sandbox.server import serve
    from components.sandbox.world import World, generate_world

    cfg = _resolve(args)
    if args.world:
        from components.core import storage

        world = World.from_dict(json.loads(storage.read_text(args.world)))
    else:
        world = generate_world(cfg.sandbox)
    print(f"agentrl sandbox: world {world.digest()[:16]} ({len(world.users)} users) on http://{args.host}:{args.port}",
          flush=True)
    try:
        serve(args.host, args.port, world, cfg.sandbox, cfg.rewards, token_file=args.token_file)
    except (ValueError, OSError) as exc:  # no tokens off loopback, an unreadable token file, a bad token
        print(f"agentrl: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_env_serve(args) -> int:
    """Any registered environment over the sandbox's HTTP protocol (the chart's sandbox Service runs this with
    --env); the workspace is `agentrl sandbox serve`'s server."""
    from components.core.env import load
    from components.sandbox.server import serve

    pairs = [*args.set_pairs, f"env.name={args.env}"] if args.env else args.set_pairs
    cfg = load_config(preset=args.preset, files=args.config, overrides_json=args.overrides, set_pairs=pairs)
    if cfg.env.url:
        print("agentrl env serve: env.url names a server to use, not one to be: unset it here", file=sys.stderr)
        return 2
    try:
        loaded = load(cfg, args.world, args.tasks)
    except (ValueError, KeyError) as exc:
        print(f"agentrl env serve: {exc}", file=sys.stderr)
        return 2
    sandbox = getattr(loaded, "world", None) is not None and cfg.env.name == "workspace"
    digest = loaded.world.digest()[:16] if sandbox else str(getattr(loaded, "describe", dict)().get("digest", ""))[:16]
    print(f"agentrl env: {cfg.env.name} ({digest}; suites {', '.join(sorted(loaded.suites))}) on "
          f"http://{args.host}:{args.port}", flush=True)
    try:
        if sandbox:
            serve(args.host, args.port, loaded.world, cfg.sandbox, cfg.rewards, token_file=args.token_file)
        else:
            serve(args.host, args.port, cfg=cfg.sandbox, token_file=args.token_file, environment=loaded)
    except (ValueError, OSError) as exc:
        print(f"agentrl: {exc}", file=sys.stderr)
        return 2
    return 0


def _placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", default="h100", help="placement plan: 'h100' (cluster) or 'local' (nothing applied)")
    p.add_argument("--placement-file", default=None, help="YAML overrides of the plan (keys 'defaults', 'phases')")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="the preset whose values the run form shows as defaults (default: h100 for the h100 "
                   "placement, tiny for local)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run the pipeline locally on the embedded default (kfp.local)")
    _config_args(p)
    p.add_argument("--param", action="append", metavar="NAME=VALUE",
                   help="a phase switch of the run form, e.g. --param run_dpo=false (repeatable)")
    p.add_argument("--verbose", action="store_true",
                   help="stream kfp.local's executor logs here (default: to <home>/logs/, one line per task here)")
    p.add_argument("--runner", choices=("subprocess", "docker"), default="subprocess",
                   help="subprocess: every task in this environment (default); docker: each task in its own image "
                   "(`make images`; docker, or podman's Docker API at DOCKER_HOST; the image tag from "
                   "AGENTRL_IMAGE_TAG, e.g. 0.1.0-cpu)")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("config", help="print the resolved, validated config")
    _config_args(p)
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("learn", help="the pipeline over N seeds, every phase's gain with a bootstrap CI "
                       "(<home>/learning.json; make learn)")
    _config_args(p)
    p.add_argument("--seeds", type=int, default=3, help="run seeds 0..N-1 (default 3)")
    p.add_argument("--seed-list", default=None, metavar="S,S,...", help="these run seeds instead of --seeds")
    p.add_argument("--eval-set", dest="eval_pairs", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for the measurement only, e.g. larger held-out suites: "
                   "--eval-set 'sandbox.suite_sizes={easy: 120}' (held-out draws leave train and practice as they are)")
    p.add_argument("--home", default=None, help="AGENTRL_HOME of the runs (default run.home)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap draws per interval")
    p.add_argument("--table", default=None, metavar="README", help="rewrite the learning table between the "
                   "<!-- learning-table:start/end --> markers of this file")
    p.add_argument("--table-only", default=None, metavar="LEARNING_JSON",
                   help="run nothing: the table from this learning.json (with --table, written there)")
    p.add_argument("--quiet", action="store_true", help="no progress bars while measuring")
    p.set_defaults(fn=lambda a: __import__("pipelines.learn", fromlist=["cmd_learn"]).cmd_learn(a))
    p = sub.add_parser("compile", help="compile the pipelines to YAML for upload to Kubeflow")
    p.add_argument("--pipeline", choices=(*PIPELINES, "all"), default="agent_rl")
    p.add_argument("--output", "-o", default=None, help="the YAML file (one pipeline); default <output-dir>/<name>.yaml")
    p.add_argument("--output-dir", default="build")
    _placement_args(p)
    p.set_defaults(fn=cmd_compile)
    p = sub.add_parser("form", help="the run form (typed parameters, defaults) of a compiled pipeline, as Markdown")
    p.add_argument("--pipeline", choices=PIPELINES, default="agent_rl")
    _placement_args(p)
    p.set_defaults(fn=cmd_form)
    for name, fn, hlp in (("submit", cmd_submit, "start a run on a Kubeflow Pipelines host"),
                          ("schedule", cmd_schedule, "a recurring run on a Kubeflow Pipelines host (cron)")):
        p = sub.add_parser(name, help=hlp)
        p.add_argument("--host", required=True, help="the KFP API endpoint, e.g. https://kubeflow.example.com/pipeline")
        p.add_argument("--namespace", default="kubeflow")
        p.add_argument("--pipeline", choices=PIPELINES, default="agent_rl" if name == "submit" else "retrain")
        p.add_argument("--experiment", default="agentrl")
        p.add_argument("--param", action="append", metavar="NAME=VALUE", help="a pipeline parameter (repeatable)")
        p.add_argument("--overrides", default="", help="config overrides (JSON), the pipeline's `overrides`")
        _placement_args(p)
        if name == "submit":
            p.add_argument("--run-name", default=None)
        else:
            p.add_argument("--cron", required=True, help="5-field cron ('0 3 * * 1') or KFP's 6-field form")
            p.add_argument("--name", default="agentrl-retrain")
        p.set_defaults(fn=fn)
    p = sub.add_parser("upload", help="upload the compiled pipelines to a Kubeflow Pipelines host")
    p.add_argument("--host", required=True)
    p.add_argument("--namespace", default="kubeflow")
    p.add_argument("--pipeline", choices=(*PIPELINES, "all"), default="all")
    p.add_argument("--version", default=None, help="version name when the pipeline exists (default: tag-timestamp)")
    _placement_args(p)
    p.set_defaults(fn=cmd_upload)
    p = sub.add_parser("compare", help="runs side by side from MLflow (parent run ids)")
    p.add_argument("run_ids", nargs="+")
    p.add_argument("--metric", action="append", help="keep metrics whose '<phase>/<name>' contains this")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--json", default=None, help="also write the comparison as JSON here")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("model", help="models: import one into storage for the cluster")
    model_sub = p.add_subparsers(dest="model_cmd", required=True)
    p = model_sub.add_parser("import", help="upload a model (directory, s3:// prefix, .gguf, or a named model such as "
                             "smollm2-135m-instruct) to a path or s3:// URI, with its manifest")
    p.add_argument("src")
    p.add_argument("dest")
    p.add_argument("--chat-template", default=None, help="replace the chat template: 'chatml' or a Jinja file")
    p.add_argument("--observation-role", choices=("auto", "tool", "user"), default="auto")
    p.set_defaults(fn=cmd_model_import)
    p = sub.add_parser("flush", help="send what phases left buffered while the MLflow server was unreachable")
    p.add_argument("--home", default=None, help="the agentrl home (default: $AGENTRL_HOME or .agentrl)")
    p.add_argument("--tracking-uri", default=None, help="send there instead of each run's own server")
    p.set_defaults(fn=cmd_flush)
    p = sub.add_parser("ui", help="the MLflow UI on the local store")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(fn=cmd_ui)
    p = sub.add_parser("sandbox", help="the workspace sandbox")
    sandbox_sub = p.add_subparsers(dest="sandbox_cmd", required=True)
    p = sandbox_sub.add_parser("serve", help="serve reset/step/verify over HTTP")
    _config_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--world", default=None, help="world.json (path or s3://) from sandbox_build; default: generate")
    p.add_argument("--token-file", default=None, help="bearer tokens, `client:token` per line (also read from "
                   "$AGENTRL_SANDBOX_TOKENS); without any the server binds loopback only")
    p.set_defaults(fn=cmd_sandbox_serve)
    p = sub.add_parser("env", help="environments: any registered one")
    env_sub = p.add_subparsers(dest="env_cmd", required=True)
    p = env_sub.add_parser("serve", help="serve a registered environment's episodes over HTTP (reset/step/verify)")
    _config_args(p)
    p.add_argument("--env", default=None, help="the environment (env.name): workspace, helpdesk, files (with --set "
                   "env.options.path=DIR), or one registered under agentrl.environment_loaders")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--world", default=None, help="a sandbox_build's world.json (with --tasks)")
    p.add_argument("--tasks", default=None, help="a sandbox_build's tasks folder; default: the environment's own")
    p.add_argument("--token-file", default=None, help="bearer tokens, `client:token` per line (also read from "
                   "$AGENTRL_SANDBOX_TOKENS); without any the server binds loopback only")
    p.set_defaults(fn=cmd_env_serve)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"agentrl: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
