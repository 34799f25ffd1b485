"""tsp-bench: TSP and the baselines measured side by side (memory, bytes, time); see cli.py."""
