"""``kvroute demo``: an embedded cluster, the policy comparison and the fault scenarios.

Reusable pieces (e.g. for ``kvroute bench``):

- ``workload``: ``WorkloadSpec`` / ``build_workload(spec) -> Workload`` — seeded shared-prefix
  groups, multi-turn sessions, Poisson arrivals, Zipf popularity; each ``DemoRequest`` carries
  its tokens and block keys.
- ``baselines``: the baseline pickers the comparison measures kvroute against (not router
  policies; ``baseline_pickers(seed)``, each a ``BaselinePicker`` whose ``choose(keys, view) -> int``
  reads a ``ClusterView``) and the compared names.
- ``runner``: ``ClusterSpec``, ``build_cluster(cluster_spec, workload)`` (a fresh SimCluster),
  ``run_baseline(policy, workload, cluster_spec)`` (sync, in-memory), ``open_kvroute(cluster,
  workload_spec, clock=..., extra_settings=...)`` (the cluster served over loopback gRPC plus the
  real router on it) and ``run_kvroute(setup, sim_clock, workload)``; runs return a ``PolicyRun``.
  See the runner's docstring for how the simulated clock and real-time RPCs fit together.
- ``lineup``: every compared policy (``LINEUP``), ``lineup_baselines(seed, block_size)`` and
  ``run_lineup_baseline(policy, workload, cluster_spec)`` (the oracle: ``oracle.run_oracle``, the best
  of its family of exact placements).
- ``load``: the load axis — ``offered_load(workload, cluster_spec)`` (best-reuse prefill work over the
  bulk of the arrivals / prefill capacity), ``scale_to_load``, ``workers_for_load``.
- ``ladder``: ``run_ladder(...)`` every policy at several loads (kvroute under a MockClock).
- ``trace``: Mooncake-format traces (read, generate, replay as a ``Workload``).
- ``report``: ``summarize(run) -> PolicySummary``, ``format_table``, ``check_targets``,
  ``results_json`` / ``write_results`` / ``write_chart``.
- ``scenarios``: ``SCENARIOS``, ``run_scenario(scenario, scale=...)``, ``run_scenarios(...)``;
  the ``master-*`` ones serve a SimMaster (``open_kvroute(..., master=...)``).
- ``master_outage``: ``run_master_outage(workload, cluster_spec)`` — the scheduler healthy, down with
  the KVCM path, down with the KVCM fallback off (domain) — its table, JSON and chart.
- ``cli``: the ``kvroute demo`` subcommand.
"""
