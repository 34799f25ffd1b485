"""The W&B dashboard as code: a saved workspace view for a project, one section per panel group
(train, eval, perf, mem, comm, data), one line plot per panel of metric_names.PANELS. The only
module that imports wandb_workspaces (lazily, inside the functions).

    tsp-dashboard --entity ENTITY --project PROJECT [--name NAME]      build and save (network)
    tsp-dashboard [--entity ENTITY --project PROJECT] --json PATH      build, write the view spec
                                                                       as JSON, no network

Families (comm/<axis>/<op>_bytes) become one plot that selects its metrics by regular expression,
so a dashboard built before any run still shows whichever axes and ops the runs log.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tsp_trainer.observability.metric_names import PANEL_GROUPS, Panel, panels_in_group

OPEN_GROUPS = ("train", "eval", "perf")        # sections shown expanded when the view opens


def glob_to_regex(pattern: str) -> str:
    """'comm/*/*_bytes' -> '^comm/[^/]+/[^/]+_bytes$' (a `*` stays within one name segment)."""
    return "^" + "[^/]+".join(re.escape(part) for part in pattern.split("*")) + "$"


def build_workspace(*, entity: str, project: str, name: str = "tsp_trainer"):
    """A wandb_workspaces.workspaces.Workspace holding every panel; nothing is sent anywhere."""
    import wandb_workspaces.workspaces as ws

    sections = [ws.Section(name=group, panels=[_line_plot(p) for p in panels_in_group(group)],
                           is_open=group in OPEN_GROUPS,
                           layout_settings=ws.SectionLayoutSettings(columns=4, rows=2))
                for group in PANEL_GROUPS if panels_in_group(group)]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections,
                        settings=ws.WorkspaceSettings(x_axis="Step"))


def _line_plot(panel: Panel):
    import wandb_workspaces.reports.v2 as wr

    if panel.table:        # the logged wandb.Table, as the run summary holds its last value
        return wr.WeavePanelSummaryTable(table_name=panel.metrics[0])
    families = [m for m in panel.metrics if "*" in m]
    if families:
        return wr.LinePlot(title=panel.title, x="Step", metric_regex=glob_to_regex(families[0]),
                           log_y=panel.log_y or None)
    return wr.LinePlot(title=panel.title, x="Step", y=list(panel.metrics), log_y=panel.log_y or None)


def workspace_spec(workspace) -> dict:
    """The view exactly as Workspace.save() would send it (its pydantic model), as plain JSON data."""
    return json.loads(workspace._to_model().model_dump_json(by_alias=True, exclude_none=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tsp-dashboard", description="Build the W&B workspace "
                                     "view of tsp_trainer's metrics for a project.")
    parser.add_argument("--entity", help="W&B entity (user or team); needed to save, optional "
                        "with --json")
    parser.add_argument("--project", help="W&B project (logging.wandb_project); needed to save, "
                        "optional with --json")
    parser.add_argument("--name", default="tsp_trainer", help="name of the saved view")
    parser.add_argument("--json", metavar="PATH", help="write the view spec to PATH instead of "
                        "saving it to W&B (no network, no login)")
    args = parser.parse_args(argv)
    missing = [f"--{key}" for key in ("entity", "project") if getattr(args, key) is None]
    if missing and not args.json:
        parser.error(f"{' and '.join(missing)} needed to save the view to W&B (or write it offline "
                     "with --json PATH)")
    workspace = build_workspace(entity=args.entity or "", project=args.project or "", name=args.name)
    if args.json:
        spec = workspace_spec(workspace)
        for key in ("entity", "project"):          # not given: the spec names none
            if not spec.get(key):
                spec.pop(key, None)
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec, indent=1) + "\n")
        print(f"tsp-dashboard: wrote the view spec ({len(workspace.sections)} sections, "
              f"{sum(len(s.panels) for s in workspace.sections)} panels) to {path}")
        return 0
    try:
        saved = workspace.save()
    except Exception as err:                      # no login, no network, unknown project
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        print(f"tsp-dashboard: error: saving the view to W&B failed ({type(err).__name__}: {first}); "
              "check `wandb login` and the entity/project, or use --json PATH offline", file=sys.stderr)
        return 1
    print(f"tsp-dashboard: saved {saved.url}")
    return 0
