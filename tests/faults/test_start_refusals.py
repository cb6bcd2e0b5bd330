"""Starts that cannot work are refused at once: one line on stderr, exit 2, and
nothing left behind (no /dev/shm arena, no ``kvstore.lock``).

Faults are real: a data dir that is a regular file, a read-only tmpfs, a /dev/shm
smaller than the DRAM tier (a private mount namespace with a small tmpfs on
/dev/shm, as in a container), a DRAM tier larger than the machine, a CURVE
authorized-keys directory no client could use.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.faults.conftest import mount_tmpfs, needs_root, shm_files, umount
from tests.integration.client_worker import prompt_kv, prompt_tokens
from tests.integration.conftest import REPO, free_port, server_argv, server_env

pytestmark = pytest.mark.timeout(120)

# Runs the server in a private mount namespace whose /dev/shm is a tmpfs of $SHM
# bytes: the namespace (and its mount) ends with the process.
SMALL_SHM = ["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
             'mount -t tmpfs -o size="$0" tmpfs /dev/shm && exec "$@"']


def _run(argv: list[str], timeout: float = 60, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=server_env(), cwd=cwd)


def _one_line_exit_2(proc: subprocess.CompletedProcess, *words: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvstore-server:")]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _argv(data_dir, **opts) -> list[str]:
    return server_argv(free_port(), data_dir, **opts)


def test_data_dir_that_is_a_file(tmp_path, fault_log):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    _one_line_exit_2(_run(_argv(path)), "not a directory")
    assert path.read_text() == "x"
    fault_log("data dir is a regular file (server start)", 1, 1, 0)


@needs_root
@pytest.mark.parametrize("existing", [True, False])
def test_data_dir_on_a_read_only_mount(tmp_path, fault_log, existing):
    mnt = tmp_path / "ro"
    mount_tmpfs(mnt, "4m")
    try:
        if existing:
            (mnt / "data").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        before = shm_files(mnt / "data")
        line = _one_line_exit_2(_run(_argv(mnt / "data")), "Read-only file system")
        assert shm_files(mnt / "data") == before
        assert "data" in line
    finally:
        umount(mnt)
    fault_log(f"data dir on a read-only mount ({'existing' if existing else 'new'} dir)",
              1, 1, 0)


def test_failed_start_leaves_no_lock_and_no_arena(tmp_path, fault_log):
    # The store opens (lock taken, arena made), then TE cannot bind the address.
    data = tmp_path / "data"
    proc = _run(_argv(data, extra=("--te-host", "192.0.2.1")))
    _one_line_exit_2(proc)
    assert not (data / "kvstore.lock").exists()
    assert shm_files(data) == set()
    fault_log("failed start after the store opened (bad --te-host)", 1, 1, 0)


@pytest.mark.parametrize("case", ["missing", "a file", "empty", "a key without its public key",
                                  "secret keys only"])
def test_curve_authorized_keys_no_client_could_use(tmp_path, fault_log, case):
    """pyzmq's authenticator only logs a directory it cannot load, so such a server
    ran and refused every client, with no clue on either side."""
    import zmq.auth

    keys = tmp_path / "keys"
    keys.mkdir()
    _, secret = zmq.auth.create_certificates(str(keys), "server")
    authorized = tmp_path / "clients"
    if case == "a file":
        authorized.write_text("not a directory\n")
    elif case != "missing":
        authorized.mkdir()
    if case == "a key without its public key":
        zmq.auth.create_certificates(str(authorized), "good")
        (authorized / "broken.key").write_text("# a key file cut short\n")
    if case == "secret keys only":  # the secret halves copied in, not the NAME.key
        zmq.auth.create_certificates(str(keys), "client")
        (authorized / "client.key_secret").write_bytes((keys / "client.key_secret").read_bytes())
    words = {"missing": ("does not exist",), "a file": ("is not a directory",),
             "empty": ("holds no client public keys",),
             "a key without its public key": ("No public key found", "broken.key"),
             "secret keys only": ("holds no client public keys",)}[case]
    data = tmp_path / "data"
    argv = _argv(data, nvme="0", extra=("--curve-secret-key", secret,
                                        "--curve-authorized-keys", str(authorized)))
    try:
        proc = _run(argv, timeout=30)  # a refusal takes a second or two
    except subprocess.TimeoutExpired:  # it started (run() killed it): clean up after it
        for path in shm_files(data):
            os.unlink(path)
        pytest.fail(f"kvstore-server started with --curve-authorized-keys {case}")
    line = _one_line_exit_2(proc, "curve_authorized_keys", str(authorized),
                            "no client could connect", *words)
    assert shm_files(data) == set() and not (data / "kvstore.lock").exists(), line
    fault_log(f"--curve-authorized-keys: {case} (server start)", 1, 1, 0)


def test_authorized_keys_without_the_servers_key(tmp_path, fault_log):
    """Without ``--curve-secret-key`` the ROUTER is no CURVE server: a server given
    only the clients' keys used to start admitting anyone ("no auth" in its start
    line only), while its operator believed only those clients could get in."""
    import zmq.auth

    authorized = tmp_path / "clients"
    authorized.mkdir()
    zmq.auth.create_certificates(str(authorized), "client")
    data = tmp_path / "data"
    proc = _run(_argv(data, nvme="0", extra=("--curve-authorized-keys", str(authorized))),
                timeout=30)
    _one_line_exit_2(proc, "curve_authorized_keys", "curve_secret_key", "admit any client")
    assert shm_files(data) == set()
    fault_log("--curve-authorized-keys without --curve-secret-key (server start)", 1, 1, 0)


@pytest.mark.parametrize("flag,value,words", [
    ("--data-dir", "", ("data_dir", "empty")),
    ("--data-dir", "  ", ("data_dir", "empty")),
    ("--read-lease", "inf", ("read_lease_s", "3600")),
    ("--reservation-lease", "nan", ("reservation_lease_s",)),
    ("--reservation-lease", "86400", ("reservation_lease_s", "3600")),
    ("--host", "::1", ("::1",)),  # IPv6: not supported (docs/operations.md, server.host)
])
def test_settings_that_cannot_mean_what_they_say(tmp_path, fault_log, flag, value, words):
    """An empty data dir used to put the index in the current directory; an infinite
    lease kept a dead writer's or reader's entries for ever; an IPv6 host cannot be
    served (said in one line, not a traceback)."""
    argv = _argv(tmp_path / "data", nvme="0")
    at = argv.index(flag)
    argv[at + 1] = value
    _one_line_exit_2(_run(argv, timeout=30, cwd=tmp_path), *words)
    data = tmp_path / "data"
    assert not (tmp_path / "index").exists()  # where an empty data dir put the index
    assert shm_files(data) == set() and not (data / "kvstore.lock").exists()
    fault_log(f"{flag} {value!r} (server start)", 1, 1, 0)


def test_dram_larger_than_the_machine(tmp_path, fault_log):
    data = tmp_path / "data"
    for shared in ("--dram-shared", "--no-dram-shared"):
        _one_line_exit_2(_run(_argv(data, dram="1TiB", extra=(shared,))),
                         "exceeds this machine's memory")
        assert shm_files(data) == set() and not (data / "kvstore.lock").exists()
    fault_log("--dram 1TiB (larger than the machine)", 2, 2, 0)


@needs_root
def test_dev_shm_smaller_than_dram_is_refused(tmp_path, fault_log):
    data = tmp_path / "data"
    proc = _run([*SMALL_SHM, "8m", *_argv(data, dram="64MiB")])
    _one_line_exit_2(proc, "cannot reserve 64.0MiB", "/dev/shm")
    assert not (data / "kvstore.lock").exists()
    fault_log("/dev/shm (8 MiB) smaller than --dram 64MiB (server start)", 1, 1, 0)


@needs_root
def test_dram_that_fits_a_small_dev_shm_serves_when_full(server_factory, client_factory,
                                                         fault_log):
    # 6 MiB of 8: the arena's pages are reserved at start, so filling the tier to
    # the brim (inserts past it demote or are refused) touches only backed pages.
    srv = server_factory(dram="6MiB", nvme="0", prefix=(*SMALL_SHM, "8m"),
                         extra=("--high-watermark", "1.0", "--low-watermark", "1.0"))
    client = client_factory(srv, same_node=False)  # its /dev/shm is not ours
    stored, tries = [], 0
    for pid in range(120):  # 120 x 16 pages > 1536 pages of DRAM
        tries += 1
        try:
            client.insert(prompt_tokens(pid, 64), prompt_kv(pid, 64))
            stored.append(pid)
        except Exception as exc:  # noqa: BLE001 - a full tier is a miss; no crash
            assert type(exc).__name__ in ("TierFullError",), exc
        assert srv.proc.poll() is None, srv.log()
    got = [client.get(prompt_tokens(pid, 64)) for pid in stored]
    wrong = sum(g.matched_tokens > 0 and not np.array_equal(
        g.kv.numpy(), prompt_kv(p, 64)[:g.kv.numel()]) for g, p in zip(got, stored))
    assert wrong == 0 and srv.proc.poll() is None
    fault_log("DRAM tier filled on a /dev/shm barely larger than it", tries, tries, 0)


def test_a_slab_another_server_uses_is_refused(server_factory, client_factory, tmp_path,
                                               fault_log):
    """Only the data dir was locked: a second server given the first one's slab by
    ``--nvme-path`` started and placed its entries over the first one's."""
    slab = tmp_path / "shared.slab"
    first = server_factory(dram="1MiB", nvme="8MiB", extra=("--nvme-path", str(slab)))
    client = client_factory(first)
    client.insert(prompt_tokens(1, 64), prompt_kv(1, 64))
    before = slab.read_bytes()
    line = _one_line_exit_2(_run(_argv(tmp_path / "second", dram="1MiB", nvme="8MiB",
                                       extra=("--nvme-path", str(slab)))),
                            "in use by another kvstore server")
    assert str(slab) in line and slab.read_bytes() == before
    got = client.get(prompt_tokens(1, 64))
    assert got.matched_tokens == 64 and np.array_equal(got.kv.numpy(), prompt_kv(1, 64))
    first.restart()  # the lock goes with its holder: the same slab is the first's again
    fault_log("a second server given the first one's NVMe slab (server start)", 1, 1, 0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
