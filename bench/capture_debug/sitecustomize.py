"""Python loads this at start-up where this folder is on PYTHONPATH (a bench probe, never the product).

CUDA-graph capture then runs with torch's sync debugging set to raise, and a failed capture writes its
whole traceback to the file ``STUDIO_CAPTURE_LOG`` names: engine/fast/graphs.py keeps only the last line
of the error ("operation failed due to a previous error during capture"), which does not say which
operation broke the capture. Used to find why Granite's real shape fell back to eager steps in the family
grid (bench/NOTES.md).
"""

import os
import traceback

import torch

_make = torch.cuda.make_graphed_callables


def _debugged(*args, **kwargs):
    torch.cuda.set_sync_debug_mode("error")
    try:
        return _make(*args, **kwargs)
    except Exception:
        with open(os.environ.get("STUDIO_CAPTURE_LOG", "/tmp/capture.txt"), "a") as log:
            log.write("CAPTURE FAILED\n" + traceback.format_exc() + "\n")
        raise
    finally:
        torch.cuda.set_sync_debug_mode(0)


torch.cuda.make_graphed_callables = _debugged
