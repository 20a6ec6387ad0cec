"""The torch version pyproject.toml declares is at least the first release of every torch API autopar calls
that older releases lack: a table of the API, where autopar calls it, and the first release that has it
(read from each release's wheel: torch/distributed/distributed_c10d.py, pipelining/schedules.py,
checkpoint/__init__.py). An API newer than the floor joins the table, and the floor follows."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]

# API -> (a string of its call in autopar's source, the file, the first torch release that has it)
FIRST_RELEASE = {
    "dist.broadcast(group_src=)": ("group_src=", "autopar/runtime/pipeline/runner.py", (2, 6)),
    "pipelining schedules' scale_grads=": ("scale_grads=", "autopar/runtime/pipeline/stages.py", (2, 7)),
    # 2.7 has it only as torch.distributed.checkpoint._HuggingFaceStorageReader
    "torch.distributed.checkpoint.HuggingFaceStorageReader": ("dcp.HuggingFaceStorageReader",
                                                              "autopar/checkpoint/hugging_face.py", (2, 8)),
}


def _declared_floor() -> tuple:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.findall(r'"torch>=([0-9][0-9.]*)"', text)
    assert len(found) == 1, f"pyproject.toml should declare torch>=X once, found {found}"
    return tuple(int(n) for n in found[0].split("."))


def test_declared_floor_has_every_api_autopar_calls():
    floor = _declared_floor()
    too_new = {api: first for api, (_, _, first) in FIRST_RELEASE.items() if floor < first}
    assert not too_new, f"pyproject.toml declares torch>={'.'.join(map(str, floor))}, older than {too_new}"


def test_the_table_names_calls_autopar_makes():
    """A table entry whose call is gone from autopar no longer holds the floor up: drop it (or move it)."""
    for api, (call, path, _) in FIRST_RELEASE.items():
        assert call in (ROOT / path).read_text(), f"{api}: {call!r} is not in {path}"


def test_the_installed_torch_has_every_api_in_the_table():
    """The names in the table are the real ones (this torch is at least as new as each)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.pipelining import Schedule1F1B
    assert "group_src" in inspect.signature(dist.broadcast).parameters
    assert "scale_grads" in inspect.signature(Schedule1F1B.__init__).parameters
    assert hasattr(dcp, "HuggingFaceStorageReader")
