"""A disk that fills up while a checkpoint is written: a clear error naming the path, the previous
checkpoint intact, no temporary folder left, and a rerun after freeing space that succeeds.

The small disk is a real size-limited tmpfs that bubblewrap mounts in a mount namespace of its own.
The engine test reaches it from this process through ``/proc/<a process holding it>/root``, so it
uses the session's warm engine. The flow test runs ``disk_full_driver.py`` inside bubblewrap
instead: SQLite (Prefect's and MLflow's stores) resolves ``/proc/<pid>/root`` to the host's folder.
"""

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import EMBEDDED, lora_snapshot, sft_datum

from mint import types
from mint.checkpoints import checkpoint_digest, read_manifest

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[1]
MB = 2**20


@contextlib.contextmanager
def small_disk(size: int):
    """A folder on a tmpfs of ``size`` bytes that exists only while the context is open."""
    if not shutil.which("bwrap"):
        pytest.skip("needs bubblewrap (bwrap) to mount a size-limited tmpfs")
    mountpoint = tempfile.mkdtemp(prefix="mintflow-small-disk-")
    # --size must come right before --tmpfs; the child prints its pid (no pid namespace: a host pid) and sleeps.
    holder = subprocess.Popen(["bwrap", "--dev-bind", "/", "/", "--size", str(size), "--tmpfs", mountpoint,
                               "--die-with-parent", "--", "sh", "-c", "echo $$; exec sleep 3600"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = ""
    try:
        line = holder.stdout.readline().strip()
        if not line.isdigit():
            pytest.skip(f"bwrap cannot mount a tmpfs here: {holder.stderr.read().strip()[:300]}")
        folder = Path(f"/proc/{line}/root{mountpoint}")
        total = os.statvfs(folder).f_blocks * os.statvfs(folder).f_frsize
        assert size - MB <= total <= size + MB, f"{folder} is not the {size}-byte tmpfs ({total} bytes)"
        yield folder
    finally:
        if line.isdigit():  # the sleeper holds the mount; bwrap exits with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line), signal.SIGKILL)
        try:
            holder.wait(timeout=10)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        shutil.rmtree(mountpoint, ignore_errors=True)


def fill(folder: Path, leave: int) -> Path:
    """A filler file that leaves ``leave`` bytes free on ``folder``'s disk."""
    filler = folder / "filler"
    free = shutil.disk_usage(folder).free
    with open(filler, "wb") as f:
        f.truncate(0)
        block = b"\0" * MB
        remaining = free - leave
        while remaining > 0:
            remaining -= f.write(block[:remaining])
        f.flush()
        os.fsync(f.fileno())
    assert abs(shutil.disk_usage(folder).free - leave) < MB
    return filler


def assert_disk_full_error(exc: BaseException, path: Path) -> None:
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC, repr(exc)
    assert str(path) in str(exc) and "disk is full" in str(exc), str(exc)
    assert exc.__cause__ is not None  # the library's own error, chained


def test_a_full_disk_fails_a_checkpoint_clearly_keeps_the_previous_one_and_a_save_after_freeing_space_works(
        service, tokenizer):
    data = [sft_datum(tokenizer, "What is 2 + 3?", "5")]
    adam = types.AdamParams(learning_rate=1e-3)
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=7)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam).result()
    with small_disk(64 * MB) as disk:
        previous = Path(tc.save_state(str(disk / "ckpt")).result().path)
        saved = lora_snapshot(tc)
        digest = checkpoint_digest(previous)
        size = sum(f.stat().st_size for f in previous.iterdir())
        assert 10 * MB < size < 30 * MB  # rank 4 with Adam state: ~17 MB
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam).result()  # the client moved on: a save now writes different content

        # Room for nothing, then for the adapter but not the Adam state (the save dies mid-folder).
        for leave in (0, size // 2):
            filler = fill(disk, leave)
            for target in (disk / "new", previous):  # a new path, and replacing the previous checkpoint
                with pytest.raises(OSError) as raised:
                    tc.save_state(str(target)).result()
                assert_disk_full_error(raised.value, target)
                assert sorted(p.name for p in disk.iterdir()) == ["ckpt", "filler"]  # no temporary folder left
                read_manifest(previous)  # verifies every file's size and sha256
                assert checkpoint_digest(previous) == digest
            filler.unlink()

        fresh = service.create_lora_training_client(EMBEDDED, rank=4, seed=8)
        fresh.load_state(str(previous)).result()
        assert all(torch.equal(value, saved[key]) for key, value in lora_snapshot(fresh).items())
        resumed = service.create_training_client_from_state(str(previous))
        assert resumed.step == 1

        # With the space freed, both saves go through and verify.
        for target in (disk / "new", previous):
            assert Path(tc.save_state(str(target)).result().path) == target
            assert read_manifest(target)["step"] == 2
        assert checkpoint_digest(previous) != digest
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt", "new"]


def _exception_lines(log: str) -> list[str]:
    return re.findall(r"^[\w.]+(?:Error|Exception): .*$", log, flags=re.MULTILINE)


def test_a_disk_that_fills_mid_run_stops_the_run_clearly_and_a_rerun_after_freeing_space_gives_the_normal_result(
        tmp_path):
    from disk_full_driver import run_cli

    if not shutil.which("bwrap"):
        pytest.skip("needs bubblewrap (bwrap) to mount a size-limited tmpfs")
    reference_home = tmp_path / "reference"
    rc, reference = run_cli(reference_home, tmp_path / "reference.log")
    assert rc == 0, (tmp_path / "reference.log").read_text()[-3000:]
    # In the order written: init_policy (no Adam state yet), sft_warm_start, train 1, train 2.
    sizes = [sum(f.stat().st_size for f in c.iterdir())
             for c in sorted((reference_home / "checkpoints").iterdir(), key=lambda c: c.stat().st_mtime)]
    assert len(sizes) == 4 and 40 * MB < sizes[-1] < 80 * MB, sizes  # ~57 MB with Adam state
    # Room for the first three checkpoints and half the last: the run starts and runs out in iteration 2's train.
    leave = sum(sizes[:3]) + sizes[3] // 2
    mountpoint = Path(tempfile.mkdtemp(prefix="mintflow-small-disk-"))
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        driver = subprocess.run(["bwrap", "--dev-bind", "/", "/", "--size", str(512 * MB), "--tmpfs", str(mountpoint),
                                 "--die-with-parent", "--", sys.executable, str(ROOT / "tests" / "disk_full_driver.py"),
                                 str(mountpoint), str(leave), str(logs)],
                                cwd=ROOT, capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(mountpoint, ignore_errors=True)
    assert driver.returncode == 0, driver.stderr[-3000:]
    report = json.loads(driver.stdout.strip().splitlines()[-1])
    first, rerun = report["first"], report["rerun"]

    # The first run stops with the disk-full error naming the checkpoint, and nothing else goes wrong.
    log = (logs / "first.log").read_text()
    assert first["rc"] != 0, log[-3000:]
    errors = _exception_lines(log)
    assert errors and all("No space left on device" in e or "disk is full" in e for e in errors), errors
    assert errors[-1].startswith("mint.checkpoints.DiskFullError: [Errno 28] checkpoint ")
    assert "/home/checkpoints/" in errors[-1] and "the disk is full" in errors[-1], errors[-1]
    assert len(first["checkpoints"]["verified"]) == 3, first["checkpoints"]  # init, sft, train 1: complete
    assert set(first["checkpoints"]["verified"].values()) == {"ok"}, first["checkpoints"]
    assert first["hidden"] == [], first["hidden"]  # no temporary folder or file left behind
    assert set(first["databases"].values()) == {"ok"}, first["databases"]  # SQLite stores intact
    [failed] = first["mlflow_runs"]
    assert failed["status"] == "FAILED" and failed["iteration_done"] == [0, 1], failed

    # With the space freed, the rerun completes with the uninterrupted run's result, each step logged once.
    assert rerun["rc"] == 0, (logs / "rerun.log").read_text()[-3000:]
    assert rerun["summary"]["final_checkpoint_digest"] == reference["final_checkpoint_digest"]
    assert rerun["summary"]["final_eval"]["eval_accuracy"] == reference["final_eval"]["eval_accuracy"]
    assert rerun["summary"]["tasks_cached"] >= 6  # what the first run finished is reused
    assert len(rerun["checkpoints"]["verified"]) == 4 and set(rerun["checkpoints"]["verified"].values()) == {"ok"}
    assert rerun["hidden"] == [] and set(rerun["databases"].values()) == {"ok"}
    [done] = rerun["mlflow_runs"]
    assert done["run_id"] == failed["run_id"] and done["status"] == "FINISHED", done
    assert done["reward_mean"] == [1, 2] and done["iteration_done"] == [0, 1, 2] and done["eval_accuracy"] == [0, 2]
    assert len(rerun["uploads"]) == 2 and set(rerun["uploads"].values()) == {"ok"}, rerun["uploads"]


def test_a_run_on_a_full_disk_is_refused_before_it_starts_naming_the_disk(tmp_path):
    with small_disk(8 * MB) as disk:
        home = disk / "home"
        out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "math"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "MINTFLOW_HOME": str(home),
                                                          "PREFECT_HOME": str(home / "prefect")})
        assert out.returncode != 0
        assert f"the disk of {home} is full" in out.stderr and "free some space" in out.stderr, out.stderr[-2000:]
        assert not [p for p in home.rglob("*") if p.is_file()]  # refused before anything was written
