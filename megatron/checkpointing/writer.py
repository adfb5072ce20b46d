"""DeepSpeed's torch.save checkpoint engine, writing each file through a handle that is fsynced and that
keeps the OS error of a failed write."""
import os

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine


class FlushingCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save engine, writing through a Python file so that (1) each file is fsynced
    before the barrier after which the marker vouches for it, and (2) a failed write reports its OS
    error (torch's zip writer says only "unexpected pos ..." when the disk is full)."""

    def save(self, state_dict, path: str):
        with open(path, "wb") as handle:
            writer = _RecordingWriter(handle)
            try:
                torch.save(state_dict, writer, _use_new_zipfile_serialization=self.zipfile_serialization)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
            handle.flush()
            os.fsync(handle.fileno())


class _RecordingWriter:
    """A file's write and flush that remember the OSError torch's writer swallows."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self):
        self.handle.flush()
