"""tsp-plan: analytic per-rank memory / communication / compute model of every scheme on a hardware
profile (analytic.py, hardware.py), the layout search and ranking (search.py, report.py, cli.py),
and the full-scale dry run of the real code on fake tensors and a fake process group (dry_run.py).
See docs/planner.md."""
