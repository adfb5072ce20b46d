"""DeepSpeed's torch.save checkpoint engine, writing each file through a handle that is fsynced, that
keeps the OS error of a failed write, and that takes the file's CRC-32 as it is written (the manifest)."""
import os

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from megatron.checkpointing.checksum import StreamCRC, format_crc


class FlushingCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save engine, writing through a Python file so that (1) each file is fsynced
    before the barrier after which the marker vouches for it, (2) a failed write reports its OS
    error (torch's zip writer says only "unexpected pos ..." when the disk is full), and (3) each file's
    size and CRC-32 are known without reading it back: `written` maps every path saved since
    `start_manifest` to them (checksum.py). checksums=False: sizes only (the save of before, for
    bench/bench_checkpoint_manifest.py)."""

    def __init__(self, config_params=None, checksums: bool = True):
        super().__init__(config_params)
        self.checksums = checksums
        self.written: dict[str, tuple[int, str | None]] = {}

    def start_manifest(self) -> None:
        self.written = {}

    def save(self, state_dict, path: str):
        # torch's own per-record CRC-32 is reused only where its zip writer computes one
        crc = StreamCRC(self.zipfile_serialization and torch.serialization.get_crc32_options()) \
            if self.checksums else None
        with open(path, "wb") as handle:
            writer = _RecordingWriter(handle, crc)
            try:
                torch.save(state_dict, writer, _use_new_zipfile_serialization=self.zipfile_serialization)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
            handle.flush()
            os.fsync(handle.fileno())
            size = handle.tell()
        self.written[path] = (size, format_crc(crc.finish(path)) if crc is not None else None)


class _RecordingWriter:
    """A file's write and flush that remember the OSError torch's writer swallows, and feed what is
    written to the file's CRC-32."""

    def __init__(self, handle, crc: StreamCRC | None):
        self.handle, self.crc, self.error = handle, crc, None

    def write(self, data) -> int:
        try:
            written = self.handle.write(data)
        except OSError as err:
            self.error = err
            raise
        if self.crc is not None:
            self.crc.update(data)
        return written

    def flush(self):
        self.handle.flush()
