/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * Every struct the kernel side hands to user space, and every shared constant.
 *
 * This header is the single source of truth: hopscope.bpf.c includes it, and the
 * agent's build script compiles it with the host C compiler to generate the Rust
 * offsets (agent-ebpf/build.rs -> layout.rs), so the two sides cannot drift.
 *
 * Rules: fixed-width types only, explicit padding, 8-byte aligned records, no
 * enums in records (tags are plain integers that user space validates).
 */
#ifndef HOPSCOPE_H
#define HOPSCOPE_H

#include <linux/types.h>

/* Largest payload prefix one read/write event can carry. Power of two: the eBPF
 * code masks lengths with (HS_MAX_CAPTURE - 1) to satisfy the verifier. The
 * effective limit is a global (<= HS_MAX_CAPTURE) per address family:
 * `capture_len_unix` for AF_UNIX sockets, `capture_len` for every other one. */
#define HS_MAX_CAPTURE 32768

/* Default captures. TCP (HTTP heads, SSE events) needs 4 KiB. Unix sockets
 * carry vLLM's ZMQ IPC: libzmq batches messages into writes (and reads) of up
 * to 8 KiB, and writes a larger message as that batch plus the rest in one
 * write, so 32 KiB keeps every frame header and the whole of messages up to
 * 32 KiB (40 when the message starts a batch): an ADD with ~6 K prompt ids
 * at 5 msgpack bytes each, ~10 K at 3 (docs/decisions.md). */
#define HS_CAPTURE_DEFAULT 4096
#define HS_CAPTURE_UNIX_DEFAULT 32768

/* Largest tail of a transfer longer than its capture that a record carries
 * after the prefix: its last bytes (of one buffer, or of an iovec array's
 * first 64 iovecs).
 * Unix sockets: libzmq writes (and reads) a message over 8 KiB as one syscall
 * of its own, so for a vLLM ADD with a long prompt the transfer's end is the
 * request's fields after the prompt ids (sampling parameters, arrival time,
 * ids: a few hundred bytes), which the prefix alone loses. TCP: an HTTP body
 * longer than the capture ends in the members a client writes after the
 * prompt (openai-python 1.x sends `messages` first, then `model`, `stream`, the
 * sampling parameters and `tools`), a long non-streaming response in its
 * `usage`, and a burst of SSE chunks hyper writes with one writev in its last
 * events (a response's usage, the body's end). `capture_tail_unix` / `capture_tail` (<= this) are the effective
 * sizes; 0 turns a family's tail off. */
#define HS_MAX_TAIL 16384
#define HS_TAIL_UNIX_DEFAULT 4096
#define HS_TAIL_DEFAULT 16384

/* hs_hdr.kind */
#define HS_KIND_IO 1    /* struct hs_io: data moved on a socket */
#define HS_KIND_CONN 2  /* struct hs_conn: accept/accept4/connect returned */
#define HS_KIND_CLOSE 3 /* struct hs_close: a socket fd was closed */
#define HS_KIND_PROC 4  /* struct hs_proc: fork / exec / exit in the traced tree */
#define HS_KIND_SCHED 5 /* struct hs_sched: one off-CPU interval of a traced thread */

/* hs_io.syscall */
#define HS_SYS_READ 1
#define HS_SYS_READV 2
#define HS_SYS_RECVFROM 3
#define HS_SYS_RECVMSG 4
#define HS_SYS_WRITE 5
#define HS_SYS_WRITEV 6
#define HS_SYS_SENDTO 7
#define HS_SYS_SENDMSG 8

/* hs_io.dir */
#define HS_DIR_IN 0  /* the traced process received bytes */
#define HS_DIR_OUT 1 /* the traced process sent bytes */

/* hs_io.flags */
#define HS_IO_TRUNCATED 0x1   /* ret > cap_len + tail_len: bytes in between were not captured */
#define HS_IO_COPY_FAILED 0x2 /* bpf_probe_read_user failed; cap_len is 0 */

/* hs_conn.op */
#define HS_CONN_ACCEPT 1
#define HS_CONN_CONNECT 2

/* hs_proc.op */
#define HS_PROC_FORK 1
#define HS_PROC_EXEC 2
#define HS_PROC_EXIT 3

/* Address families as the kernel numbers them (AF_*). */
#define HS_AF_UNIX 1
#define HS_AF_INET 2
#define HS_AF_INET6 10

/* Index of each counter in the per-CPU `stats` array map. User space sums the
 * CPUs. Every kernel-side loss has one; none is ever reset by the kernel. */
#define HS_STAT_EVENTS 0           /* records submitted to the ring buffer */
#define HS_STAT_RINGBUF_FULL 1     /* records lost: ring buffer had no room */
#define HS_STAT_TRUNCATED 2        /* io records missing bytes: past their family's capture (and
                                    * before a unix transfer's captured tail) */
#define HS_STAT_COPY_FAILED 3      /* io records whose user buffer could not be read (or, never
                                    * expected, that found no staging area: not emitted) */
#define HS_STAT_INFLIGHT_FULL 4    /* syscall enters lost: no in-flight slot (task storage allocation
                                    * failed) and the spill map refused it */
#define HS_STAT_TARGETS_FULL 5     /* forked children not followed: targets map full */
#define HS_STAT_SCHED_SHORT 6      /* off-CPU intervals below min_offcpu_ns (aggregated, not sent) */
#define HS_STAT_SCHED_SHORT_NS 7   /* total ns of those short intervals */
#define HS_STAT_SCHED_MAP_FULL 8   /* off-CPU starts lost: no off-CPU slot (task storage allocation
                                    * failed) and the spill map refused it */
#define HS_STAT_IOV_TRUNCATED 9    /* readv/writev/msg with more iovecs than the kernel walks */
#define HS_STAT_WAKEUPS 10         /* forced consumer wake-ups (threshold reached) */
#define HS_STAT_SCHED_SPILLED 11   /* off-CPU starts kept in the spill map: no task storage slot yet */
#define HS_STAT_INFLIGHT_SPILLED 12 /* syscall entries kept in the spill map: no in-flight slot yet */
#define HS_STAT_MAX 16

/* Common header of every record. `size` is the record's total length in bytes,
 * header included; user space checks it against the ring buffer sample length. */
struct hs_hdr {
	__u64 ts_ns; /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) at the syscall's exit / the event */
	__u32 tgid;
	__u32 tid;
	__u32 size;
	__u8 kind;   /* HS_KIND_* */
	__u8 _pad[3];
};

/* A data syscall on a socket fd; `data` holds the first cap_len bytes moved,
 * then the last tail_len ones (when ret > cap_len and the syscall moved one
 * buffer: read/write/recvfrom/sendto). */
struct hs_io {
	struct hs_hdr h;
	__u64 enter_ns;  /* syscall entry time */
	__u64 sock_ino;  /* inode number of the socket (as in /proc/PID/fd: socket:[N]) */
	__u64 wire_ns;   /* dir IN: when the oldest data this call read became readable
	                  * (sock:sk_data_ready); dir OUT: when the call first handed
	                  * a packet of this socket to a device (net:net_dev_queue);
	                  * 0 if not seen */
	__s64 ret;       /* syscall return value: bytes moved, or -errno */
	__s32 fd;
	__u32 cap_len;   /* bytes of data[] that follow (<= the family's capture) */
	__u16 syscall;   /* HS_SYS_* */
	__u8 dir;        /* HS_DIR_* */
	__u8 family;     /* HS_AF_* or 0 */
	__u32 flags;     /* HS_IO_* */
	__u64 burst_wake_ns; /* unix-socket writes: the wake-up that ended the calling thread's
	                      * latest sleep, however short (off-CPU records keep only those of
	                      * min_offcpu_ns or more); 0 if not seen, and in every other record */
	__u64 burst_on_ns;   /* the switch-in after that wake-up; 0 likewise */
	__u32 tail_len;      /* bytes of data[] after the prefix: the transfer's last ones
	                      * (<= HS_MAX_TAIL, <= ret - cap_len) */
	__u32 _pad2;
	__u8 data[];
};

/* accept/accept4/connect that returned (ret is the new fd, 0 or -errno). */
struct hs_conn {
	struct hs_hdr h;
	__u64 enter_ns;
	__u64 sock_ino;    /* 0 when ret < 0, except connect's -EINPROGRESS (non-blocking: it proceeds) */
	__s64 ret;
	__s32 fd;          /* accept: the new fd (= ret); connect: the fd connected */
	__u16 op;          /* HS_CONN_* */
	__u16 family;      /* HS_AF_* or 0 */
	__u16 local_port;  /* host byte order */
	__u16 peer_port;   /* host byte order */
	__u32 _pad;
	__u8 local_addr[16]; /* IPv4 in the first 4 bytes, IPv6 in all 16 */
	__u8 peer_addr[16];
};

/* close(fd) of a socket. */
struct hs_close {
	struct hs_hdr h;
	__u64 sock_ino;
	__s32 fd;
	__s32 ret;
};

/* Process-tree change. For FORK, h.tgid is the parent and child_tgid the child;
 * for EXEC and EXIT, child_tgid == h.tgid. */
struct hs_proc {
	struct hs_hdr h;
	__u32 child_tgid;
	__u16 op;        /* HS_PROC_* */
	__u16 _pad;
	__s32 exit_code; /* EXIT only: task->exit_code (status << 8 | signal) */
	char comm[16];   /* task comm after the event */
	__u32 _pad2;
};

/* One off-CPU interval of a traced thread, at least min_offcpu_ns long.
 * h.ts_ns is the switch-in time; off_ns the switch-out time. wake_ns is when a
 * waker woke it (sched_waking, in the waker; 0 if not seen): wait for a CPU =
 * h.ts_ns - wake_ns. */
struct hs_sched {
	struct hs_hdr h;
	__u64 off_ns;
	__u64 wake_ns;
	__u32 prev_state; /* state at switch-out: 0 = preempted while runnable */
	__u32 cpu;        /* CPU it switched in on */
};

/* A bit of prev_state (the kernel's TASK_FREEZABLE, Linux 6.1+): the sleep was
 * a futex wait or a nanosleep, never an epoll wait. Such a sleep does not end
 * a thread's burst (the bursts behind hs_io.burst_wake_ns, and the agent's). */
#define HS_TASK_FREEZABLE 0x2000

#endif /* HOPSCOPE_H */
