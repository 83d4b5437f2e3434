"""The run form of a compiled pipeline (its `inputDefinitions`): what the Kubeflow UI's "Create run" shows.

A pipeline body is written once, for any preset; `form_pipeline` gives it the parameters of the form with the
compile preset's defaults (components/prepare/form.py says which knobs, and in what order they merge). KFP reads
a pipeline's parameters, types and descriptions from its signature and docstring, so both are built here from
one list rather than written out per preset and per pipeline.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kfp import dsl

from components.core.config import PRESETS
from components.prepare import form

_REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class Param:
    name: str
    type: type
    default: Any  # _REQUIRED: the form asks for it
    help: str
    path: str = ""  # the config field it sets, if any


def _base(preset: str) -> dict[str, Param]:
    has_model = preset != "h100"  # the h100 preset trains the user's model: the form asks for it
    presets = ", ".join(f"'{p}'" for p in PRESETS)
    return {
        "base_model_uri": Param(
            "base_model_uri", str, "" if has_model else _REQUIRED,
            "The model to start from: a Hugging Face directory on the node, an s3:// prefix (any tool's upload), a "
            ".gguf file or 'smollm2-135m-instruct'" + ("; empty = the preset's." if has_model else "."),
            "model.base_uri"),
        "preset": Param("preset", str, preset, f"Config preset: {presets}. The run form's other defaults are "
                        f"the '{preset}' preset's; a knob left as it is follows the preset chosen here."),
        "overrides": Param("overrides", str, "", 'Any other config field, as a JSON object, e.g. {"grpo": '
                           '{"temperature": 0.8}}; it wins over the run form. Validated before any task starts.'),
        "experiment": Param("experiment", str, "agentrl", "MLflow experiment name.", "tracking.experiment"),
        "parent_run_id": Param("parent_run_id", str, "", "An MLflow run to nest under; empty = create one (or use "
                               "the KFP MLflow plugin's)."),
    }


def params(pipeline: str, preset: str) -> list[Param]:
    """The form of `pipeline` compiled for `preset`, in the order the UI lists it."""
    base = _base(preset)
    shown = form.defaults(preset, pipeline)
    knobs = [Param(k.name, k.type, shown[k.name], k.help, k.path) for k in form.knobs(pipeline)]
    if pipeline == "agent_rl":
        switches = [Param(switch, bool, True, f"Run the {phase} phase; off = its input model goes on unchanged "
                          "(MLflow and the report say it was skipped).") for phase, (switch, _) in form.SWITCHES.items()]
        return [base["base_model_uri"], base["preset"], *knobs, *switches,
                Param("dpo_ab_logs_uri", str, "", "A/B deployment logs (ABRecord JSONL: a file, directory or s3:// "
                      "prefix) for DPO; empty = simulate the A/B deployment in the sandbox."),
                base["overrides"], base["experiment"], base["parent_run_id"]]
    return [Param("ab_logs_uri", str, _REQUIRED, "The new A/B deployment logs (ABRecord JSONL: a file, directory "
                  "or s3:// prefix)."),
            base["preset"], *knobs,
            Param("grpo_refresh", bool, False, "Run a short GRPO phase on the champion before DPO (size it with "
                  "grpo_steps); off = DPO straight from the champion."),
            base["overrides"], base["parent_run_id"]]


def form_pipeline(pipeline: str, preset: str, **pipeline_kwargs) -> Callable:
    """`@form_pipeline('agent_rl', 'h100', name=...)` over `def body(p)`: a KFP pipeline whose parameters are the
    run form's; the body gets them as `p.<name>` (pipeline channels), and `p.form_json` / `p.form_shown` for the
    `configure` step."""
    ps = params(pipeline, preset)
    shown = form.defaults(preset, pipeline)

    def decorate(body: Callable[[SimpleNamespace], Any]):
        def fn(*args):
            p = SimpleNamespace(**{x.name: a for x, a in zip(ps, args, strict=True)})
            p.form_json = form.encode({name: getattr(p, name) for name in shown},
                                      frozenset(k.name for k in form.knobs(pipeline) if k.type is str))
            p.form_shown = json.dumps(shown, sort_keys=True)
            return body(p)

        fn.__name__ = fn.__qualname__ = body.__name__
        fn.__signature__ = inspect.Signature([
            inspect.Parameter(x.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=x.default, annotation=x.type)
            for x in ps])
        fn.__doc__ = (inspect.getdoc(body) or "").split("\n\n")[0] + "\n\nArgs:\n" + "\n".join(
            f"    {x.name}: {x.help}" for x in ps)
        return dsl.pipeline(**pipeline_kwargs)(fn)

    return decorate


def markdown(pipeline: str, preset: str) -> str:
    """The run form as a Markdown table (`agentrl form`; the README's cluster section shows the h100 one)."""
    kinds = {str: "string", int: "integer", float: "double", bool: "boolean", list: "list"}
    rows = [f"| parameter | type | default ({preset}) | config field | description |", "|---|---|---|---|---|"]
    for p in params(pipeline, preset):
        default = "*required*" if p.default is _REQUIRED else f"`{json.dumps(p.default)}`"
        field = f"`{p.path}`" if p.path else ""
        rows.append(f"| `{p.name}` | {kinds[p.type]} | {default} | {field} | {p.help.replace('|', '/')} |")
    return "\n".join(rows)
