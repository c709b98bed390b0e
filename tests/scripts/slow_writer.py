"""For the chaos tests: DeepSpeed's decoupled checkpoint writer, slowed down so that a test can kill
a job while an asynchronous save is being written.

``install(seconds)`` (in the rank, after hfscale.training.async_save.install) makes every writer
process this rank starts run ``main``: each ``write`` of DeepSpeed's Python file writer sleeps
``seconds`` first (read back in the writer from $HFSCALE_TEST_WRITE_DELAY), then hfscale's writer runs.
"""

from __future__ import annotations

import os
import time


def main(*args):
    from deepspeed.io import py_file_writer

    from hfscale.training.async_save import writer_main

    delay = float(os.environ.get("HFSCALE_TEST_WRITE_DELAY", "0"))
    write = py_file_writer.PyFileWriter.write

    def slow_write(self, buffer):
        time.sleep(delay)
        return write(self, buffer)

    py_file_writer.PyFileWriter.write = slow_write
    writer_main(*args)


def install(seconds: float) -> None:
    from deepspeed.runtime.checkpoint_engine import decoupled_checkpoint_engine as dce

    os.environ["HFSCALE_TEST_WRITE_DELAY"] = str(seconds)
    dce.init_decoupled_checkpoint = main
