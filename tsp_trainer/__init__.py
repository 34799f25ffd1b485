"""tsp_trainer: long-context transformer training with TSP (tensor + sequence parallelism folded
onto one device-mesh axis), after Zyphra, arXiv 2604.26294."""

__version__ = "0.1.0"
