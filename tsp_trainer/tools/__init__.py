"""Tools the package and its tests share: the fork/spawn launcher of per-rank functions (launch),
the per-rank memory tracker (memory) and the host-sync counter (host_sync). tsp-bench and the
planner's dry run use them; they import nothing of either."""
