"""Background checkpoint writes (core/checkpoints/writer.py through AtomicCheckpointIO): the file
holds the state at the moment of the save, whatever training does after; best and last of one
state are one file's bytes; errors reach the training thread; no stage that does not fit."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest
import torch

from {{ cookiecutter.package_name }}.core.checkpoints import writer as checkpoint_writer
from {{ cookiecutter.package_name }}.core.checkpoints.io import AtomicCheckpointIO
from {{ cookiecutter.package_name }}.core.errors import DiskFull


def a_checkpoint(step: int = 1) -> dict:
    weight = torch.arange(12.0).reshape(3, 4)
    return {
        "global_step": step,
        "loops": {"fit_loop": {"progress": step}},
        "state_dict": {"w": weight, "tied": weight, "b": torch.ones(4, dtype=torch.bfloat16)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(3, 4), "step": torch.tensor(float(step))}}}],
        "callbacks": {"ModelCheckpoint": {"last_model_path": ""}},
        "rng": (1, [2, 3]),
    }


def test_a_background_save_writes_the_state_of_the_moment_of_the_save(tmp_path):
    checkpoint, path = a_checkpoint(), tmp_path / "last.ckpt"
    io = AtomicCheckpointIO(background=True)
    gate = threading.Event()
    write = io.write
    io.write = lambda staged, file: (gate.wait(10), write(staged, file))  # the writer holds until training moved on
    io.save_checkpoint(checkpoint, path)
    checkpoint["state_dict"]["w"].add_(100.0)  # training goes on: in-place updates, a new step
    checkpoint["loops"]["fit_loop"]["progress"] = 2
    checkpoint["optimizer_states"][0]["state"][0]["exp_avg"].fill_(7.0)
    assert not path.exists()
    gate.set()
    io.flush()
    saved = torch.load(path, weights_only=True)
    assert torch.equal(saved["state_dict"]["w"], torch.arange(12.0).reshape(3, 4))
    assert saved["loops"]["fit_loop"]["progress"] == 1 and saved["rng"] == (1, [2, 3])
    assert torch.equal(saved["optimizer_states"][0]["state"][0]["exp_avg"], torch.zeros(3, 4))
    assert saved["state_dict"]["b"].dtype == torch.bfloat16
    # Tied tensors stay one storage in the file, as torch.save of the live checkpoint keeps them.
    assert saved["state_dict"]["w"].untyped_storage().data_ptr() == saved["state_dict"]["tied"].untyped_storage().data_ptr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_the_staging_buffers_are_reused_by_the_next_save(tmp_path):
    io = AtomicCheckpointIO(background=True)
    io.save_checkpoint(a_checkpoint(1), tmp_path / "a.ckpt")
    io.flush()
    assert io.stager.bytes_to_allocate(a_checkpoint(2)) == 0
    held = io.stager.held_bytes()
    assert held == 12 * 4 + 4 * 2 + 12 * 4 + 4  # w (once: tied), b (bf16), exp_avg, step
    io.save_checkpoint(a_checkpoint(2), tmp_path / "a.ckpt")
    io.flush()
    assert io.stager.held_bytes() == held
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["global_step"] == 2


def test_last_of_the_same_state_as_the_best_is_a_hard_link_written_once(tmp_path):
    io = AtomicCheckpointIO(background=True)
    writes = []
    write = io.write
    io.write = lambda staged, file: (writes.append(staged["global_step"]), write(staged, file))
    checkpoint = a_checkpoint(5)
    io.save_checkpoint(checkpoint, tmp_path / "best-step5.ckpt")
    checkpoint["callbacks"]["ModelCheckpoint"]["last_model_path"] = str(tmp_path / "last.ckpt")  # only the callbacks differ
    io.save_checkpoint(checkpoint, tmp_path / "last.ckpt")
    io.flush()
    assert writes == [5]
    assert os.stat(tmp_path / "last.ckpt").st_ino == os.stat(tmp_path / "best-step5.ckpt").st_ino
    # The best file goes when a better one comes (queued after the writes: no wait): last.ckpt keeps its bytes.
    io.remove_checkpoint(tmp_path / "best-step5.ckpt")
    io.flush()
    assert not (tmp_path / "best-step5.ckpt").exists()
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 5
    # Another point of the loop (a step later, or the same step before validation) is written again.
    io.save_checkpoint(a_checkpoint(6), tmp_path / "best-step6.ckpt")
    io.save_checkpoint({**a_checkpoint(6), "loops": {"fit_loop": {"progress": 7}}}, tmp_path / "last.ckpt")
    io.flush()
    assert writes == [5, 6, 6]
    assert os.stat(tmp_path / "last.ckpt").st_ino != os.stat(tmp_path / "best-step6.ckpt").st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-step6.ckpt", "last.ckpt"]


def counting_io() -> tuple[AtomicCheckpointIO, list[tuple[str, int]]]:
    """A background IO that records each full write as (file name, global_step)."""
    io, writes = AtomicCheckpointIO(background=True), []
    write = io.write
    io.write = lambda staged, file: (writes.append((os.path.basename(file.name), staged["global_step"])), write(staged, file))
    return io, writes


def after_validation(step: int) -> dict:
    """The checkpoint of ``step`` after a validation: the same weights, other loop counters."""
    return {**a_checkpoint(step), "loops": {"fit_loop": {"progress": step}, "val_loop": {"progress": 1}}}


def test_a_held_step_checkpoint_superseded_by_the_validation_of_its_step_is_not_written(tmp_path):
    io, writes = counting_io()
    io.hold_saves = True
    io.save_checkpoint(a_checkpoint(5), tmp_path / "last.ckpt")  # the step checkpoint, before the validation
    assert writes == [] and not (tmp_path / "last.ckpt").exists()  # held
    io.save_checkpoint(after_validation(5), tmp_path / "best-step5.ckpt")  # a new best at that step
    io.save_checkpoint(after_validation(5), tmp_path / "last.ckpt")  # ModelCheckpoint's save_last: the same state
    io.flush()
    assert writes == [(".best-step5.ckpt.partial", 5)]  # the step's bytes once
    assert os.stat(tmp_path / "last.ckpt").st_ino == os.stat(tmp_path / "best-step5.ckpt").st_ino
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["loops"]["val_loop"] == {"progress": 1}
    # No new best: ModelCheckpoint saves last.ckpt alone, after the validation; one write again.
    io.save_checkpoint(a_checkpoint(10), tmp_path / "last.ckpt")
    io.save_checkpoint(after_validation(10), tmp_path / "last.ckpt")
    io.flush()
    assert writes[1:] == [(".last.ckpt.partial", 10)]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["loops"]["val_loop"] == {"progress": 1}
    assert io.stager.held_bytes() > 0 and io.stager.bytes_to_allocate(a_checkpoint(11)) == 0  # the dropped copy's buffers reused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-step5.ckpt", "last.ckpt"]


def test_a_held_checkpoint_is_written_at_the_next_batch_a_save_of_another_step_or_the_end(tmp_path):
    io, writes = counting_io()
    io.hold_saves = True
    io.save_checkpoint(a_checkpoint(5), tmp_path / "last.ckpt")
    io.release()  # the next training batch (HoldStepCheckpoint)
    io.writer.wait()
    assert writes == [(".last.ckpt.partial", 5)]
    io.save_checkpoint(a_checkpoint(6), tmp_path / "last.ckpt")
    io.save_checkpoint(a_checkpoint(7), tmp_path / "best.ckpt")  # another step: the held one is written first
    io.writer.wait()
    assert writes[1:] == [(".last.ckpt.partial", 6)]
    io.teardown()  # the end of the fit writes what is held
    assert writes[2:] == [(".best.ckpt.partial", 7)]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 6
    # Held in another folder: not the same file set, written as it is.
    io.save_checkpoint(a_checkpoint(8), tmp_path / "last.ckpt")
    (tmp_path / "other").mkdir()
    io.save_checkpoint(after_validation(8), tmp_path / "other" / "best.ckpt")
    io.flush()
    assert writes[3:] == [(".last.ckpt.partial", 8), (".best.ckpt.partial", 8)]
    assert os.stat(tmp_path / "last.ckpt").st_ino != os.stat(tmp_path / "other" / "best.ckpt").st_ino


def test_a_background_write_that_finds_the_disk_full_stops_the_next_save_and_drops_what_follows(tmp_path):
    io = AtomicCheckpointIO(background=True)
    io.save_checkpoint(a_checkpoint(1), tmp_path / "last.ckpt")
    io.flush()

    gate = threading.Event()

    def full(staged, file):
        gate.wait(10)
        raise OSError(errno.ENOSPC, "No space left on device")

    io.write = full
    second = a_checkpoint(2)
    io.save_checkpoint(second, tmp_path / "best.ckpt")
    io.save_checkpoint(second, tmp_path / "last.ckpt")  # a link to a file that will not exist: dropped
    gate.set()
    with pytest.raises(DiskFull) as error:
        io.save_checkpoint(a_checkpoint(3), tmp_path / "last.ckpt")
    assert error.value.path == tmp_path / "best.ckpt" and error.value.needed > 0
    io.flush()  # raised once
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1  # the previous file, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_teardown_waits_for_the_write_and_keeps_its_error_for_the_next_flush(tmp_path):
    io = AtomicCheckpointIO(background=True)
    io.write = lambda staged, file: (_ for _ in ()).throw(RuntimeError("writer failed"))
    io.save_checkpoint(a_checkpoint(1), tmp_path / "last.ckpt")
    io.teardown()  # (on the way out of a failed fit: must not replace that error)
    with pytest.raises(RuntimeError, match="writer failed"):
        io.flush()


def test_a_checkpoint_that_does_not_fit_in_host_memory_is_written_synchronously(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(checkpoint_writer, "host_available", lambda: checkpoint_writer.HOST_RESERVE + 10)
    monkeypatch.setattr("{{ cookiecutter.package_name }}.core.checkpoints.io.host_available", checkpoint_writer.host_available)
    io = AtomicCheckpointIO(background=True)
    threads = []
    write = io.write
    io.write = lambda staged, file: (threads.append(threading.current_thread().name), write(staged, file))
    with caplog.at_level(logging.WARNING):
        io.save_checkpoint(a_checkpoint(1), tmp_path / "last.ckpt")
    assert threads == [threading.current_thread().name]  # written before save_checkpoint returned
    assert "written synchronously instead" in caplog.text and "GiB of host memory" in caplog.text
    assert io.stager.held_bytes() == 0


def test_the_writer_thread_does_the_write(tmp_path):
    io = AtomicCheckpointIO(background=True)
    threads = []
    write = io.write
    io.write = lambda staged, file: (threads.append(threading.current_thread().name), write(staged, file))
    io.save_checkpoint(a_checkpoint(1), tmp_path / "last.ckpt")
    io.flush()
    assert threads == [checkpoint_writer.THREAD_NAME] and io.writer.pending == 0
{%- if cookiecutter.tasks != "causal_lm" %}


def test_a_finished_run_leaves_no_writer_thread_holding_a_staged_copy(make_cfg, tmp_path):
    """Each run's writer thread ends with the run (a sweep's trials in one process leaked one thread
    and one staged checkpoint each); a later save starts another."""
    import threading

    from {{ cookiecutter.package_name }}.core.checkpoints.writer import THREAD_NAME
    from {{ cookiecutter.package_name }}.train import train

    for run in ("a", "b"):  # no test split after the fit: its last write was never followed by a teardown
        train(make_cfg("trainer.max_steps=2", "test_after_fit=false", f"paths.output_dir={tmp_path / run}"))
    assert not [thread for thread in threading.enumerate() if thread.name == THREAD_NAME]


def test_in_a_real_fit_last_ckpt_after_a_validation_is_not_written_again(make_cfg, tmp_path):
    from {{ cookiecutter.package_name }}.core.checkpoints.io import trained_checkpoint
    from {{ cookiecutter.package_name }}.train import train

    writes = []
    write = AtomicCheckpointIO.write

    def counted(self, checkpoint, file):
        writes.append((os.path.basename(file.name), checkpoint["global_step"]))
        write(self, checkpoint, file)

    AtomicCheckpointIO.write = counted
    try:  # every validation keeps its checkpoint (save_top_k=-1) and saves last.ckpt of the same state
        train(
            make_cfg(
                "trainer.max_steps=4", "trainer.val_check_interval=2", "callbacks.model_checkpoint.save_top_k=-1", "test_after_fit=false"
            )
        )
    finally:
        AtomicCheckpointIO.write = write
    folder = tmp_path / "run" / "checkpoints"
    assert [step for name, step in writes if name == ".best-epoch00-step{:06d}.ckpt.partial".format(step)] == [2, 4]
    # last.ckpt of steps 2 and 4 were links to those files; the one write is the end of the epoch (its own state).
    assert [step for name, step in writes if name == ".last.ckpt.partial"] == [4]
    assert trained_checkpoint(folder / "last.ckpt")["global_step"] == 4
    assert trained_checkpoint(folder / "best-epoch00-step000002.ckpt")["global_step"] == 2


def test_in_a_real_fit_a_step_checkpoint_at_a_validation_step_is_written_once(make_cfg, tmp_path):
    from {{ cookiecutter.package_name }}.core.checkpoints.io import trained_checkpoint
    from {{ cookiecutter.package_name }}.train import train

    writes = []
    write = AtomicCheckpointIO.write

    def counted(self, checkpoint, file):
        writes.append((os.path.basename(file.name), checkpoint["global_step"]))
        write(self, checkpoint, file)

    AtomicCheckpointIO.write = counted
    try:  # the step checkpoint and a validation at steps 2, 4 and 6, a step checkpoint alone at 3
        train(
            make_cfg(
                "trainer.max_steps=6",
                "trainer.val_check_interval=2",
                "callbacks.step_checkpoint.every_n_train_steps=3",
                "callbacks.model_checkpoint.save_top_k=-1",
                "callbacks.step_checkpoint.save_on_train_epoch_end=false",
                "test_after_fit=false",
            )
        )
    finally:
        AtomicCheckpointIO.write = write
    folder = tmp_path / "run" / "checkpoints"
    best = [step for name, step in writes if name.startswith(".best-")]
    assert best == [2, 4, 6]
    # Step 3's step checkpoint is written (at the next batch); step 6's is superseded by that
    # step's validation (best-*-step000006.ckpt), and last.ckpt is a link to it.
    assert [step for name, step in writes if name == ".last.ckpt.partial"] == [3]
    assert os.stat(folder / "last.ckpt").st_ino == os.stat(folder / "best-epoch00-step000006.ckpt").st_ino
    assert trained_checkpoint(folder / "last.ckpt")["global_step"] == 6
{%- endif %}
