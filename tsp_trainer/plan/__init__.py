"""tsp-plan: the per-rank model of one training step of every scheme on a hardware profile (layout.py,
precision.py, state.py, activations.py, transients.py, communication.py, flops.py, predict.py,
hardware.py), the layout search and ranking (search.py, longest.py, report.py, cli.py), and the
full-scale dry run of the real code on fake tensors and a fake process group (dry_run.py). See
docs/planner.md."""
