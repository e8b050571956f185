"""Where the C kernels are built and which cached library may be loaded (rayllm/platforms/cpu/kernels.py):
a process with no home directory, a private temp dir per user, the owner of a cached library, and the CPU
tag that keys the build (and the weight cache)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from rayllm.platforms.cpu import kernels as cpu_kernels


@pytest.fixture
def no_home(monkeypatch, tmp_path):
    """As under OpenShift's random UIDs: no HOME and no passwd entry (pwd raises KeyError, so Path.home()
    raises); the temp dir is this test's."""
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("RAYLLM_KERNEL_CACHE", raising=False)

    def no_entry(uid: int):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError):
        Path.home()
    cpu_kernels.load.cache_clear()
    yield tmp_path
    cpu_kernels.load.cache_clear()


def test_a_configured_cache_needs_no_home(no_home, monkeypatch):
    monkeypatch.setenv("RAYLLM_KERNEL_CACHE", str(no_home / "configured"))
    assert cpu_kernels.cache_dir() == no_home / "configured"


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_without_a_home_the_kernels_build_in_a_private_temp_dir(no_home):
    """The kernels still load (not the torch fallback), from gettempdir()/rayllm_kernels-<uid>, mode 0700."""
    private = no_home / f"rayllm_kernels-{os.getuid()}"
    assert cpu_kernels.cache_dir() == private
    kernels = cpu_kernels.load()
    assert kernels is not None
    assert private.is_dir() and (private.stat().st_mode & 0o777) == 0o700
    assert [p.parent for p in private.glob("paged_attention-*.so")] == [private]


@pytest.mark.parametrize("mode", [0o777, 0o755])
def test_a_temp_dir_that_others_can_enter_is_refused(no_home, mode):
    shared = no_home / f"rayllm_kernels-{os.getuid()}"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(RuntimeError, match="not a private directory"):
        cpu_kernels.private_temp_dir()
    assert cpu_kernels.load() is None  # the torch path, logged


@pytest.mark.skipif(os.getuid() != 0, reason="handing a directory to another user needs root")
def test_a_temp_dir_of_another_user_is_refused(no_home):
    theirs = no_home / f"rayllm_kernels-{os.getuid()}"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(RuntimeError, match="owner 4242"):
        cpu_kernels.private_temp_dir()


def planted_library(directory: Path, marker: Path) -> Path:
    """A real shared library under the name build() expects, whose constructor writes `marker` when loaded."""
    src = directory / "planted.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) {\n'
                   f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\n')
    digest = cpu_kernels.hashlib.sha256(b"".join(p.read_bytes() for p in cpu_kernels.SOURCES)
                                        + " ".join(cpu_kernels.CFLAGS).encode()).hexdigest()[:16]
    target = directory / f"paged_attention-{digest}-{cpu_kernels._cpu_tag()}.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(target), str(src)], check=True, capture_output=True)
    return target


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
@pytest.mark.parametrize("owner", ["another user", "writable by others"])
def test_a_planted_library_is_never_loaded(tmp_path, monkeypatch, owner):
    if owner == "another user" and os.getuid() != 0:
        pytest.skip("handing a file to another user needs root")
    cache = tmp_path / "cache"
    cache.mkdir()
    marker = tmp_path / "constructor-ran"
    target = planted_library(cache, marker)
    if owner == "another user":
        os.chown(target, 4242, 4242)
    else:
        target.chmod(0o777)
    monkeypatch.setenv("RAYLLM_KERNEL_CACHE", str(cache))
    with pytest.raises(RuntimeError, match="not loading it"):
        cpu_kernels.build()
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
    finally:
        cpu_kernels.load.cache_clear()
    assert not marker.exists()  # its constructor never ran in this process


X86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx2 avx512f\nbugs\t\t: spectre_v1\n"
GRAVITON2 = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"
GRAVITON3 = GRAVITON2.replace("atomics", "atomics sve bf16 i8mm")


def test_the_cpu_tag_covers_aarch64_features(tmp_path):
    """aarch64's /proc/cpuinfo lists its features under `Features`, not `flags`: a Graviton3 (SVE, BF16) and a
    Graviton2 must not share a -march=native build or a weight cache entry."""
    tags = {}
    for name, text in (("x86", X86), ("g2", GRAVITON2), ("g2 again", GRAVITON2), ("g3", GRAVITON3)):
        (tmp_path / name).write_text(text)
        tags[name] = cpu_kernels._cpu_tag(tmp_path / name)
    assert tags["g2"] != tags["g3"] and tags["g2"] == tags["g2 again"] and tags["x86"] != tags["g2"]
    assert cpu_kernels._cpu_tag(tmp_path / "missing") != tags["g2"]
