"""The syscall filter every bwrap run loads (seccomp, compiled by libseccomp).

Inside bwrap an unprivileged process may still create a user namespace, become "root" there
and mount a tmpfs of its own - uncapped RAM, past scratch_mb - or reach kernel surfaces no
tool call needs. The filter answers:
- EPERM to new namespaces (unshare, setns, clone with a CLONE_NEW* flag), mounting, ptrace, the
  kernel keyring, bpf, perf events, userfaultfd, modify_ldt;
- EPERM to memory that no cap counts: SysV shared memory, message queues and semaphore sets
  (``shmget``/``shmat``, ``msgget``, ``semget``: a detached segment belongs to no process, so
  neither RLIMIT_AS nor the scratch cap sees it, and a fresh IPC namespace has no practical
  ``shmall``);
- EPERM to channels between concurrent runs and to the host: inotify and fanotify (they see
  opens of the shared read-only files);
- EPERM to ``socket``/``socketpair`` of any family but AF_UNIX, AF_INET and AF_INET6 (AF_VSOCK
  shares the host's port space; netlink, packet... no tool call needs);
- ENOSYS (the answer of a kernel without the call, so libraries take their fallback: libffi
  writes its trampolines to a file in the scratch, ``filelock`` raises instead of spinning) to
  ``memfd_create`` and ``memfd_secret`` (memory files outside RLIMIT_AS and the scratch cap:
  60 x 16 MiB was held under a 128 MiB limit), ``io_uring_*``, ``flock`` (a lock on a shared
  read-only file blocks other sandboxes and host processes) and ``clone3`` (its flags sit in
  memory a filter cannot read, so libc falls back to clone).
Syscalls of other ABIs (x32, i386 on x86_64) kill the process with SIGSYS (libseccomp's default).
Left open: POSIX record locks (``fcntl`` F_SETLK) on the shared read-only files, a one-bit channel
between concurrent runs; sqlite needs them in the scratch, and a filter cannot tell the files
apart.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

_SECCOMP_DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "move_mount",
                   "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
                   "ptrace", "process_vm_readv", "process_vm_writev", "keyctl", "add_key",
                   "request_key", "bpf", "perf_event_open", "userfaultfd", "kexec_load",
                   "init_module", "finit_module", "delete_module", "acct", "swapon", "swapoff",
                   "open_by_handle_at", "name_to_handle_at", "modify_ldt",
                   "shmget", "shmat", "msgget", "semget",
                   "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init",
                   "fanotify_mark")
_SECCOMP_MISSING = ("clone3", "memfd_create", "memfd_secret", "io_uring_setup", "io_uring_enter",
                    "io_uring_register", "flock")
_SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6: every other family gets EPERM
_CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                    0x40000000)  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_EQ, _SCMP_CMP_GT, _SCMP_CMP_MASKED_EQ = 4, 6, 7


def _scmp_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


class _ScmpArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


@functools.lru_cache(maxsize=None)
def seccomp_filter() -> bytes:
    """The compiled BPF program (what ``bwrap --seccomp FD`` loads), built once per process.

    Raises:
        OSError: libseccomp is missing or refuses a rule.
    """
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ScmpArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")

    def deny(name: str, action: int, *conditions: _ScmpArgCmp) -> None:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a syscall of this architecture
            return
        array = (_ScmpArgCmp * max(1, len(conditions)))(*conditions)
        rc = lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array)
        if rc < 0:
            raise OSError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")

    try:
        for name in _SECCOMP_DENIED:
            deny(name, _scmp_errno(errno.EPERM))
        for flag in _CLONE_NEW_FLAGS:
            deny("clone", _scmp_errno(errno.EPERM), _ScmpArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
        for name in _SECCOMP_MISSING:
            deny(name, _scmp_errno(errno.ENOSYS))
        # A family is an int, but the filter sees the whole 64-bit register: any value with high
        # bits set is > the largest allowed family, so it is refused too.
        refused = [f for f in range(max(_SOCKET_FAMILIES)) if f not in _SOCKET_FAMILIES]
        for name in ("socket", "socketpair"):
            deny(name, _scmp_errno(errno.EPERM), _ScmpArgCmp(0, _SCMP_CMP_GT, max(_SOCKET_FAMILIES), 0))
            for family in refused:
                deny(name, _scmp_errno(errno.EPERM), _ScmpArgCmp(0, _SCMP_CMP_EQ, family, 0))
        out = os.memfd_create("aepo_seccomp", os.MFD_CLOEXEC)
        try:
            rc = lib.seccomp_export_bpf(ctx, out)
            if rc < 0:
                raise OSError(-rc, f"seccomp_export_bpf: {os.strerror(-rc)}")
            os.lseek(out, 0, os.SEEK_SET)
            return b"".join(iter(lambda: os.read(out, 65536), b""))
        finally:
            os.close(out)
    finally:
        lib.seccomp_release(ctx)


def seccomp_problem() -> str | None:
    """Why the syscall filter cannot be built here, or None."""
    try:
        seccomp_filter()
    except OSError as exc:
        return (f"cannot build the syscall filter with libseccomp ({exc}); install it: "
                "`apt-get install libseccomp2`")
    return None

