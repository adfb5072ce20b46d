"""Launching: everything between a launch script and a rank's first collective.

- `dist_env`: which rank this process is, from whichever launcher started it (torchrun, deepspeed,
  mpiexec, srun), and where the ranks meet.
- `attempt`: one attempt of a run under a launcher: its output kept, the launcher's report set aside,
  the cause of a failure as the last line (`python -m megatron.launch.attempt`).
- `launcher_output`: which output lines are a launcher's own, and what a failed launch died of.
- `flag_sources`: error messages name the launch script's variable a flag came from.
- `network`: the interface the ranks of a host use, the one that reaches the master.
- `lost_peer`: a collective failed because a host is gone, said in one line naming it.
- `heartbeat`: a host that falls silent (a cut link) ends the job within a minute.

Nothing is imported here; what the launch scripts run before any rank (`attempt`, `launcher_output`,
`flag_sources`) imports neither torch nor DeepSpeed.
"""
