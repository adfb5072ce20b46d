"""Training checkpoints: everything `--save`, `--load` and the launch scripts' resume rule do with them
(docs/checkpoints.md).

- `protocol`: the on-disk protocol alone (tag names, `latest`, the completion marker, the staged
  save and its swap into place); standard library only, so the launch scripts can use it without torch.
- `run_folder`: the one resume rule every launch path asks (`python -m megatron.checkpointing.run_folder`).
- `resume_check`: at start-up, whether `--load` can be resumed by this run's layout.
- `save_load`: saving and resuming through the DeepSpeed engine; `writer` flushes each file it writes and
  takes its CRC-32 as it goes (`checksum`: the manifest's CRC-32s, standard library only),
  `rng` keeps the random generators; `async_save` is `--async-save` (a host copy written by a thread);
  `universal`: resuming on another data-parallel size or ZeRO stage.
- `interval`: how often to save, given a save's time and the cluster's MTBF (standard library only).

Nothing is imported here, so that importing `protocol` or `run_folder` does not import torch.
"""
