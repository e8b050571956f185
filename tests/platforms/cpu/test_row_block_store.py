"""The batch-invariant oneDNN row blocks kept on disk (rayllm/platforms/cpu/row_block_store.py): a later process
takes the probe's answer from the file instead of probing again; a key changes with what decides oneDNN's
kernel; a damaged, out-of-range or foreign entry means a probe, as without the file."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rayllm.platforms.cpu import onednn, row_block_store
from rayllm.platforms.cpu.onednn import OneDNNWeight, onednn_available

SHAPE = (96, 256)  # small: the probe runs ~130 GEMMs of it


@pytest.fixture
def store_dir(monkeypatch, tmp_path):
    if not onednn_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("torch built without oneDNN's bf16 GEMMs")
    monkeypatch.setenv("RAYLLM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(onednn, "_ROW_BLOCKS", {})  # as in a new process
    return tmp_path


def weight() -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(1)).bfloat16()


def test_a_later_process_reads_the_probed_block_instead_of_probing(store_dir, monkeypatch):
    probed = OneDNNWeight(weight(), batch_invariant=True).row_block
    entries = json.loads((store_dir / row_block_store.FILE).read_text())
    assert list(entries.values()) == [probed]
    monkeypatch.setattr(onednn, "_ROW_BLOCKS", {})

    def no_probe(*args):
        raise AssertionError("probed although the answer was stored")

    monkeypatch.setattr(onednn, "_probe_row_block", no_probe)
    assert OneDNNWeight(weight(), batch_invariant=True).row_block == probed
    # Another thread count is another key: probed (here: refused), not taken from the file.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        with pytest.raises(AssertionError, match="probed"):
            OneDNNWeight(weight(), batch_invariant=True)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("content", ["{not json", json.dumps([64]), "VALUE"])
def test_a_damaged_or_impossible_entry_means_a_probe(store_dir, monkeypatch, content):
    key = row_block_store.key(SHAPE, torch.bfloat16, torch.get_num_threads())
    text = json.dumps({key: 5}) if content == "VALUE" else content  # 5: no block a probe returns
    (store_dir / row_block_store.FILE).write_text(text)
    monkeypatch.setattr(onednn, "_probe_row_block", lambda gemm, k, dtype: 16)
    assert OneDNNWeight(weight(), batch_invariant=True).row_block == 16
    assert json.loads((store_dir / row_block_store.FILE).read_text())[key] == 16  # the probe's answer replaced it


def test_a_file_others_may_write_is_not_read(store_dir):
    key = row_block_store.key(SHAPE, torch.bfloat16, 2)
    path = store_dir / row_block_store.FILE
    path.write_text(json.dumps({key: 32}))
    os.chmod(path, 0o600)
    assert row_block_store.stored(SHAPE, torch.bfloat16, 2) == 32
    os.chmod(path, 0o666)
    assert row_block_store.stored(SHAPE, torch.bfloat16, 2) is None


def test_the_key_changes_with_what_decides_the_kernel(monkeypatch):
    base = row_block_store.key(SHAPE, torch.bfloat16, 2)
    assert base == row_block_store.key(SHAPE, torch.bfloat16, 2)
    assert base != row_block_store.key((SHAPE[0], SHAPE[1] * 2), torch.bfloat16, 2)
    assert base != row_block_store.key(SHAPE, torch.float32, 2)
    assert base != row_block_store.key(SHAPE, torch.bfloat16, 1)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # another ISA: another kernel
    assert base != row_block_store.key(SHAPE, torch.bfloat16, 2)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert base != row_block_store.key(SHAPE, torch.bfloat16, 2)


def test_an_unwritable_cache_directory_still_probes(monkeypatch, tmp_path):
    if not onednn_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("torch built without oneDNN's bf16 GEMMs")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("RAYLLM_KERNEL_CACHE", str(blocker / "below"))  # below a file: no directory there
    monkeypatch.setattr(onednn, "_ROW_BLOCKS", {})
    monkeypatch.setattr(onednn, "_probe_row_block", lambda gemm, k, dtype: 8)
    assert OneDNNWeight(weight(), batch_invariant=True).row_block == 8
