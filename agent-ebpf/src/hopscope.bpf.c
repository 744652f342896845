// SPDX-License-Identifier: GPL-2.0
/*
 * hopscope kernel side: socket syscalls, off-CPU intervals and the process tree
 * of the traced server, streamed to the agent through one ring buffer.
 *
 * Every record is a struct from hopscope.h (the single source of truth for the
 * layout). Built by agent-ebpf/build.rs with clang-19 (CO-RE, BTF); loaded by
 * agent/src/source/ebpf/loader.rs with aya, which sets the `const volatile`
 * globals below and sizes the `events` ring buffer.
 *
 * Loss is data: every record or interval we cannot deliver bumps a counter in
 * the per-CPU `stats` array (HS_STAT_*), summed by user space.
 */
#include "vmlinux_min.h"
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_endian.h>

#include "hopscope.h"

char LICENSE[] SEC("license") = "GPL";

/* Layout cross-check: build.rs measures hopscope.h with the host C compiler
 * (the numbers it writes into layout.rs) and passes the sizes here, so the BPF
 * target and user space cannot disagree on a record size. */
#ifdef HS_EXPECT_HDR_SIZE
_Static_assert(sizeof(struct hs_hdr) == HS_EXPECT_HDR_SIZE, "hs_hdr layout differs between host and BPF");
_Static_assert(sizeof(struct hs_io) == HS_EXPECT_IO_SIZE, "hs_io layout differs between host and BPF");
_Static_assert(sizeof(struct hs_conn) == HS_EXPECT_CONN_SIZE, "hs_conn layout differs between host and BPF");
_Static_assert(sizeof(struct hs_close) == HS_EXPECT_CLOSE_SIZE, "hs_close layout differs between host and BPF");
_Static_assert(sizeof(struct hs_proc) == HS_EXPECT_PROC_SIZE, "hs_proc layout differs between host and BPF");
_Static_assert(sizeof(struct hs_sched) == HS_EXPECT_SCHED_SIZE, "hs_sched layout differs between host and BPF");
#endif
_Static_assert((HS_MAX_CAPTURE & (HS_MAX_CAPTURE - 1)) == 0, "HS_MAX_CAPTURE must be a power of two");

#define S_IFMT 00170000
#define S_IFSOCK 0140000
#define EAGAIN 11

/* How many iovecs readv/writev/recvmsg/sendmsg walk. hyper (vLLM 0.34.0's
 * Rust frontend, axum) writes a chunked body with writev: three iovecs per
 * queued chunk (size line, data, CRLF), up to 64 a call; at 8 a burst of SSE
 * events lost its framing. */
#define HS_MAX_IOV 64

/* ---- configuration, set by the loader (EbpfLoader::override_global) ---- */

const volatile __u32 self_tgid = 0;            /* the agent: never traced */
const volatile __u32 capture_len = HS_CAPTURE_DEFAULT;           /* payload prefix per io record */
const volatile __u32 capture_len_unix = HS_CAPTURE_UNIX_DEFAULT; /* the same on AF_UNIX sockets (IPC) */
const volatile __u32 capture_tail_unix = HS_TAIL_UNIX_DEFAULT;   /* last bytes of a longer unix transfer */
const volatile __u32 capture_tail = HS_TAIL_DEFAULT;             /* the same on every other socket */
const volatile __u64 min_offcpu_ns = 1000000;  /* shorter off-CPU intervals are only counted */
const volatile __u64 wakeup_bytes = 262144;    /* force a consumer wake-up past this backlog */
/* The agent's pid namespace (the inode number of /proc/self/ns/pid), 0 when
 * it is the initial one. Then every tgid and tid the programs compare or emit
 * is the task's pid in that namespace, the pids of the agent's /proc, of its
 * children and of `--pid` (a sidecar sharing the server pod's process
 * namespace), and a task outside it is never traced. 0: the kernel's global
 * pids, untranslated; the verifier drops the other branch. */
const volatile __u32 pidns_ino = 0;
/* Fault injection for tests: the off-CPU slot allocations at a switch-out
 * and at a first-seen wake-up fail (the spill path, which a real run reaches
 * only under allocation pressure); the one at the switch-in that takes the
 * spilled entry succeeds, as it does in a real run. 0 in production; the
 * verifier drops the branch. */
const volatile __u8 fail_offcpu_alloc = 0;
/* Fault injection for tests: every in-flight slot allocation at a syscall's
 * entry fails (the spill path). 0 in production. */
const volatile __u8 fail_inflight_alloc = 0;
/* Set once a syscall entry was spilled: until then a thread without an
 * in-flight slot has nothing to look up at its exits. */
__u32 inflight_spilled_any = 0;

/* ---- maps ---- */

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 16 * 1024 * 1024); /* overridden by the loader */
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, HS_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

/* Traced processes (tgid -> 1). Filled by user space with the roots and their
 * descendants; extended by sched_process_fork, pruned at exit. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32);
	__type(value, __u8);
} targets SEC(".maps");

/* A traced process's tgid in the initial pid namespace, by its tgid in the
 * agent's (written only when they differ, `pidns_ino`): NVML names GPU
 * processes by host pids, which an agent in a container cannot see. Noted at
 * a thread's first switch-out, dropped at the process's exit, as `targets`
 * is: its keys are always traced tgids, so with the same size it cannot fill
 * while `targets` has room (and a full `targets` is counted). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32);
	__type(value, __u32);
} host_tgids SEC(".maps");

/* is_target's per-CPU cache. Every program asks "is this tgid traced?",
 * most of them for processes that are not (sched_switch twice per switch of
 * the machine); a `targets` lookup costs ~100 ns in this VM, a cache hit a
 * few loads (docs/benchmarks.md). A slot is one u64, so an interrupt's
 * program on the same CPU cannot leave it torn: tgid (22 bits: PID_MAX_LIMIT
 * is 2^22), the verdict, and the generation of `targets` it was read at.
 *
 * The generation is `target_gen[0] + target_gen[1]`: user space bumps [0]
 * after each insert (it is its only writer), the fork and exit programs
 * bump [1] atomically after theirs. Both only grow, so any change to
 * `targets` changes the sum, and a reader takes the generation *before*
 * the lookup: a slot can carry an older verdict only with an older
 * generation, which no longer matches. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
} target_gen SEC(".maps");

#define TC_SLOTS 64
#define TC_TGID_MASK ((1ULL << 22) - 1)
#define TC_TARGET (1ULL << 22)
#define TC_GEN_SHIFT 23

struct tcache {
	__u64 slot[TC_SLOTS];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct tcache);
} tcache SEC(".maps");

/* What a syscall's exit needs from its entry, per thread (a thread is in at
 * most one syscall). `syscall` 0 marks the slot empty. */
struct inflight {
	__u64 enter_ns;
	__u64 arg;      /* user buffer / iovec array / user_msghdr pointer */
	__u64 count;    /* buffer length or iovec count */
	__u64 sock_ino; /* resolved at entry (data syscalls, close) */
	__u64 sk;       /* struct sock address, the key of `ready` */
	__u64 xmit_ns;  /* writes: first net:net_dev_queue of `sk` during the call */
	__s32 fd;
	__u16 syscall;  /* HS_SYS_* or one of the INF_* below */
	__u8 family;
	__u8 _pad;
};

#define INF_ACCEPT 100
#define INF_CONNECT 101
#define INF_CLOSE 102

/* Task local storage, not a tid-keyed hash: a hash update, lookup and delete
 * per syscall cost ~200 ns together in this VM, the storage slot is reached
 * from the task in a few loads (docs/benchmarks.md). It has no size limit and
 * goes with the task, so an exiting thread leaves nothing behind. */
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct inflight);
} inflight SEC(".maps");

/* Syscall entries whose `inflight` slot could not be allocated (the same
 * allocation that fails in sched_switch can fail here under pressure; never
 * seen so far), by global tid until the syscall's exit takes them. The
 * exit's wire departure (net:net_dev_queue) is not looked up here: a
 * spilled write keeps its exit time. A thread that dies inside the syscall
 * leaves its entry, deleted at its exit (sched_process_exit). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct inflight);
} inflight_spill SEC(".maps");

/* When unread data first became readable on a socket (struct sock address ->
 * ns; 0: nothing unread since the last read). Set by sock:sk_data_ready if
 * absent or 0, taken (swapped for 0) by the traced process's next read. This is the wire arrival: a busy event loop may read much later, and
 * data can arrive before accept() returns, so the kernel side cannot know yet
 * whose socket it is: LRU bounds the entries of sockets nobody traced. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, __u64);
} ready SEC(".maps");

/* Switch-out of a traced thread (when, its state, first wake-up after);
 * off_ns 0 marks it taken. Task local storage, like `inflight`. */
struct offcpu {
	__u64 off_ns;
	__u64 wake_ns;
	__u32 prev_state;
	__u32 host_noted; /* in `host_tgids` (pid namespace translation only) */
	/* The latest switch-in that ended a sleep, and the wake-up before it:
	 * kept for every sleep, the short ones too, for the io records. */
	__u64 burst_on_ns;
	__u64 burst_wake_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct offcpu);
} offcpu SEC(".maps");

/* Switch-outs (and first-seen wake-ups) whose `offcpu` slot could not be
 * allocated: task storage allocates in sched_switch, with interrupts off,
 * and as `record --pid` attached to a real vLLM (hundreds of threads, each
 * allocating at its first switch-out) 3-9 of them failed in some runs.
 * Kept here by global tid (preallocated: an update never allocates) until
 * the thread's switch-in takes it; LRU bounds what a thread that never
 * comes back leaves. */
struct offcpu_spilled {
	__u64 off_ns;
	__u64 wake_ns;
	__u32 prev_state;
	__u32 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct offcpu_spilled);
} offcpu_spill SEC(".maps");

/* Staging area for io records (too big for the 512-byte stack), one per CPU.
 * The data area is twice HS_MAX_CAPTURE so that `offset < HS_MAX_CAPTURE` plus
 * `len <= HS_MAX_CAPTURE` is provably in bounds for the verifier. */
struct io_scratch {
	struct hs_io io;
	__u8 data[2 * HS_MAX_CAPTURE];
};
_Static_assert(__builtin_offsetof(struct io_scratch, data) == sizeof(struct hs_io),
	       "io_scratch.data must directly follow the hs_io header");
_Static_assert(HS_MAX_CAPTURE + HS_MAX_TAIL <= 2 * HS_MAX_CAPTURE, "a prefix and a tail fit the staging area");

/* A plain array indexed by CPU, not a per-CPU array: per-CPU values are
 * limited to 32 KiB (PCPU_MIN_UNIT_SIZE) and this one is 64 KiB. The program
 * cannot migrate while it runs, so the entry is this CPU's as a per-CPU one
 * would be. max_entries is set by the loader to the possible CPUs. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct io_scratch);
} scratch SEC(".maps");

/* User-space ABI structs (stable syscall ABI, not kernel-internal: no CO-RE). */
struct hs_iovec {
	__u64 iov_base;
	__u64 iov_len;
};

struct hs_user_msghdr {
	__u64 msg_name;
	__s32 msg_namelen;
	__s32 _pad;
	__u64 msg_iov;
	__u64 msg_iovlen;
	__u64 msg_control;
	__u64 msg_controllen;
	__u32 msg_flags;
};

/* Syscall tracepoint contexts (see events/syscalls/sys_enter_read/format:
 * 8 bytes of common fields, __syscall_nr at 8, arguments from 16). */
struct sys_enter_ctx {
	__u64 common;
	__s32 nr;
	__s32 _pad;
	__u64 args[6];
};

struct sys_exit_ctx {
	__u64 common;
	__s32 nr;
	__s32 _pad;
	__s64 ret;
};

/* ---- helpers ---- */

static __always_inline void stat_add(__u32 idx, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &idx);
	if (v)
		*v += n;
}

static __always_inline int is_target(__u32 tgid)
{
	__u32 zero = 0, one = 1;
	struct tcache *c;
	__u64 *gu, *gk, gen, *slot, v;
	int hit;

	if (tgid == 0 || tgid == self_tgid)
		return 0;
	c = bpf_map_lookup_elem(&tcache, &zero);
	gu = bpf_map_lookup_elem(&target_gen, &zero);
	gk = bpf_map_lookup_elem(&target_gen, &one);
	if (!c || !gu || !gk || tgid > TC_TGID_MASK)
		return bpf_map_lookup_elem(&targets, &tgid) != NULL;
	gen = (*(volatile __u64 *)gu + *(volatile __u64 *)gk) << TC_GEN_SHIFT;
	slot = &c->slot[tgid & (TC_SLOTS - 1)];
	v = *(volatile __u64 *)slot;
	if ((v & ~TC_TARGET) == (gen | tgid))
		return (v & TC_TARGET) != 0;
	hit = bpf_map_lookup_elem(&targets, &tgid) != NULL;
	*(volatile __u64 *)slot = gen | tgid | (hit ? TC_TARGET : 0);
	return hit;
}

/* After the kernel changed `targets` (see tcache). */
static __always_inline void targets_changed(void)
{
	__u32 one = 1;
	__u64 *g = bpf_map_lookup_elem(&target_gen, &one);

	if (g)
		__sync_fetch_and_add(g, 1);
}

/* How deep below the initial pid namespace the agent's may be (ns_nr's
 * steps; a power of two that fits a pointer's alignment bits, pidns_at). */
#define HS_MAX_PIDNS_LEVEL 8
_Static_assert((HS_MAX_PIDNS_LEVEL & (HS_MAX_PIDNS_LEVEL - 1)) == 0 && HS_MAX_PIDNS_LEVEL <= 8, "levels fit 3 alignment bits");

/* The agent's pid namespace as found in the first task seen in it: its
 * address, with its level in the low bits (a struct pid_namespace is 8-byte
 * aligned and the level below HS_MAX_PIDNS_LEVEL), so that one 64-bit store
 * publishes both. The namespace lives as long as the agent (which is in it):
 * the address stays its own. Then a task shallower than that level is
 * outside it at once (the host's), any other is one compare away. */
__u64 pidns_at = 0;

/* `p`'s number in the agent's pid namespace (`pidns_ino`), 0 when it has
 * none there (a task of the host or of another pod). `p` comes from a
 * task's fields: plain fault-safe loads all the way, no helper calls (a
 * bpf_probe_read_kernel per task cost ~100 ns per context switch here).
 * Each `numbers[]` element is reached at a constant offset, as the verifier
 * wants for a flexible array (and as CO-RE can relocate: aya's relocator
 * rejects an index into `numbers[]`), hence the steps written out for
 * levels 0-7 (HS_MAX_PIDNS_LEVEL). */
#define HS_UPID(i) ((struct upid *)((void *)p + bpf_core_field_offset(struct pid, numbers) + (i) * sizeof(struct upid)))
#define HS_NR_IF_AGENTS(i)                                                            \
	case i:                                                                       \
		return (__u64)HS_UPID(i)->ns == addr ? (__u32)HS_UPID(i)->nr : 0;
#define HS_FIND_AGENTS(i)                                                             \
	if (i <= level && HS_UPID(i)->ns->ns.inum == pidns_ino) {                      \
		publish_pidns(&HS_UPID(i)->ns, i);                                    \
		return HS_UPID(i)->nr;                                                \
	}

/* Publishes the agent's namespace (the pointer at `ns`) and its level. Once:
 * read as a number (a helper read) because the verifier refuses bit
 * operations on a pointer. */
static __always_inline void publish_pidns(void *ns, __u32 level)
{
	__u64 addr = 0;

	if (bpf_probe_read_kernel(&addr, sizeof(addr), ns) == 0 && addr)
		*(volatile __u64 *)&pidns_at = addr | level;
}
static __always_inline __u32 ns_nr(struct pid *p)
{
	__u64 at = *(volatile __u64 *)&pidns_at;
	__u32 level = p->level;

	if (at) {
		__u64 addr = at & ~(__u64)(HS_MAX_PIDNS_LEVEL - 1);
		__u32 l = at & (HS_MAX_PIDNS_LEVEL - 1);

		/* Shallower than the agent's namespace: the host's tasks. */
		if (l > level)
			return 0;
		switch (l) {
			HS_NR_IF_AGENTS(0)
			HS_NR_IF_AGENTS(1)
			HS_NR_IF_AGENTS(2)
			HS_NR_IF_AGENTS(3)
			HS_NR_IF_AGENTS(4)
			HS_NR_IF_AGENTS(5)
			HS_NR_IF_AGENTS(6)
			HS_NR_IF_AGENTS(7)
		}
		return 0;
	}
	HS_FIND_AGENTS(0)
	HS_FIND_AGENTS(1)
	HS_FIND_AGENTS(2)
	HS_FIND_AGENTS(3)
	HS_FIND_AGENTS(4)
	HS_FIND_AGENTS(5)
	HS_FIND_AGENTS(6)
	HS_FIND_AGENTS(7)
	return 0;
}

/* A task's tgid and tid as the agent sees them (see `pidns_ino`). `t` is a
 * trusted BTF pointer (a tp_btf argument, bpf_get_current_task_btf()): its
 * fields are plain fault-safe loads, as the untranslated path always was. */
static __always_inline __u32 task_tgid(struct task_struct *t)
{
	if (!pidns_ino)
		return t->tgid;
	return ns_nr(t->group_leader->thread_pid);
}

static __always_inline __u32 task_tid(struct task_struct *t)
{
	if (!pidns_ino)
		return t->pid;
	return ns_nr(t->thread_pid);
}

/* bpf_get_current_pid_tgid() as the agent sees it: tgid << 32 | tid. */
static __always_inline __u64 current_pid_tgid(void)
{
	struct task_struct *t;

	if (!pidns_ino)
		return bpf_get_current_pid_tgid();
	t = (struct task_struct *)bpf_get_current_task_btf();
	return ((__u64)task_tgid(t) << 32) | task_tid(t);
}

static __always_inline int current_is_target(void)
{
	return is_target(current_pid_tgid() >> 32);
}

/* Ring buffer output with the design's wake-up policy: wake the consumer only
 * when the backlog reaches `wakeup_bytes`; the agent also drains on a timer.
 *
 * Edge-triggered: only the record that makes the backlog *cross* the threshold
 * forces the wake-up. A level trigger (`avail >= wakeup_bytes`) forces one on
 * every record until the reader has drained, and each forced wake-up is an
 * irq_work self-IPI: measured ~9 us per record in a VM (a 512-byte recvfrom
 * exit went from ~0.35 us to ~9 us). The query races with other CPUs'
 * producers, so a crossing can occasionally be missed; the timer drain covers
 * it. wakeup_bytes == 0 wakes on every record. */
static __always_inline void emit(void *rec, __u64 size)
{
	__u64 flags = BPF_RB_NO_WAKEUP;
	if (wakeup_bytes == 0) {
		flags = BPF_RB_FORCE_WAKEUP;
	} else {
		__u64 avail = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
		/* + 8: the ring's per-record header (BPF_RINGBUF_HDR_SZ). */
		if (avail < wakeup_bytes && avail + size + 8 >= wakeup_bytes)
			flags = BPF_RB_FORCE_WAKEUP;
	}
	if (flags == BPF_RB_FORCE_WAKEUP)
		stat_add(HS_STAT_WAKEUPS, 1);
	if (bpf_ringbuf_output(&events, rec, size, flags) == 0)
		stat_add(HS_STAT_EVENTS, 1);
	else
		stat_add(HS_STAT_RINGBUF_FULL, 1);
}

static __always_inline void fill_hdr(struct hs_hdr *h, __u64 ts, __u32 size, __u8 kind)
{
	__u64 id = current_pid_tgid();
	h->ts_ns = ts;
	h->tgid = id >> 32;
	h->tid = (__u32)id;
	h->size = size;
	h->kind = kind;
	h->_pad[0] = 0;
	h->_pad[1] = 0;
	h->_pad[2] = 0;
}

/* The struct file behind `fd` of the current task, or NULL.
 *
 * task -> files -> fdt -> {max_fds, fd} are read through the trusted BTF
 * pointer bpf_get_current_task_btf() returns: plain loads the verifier turns
 * into fault-safe PROBE_MEM loads, ~1 ns each instead of a helper call
 * (~25 ns) per hop. The fd array slot and everything below it are reached
 * through bpf_probe_read_kernel. */
static __always_inline struct file *fd_file(int fd)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
	struct files_struct *files;
	struct fdtable *fdt;
	struct file **fds;
	struct file *file = NULL;

	if (fd < 0)
		return NULL;
	files = task->files;
	if (!files)
		return NULL;
	fdt = files->fdt;
	if (!fdt)
		return NULL;
	if ((unsigned int)fd >= fdt->max_fds)
		return NULL;
	fds = fdt->fd;
	if (!fds)
		return NULL;
	if (bpf_probe_read_kernel(&file, sizeof(file), &fds[fd]) != 0)
		return NULL;
	return file;
}

/* Socket behind `fd`: its inode number and the struct sock, or 0 if `fd` is
 * not a socket. */
static __always_inline __u64 fd_socket(int fd, struct sock **skp)
{
	struct file *file = fd_file(fd);
	struct inode *inode;
	struct socket *sock;
	__u16 mode;

	*skp = NULL;
	if (!file)
		return 0;
	inode = BPF_CORE_READ(file, f_inode);
	if (!inode)
		return 0;
	mode = BPF_CORE_READ(inode, i_mode);
	if ((mode & S_IFMT) != S_IFSOCK)
		return 0;
	sock = BPF_CORE_READ(file, private_data);
	if (sock)
		*skp = BPF_CORE_READ(sock, sk);
	return BPF_CORE_READ(inode, i_ino);
}

static __always_inline __u8 sk_family(struct sock *sk)
{
	__u16 family;

	if (!sk)
		return 0;
	family = BPF_CORE_READ(sk, __sk_common.skc_family);
	/* Only the families hopscope.h names; anything else reads as unknown. */
	if (family == HS_AF_UNIX || family == HS_AF_INET || family == HS_AF_INET6)
		return family;
	return 0;
}

/* ---- syscall entry: stash what the exit needs ---- */

static __always_inline void stash(struct inflight *inf)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
	struct inflight *slot = bpf_task_storage_get(&inflight, task, 0, fail_inflight_alloc ? 0 : BPF_LOCAL_STORAGE_GET_F_CREATE);
	__u32 gtid;

	if (!slot) {
		gtid = task->pid;
		if (bpf_map_update_elem(&inflight_spill, &gtid, inf, BPF_ANY) == 0) {
			inflight_spilled_any = 1;
			stat_add(HS_STAT_INFLIGHT_SPILLED, 1);
		} else {
			stat_add(HS_STAT_INFLIGHT_FULL, 1);
		}
		return;
	}
	*slot = *inf;
}

/* Data syscalls: only sockets are stashed (the fd is resolved here, where it
 * is certainly still open). */
static __always_inline int enter_data(struct sys_enter_ctx *ctx, __u16 sys)
{
	struct inflight inf = {};
	struct sock *sk;
	int fd;

	if (!current_is_target())
		return 0;
	fd = (int)ctx->args[0];
	inf.sock_ino = fd_socket(fd, &sk);
	if (!inf.sock_ino)
		return 0;
	inf.enter_ns = bpf_ktime_get_ns();
	inf.arg = ctx->args[1];
	inf.count = ctx->args[2];
	inf.fd = fd;
	inf.sk = (__u64)sk;
	inf.syscall = sys;
	inf.family = sk_family(sk);
	stash(&inf);
	return 0;
}

static __always_inline int enter_plain(struct sys_enter_ctx *ctx, __u16 kind)
{
	struct inflight inf = {};

	if (!current_is_target())
		return 0;
	inf.enter_ns = bpf_ktime_get_ns();
	inf.fd = (int)ctx->args[0];
	inf.syscall = kind;
	stash(&inf);
	return 0;
}

/* Take (and empty) this thread's stash if it belongs to syscall `sys`. */
static __always_inline int unstash(__u16 sys, struct inflight *out)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
	struct inflight *inf = bpf_task_storage_get(&inflight, task, 0, 0);
	struct inflight *sp;
	__u32 gtid;
	int ok = 0;

	if (!inf && inflight_spilled_any) {
		/* No slot: its entry, if any, was spilled. */
		gtid = task->pid;
		sp = bpf_map_lookup_elem(&inflight_spill, &gtid);
		if (!sp)
			return 0;
		if (sp->syscall == sys) {
			*out = *sp;
			ok = 1;
		}
		bpf_map_delete_elem(&inflight_spill, &gtid);
		return ok;
	}
	if (!inf || inf->syscall == 0)
		return 0;
	if (inf->syscall == sys) {
		*out = *inf;
		ok = 1;
	}
	inf->syscall = 0;
	return ok;
}

/* ---- syscall exit: build the records ---- */

static __always_inline struct io_scratch *io_begin(struct inflight *inf, __s64 ret, __u8 dir, __u64 now)
{
	__u32 cpu = bpf_get_smp_processor_id();
	struct io_scratch *s = bpf_map_lookup_elem(&scratch, &cpu);

	/* Cannot miss (the loader sizes the map to every possible CPU), but a
	 * record lost here must still be counted. */
	if (!s) {
		stat_add(HS_STAT_COPY_FAILED, 1);
		return NULL;
	}
	fill_hdr(&s->io.h, now, sizeof(struct hs_io), HS_KIND_IO);
	s->io.enter_ns = inf->enter_ns;
	s->io.sock_ino = inf->sock_ino;
	s->io.wire_ns = dir == HS_DIR_OUT ? inf->xmit_ns : 0;
	if (dir == HS_DIR_IN && inf->sk) {
		__u64 *t = bpf_map_lookup_elem(&ready, &inf->sk);
		/* Taken, not deleted: the entry stays for the socket's next
		 * arrival, which then costs a store instead of an LRU insert. */
		if (t)
			s->io.wire_ns = __sync_lock_test_and_set(t, 0);
	}
	s->io.ret = ret;
	s->io.fd = inf->fd;
	s->io.cap_len = 0;
	s->io.syscall = inf->syscall;
	s->io.dir = dir;
	s->io.family = inf->family;
	s->io.flags = 0;
	s->io.burst_wake_ns = 0;
	s->io.burst_on_ns = 0;
	/* Which wake-up this write came after: a ZMQ I/O thread woken by the
	 * frontend's send() writes the ADD it was handed. */
	if (dir == HS_DIR_OUT && inf->family == HS_AF_UNIX) {
		struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
		struct offcpu *o = bpf_task_storage_get(&offcpu, task, 0, 0);

		if (o) {
			s->io.burst_wake_ns = o->burst_wake_ns;
			s->io.burst_on_ns = o->burst_on_ns;
		}
	}
	return s;
}

static __always_inline void io_finish(struct io_scratch *s, __u64 ret, __u32 cap, __u32 tail, __u32 flags)
{
	if (flags & HS_IO_COPY_FAILED) {
		cap = 0;
		tail = 0;
		stat_add(HS_STAT_COPY_FAILED, 1);
	}
	if (cap > HS_MAX_CAPTURE)
		cap = HS_MAX_CAPTURE;
	if (tail > HS_MAX_TAIL)
		tail = HS_MAX_TAIL;
	/* Other families are not captured by design (want_bytes): no loss. */
	if (!(flags & HS_IO_COPY_FAILED) && ret > (__u64)cap + tail && s->io.family != 0) {
		flags |= HS_IO_TRUNCATED;
		stat_add(HS_STAT_TRUNCATED, 1);
	}
	s->io.cap_len = cap;
	s->io.tail_len = tail;
	s->io.flags = flags;
	s->io.h.size = sizeof(struct hs_io) + cap + tail;
	/* hs_io is followed by data[] in io_scratch: one contiguous record. */
	emit(s, sizeof(struct hs_io) + ((cap + tail) & (2 * HS_MAX_CAPTURE - 1)));
}

static __always_inline __u32 want_bytes(__s64 ret, __u8 family)
{
	__u64 want = (__u64)ret;
	__u32 limit = family == HS_AF_UNIX ? capture_len_unix : capture_len;

	/* Sockets of other families (netlink: a vLLM, torch and gloo list the
	 * machine's interfaces as they start) carry no HTTP and no IPC: user
	 * space counts them and never reads their bytes, so none are copied. */
	if (family == 0)
		return 0;

	if (limit > HS_MAX_CAPTURE)
		limit = HS_MAX_CAPTURE;
	if (want > limit)
		want = limit;
	return (__u32)want;
}

/* How many of a transfer's last bytes follow its `cap`-byte prefix in the
 * record: the family's tail, never overlapping the prefix; 0 when the prefix
 * is all of it or the family is not captured. Callers clamp it to
 * HS_MAX_TAIL last, where the verifier needs the bound. */
static __always_inline __u32 tail_bytes(__s64 ret, __u32 cap, __u8 family)
{
	__u64 rest;
	__u32 t;

	if (family == 0 || (__u64)ret <= cap)
		return 0;
	rest = (__u64)ret - cap;
	t = family == HS_AF_UNIX ? capture_tail_unix : capture_tail;
	if (rest < t)
		t = (__u32)rest;
	return t;
}

/* One contiguous user buffer. */
static __always_inline int exit_buf(struct sys_exit_ctx *ctx, __u16 sys, __u8 dir)
{
	struct inflight inf;
	struct io_scratch *s;
	__u64 now = bpf_ktime_get_ns();
	__s64 ret = ctx->ret;
	__u32 n, t = 0, flags = 0;

	if (!unstash(sys, &inf))
		return 0;
	if (ret <= 0)
		return 0;
	s = io_begin(&inf, ret, dir, now);
	if (!s)
		return 0;
	n = want_bytes(ret, inf.family);
	if (n > HS_MAX_CAPTURE)
		n = HS_MAX_CAPTURE;
	if (n > 0 && bpf_probe_read_user(s->data, n, (const void *)inf.arg) != 0)
		flags |= HS_IO_COPY_FAILED;
	/* A transfer longer than the prefix: its last bytes too (a long ADD's
	 * fields after the prompt ids; an HTTP body's members after the prompt),
	 * never overlapping the prefix. */
	if (!flags) {
		t = tail_bytes(ret, n, inf.family);
		/* Last, so the verifier sees the bound at the copy. */
		if (t > HS_MAX_TAIL)
			t = HS_MAX_TAIL;
		if (t > 0 && bpf_probe_read_user(&s->data[n], t, (const void *)(inf.arg + (__u64)ret - t)) != 0)
			t = 0;
	}
	io_finish(s, (__u64)ret, n, t, flags);
	return 0;
}

/* Copies `len` user bytes at `src` into s->data[off...]; returns `len`, 0
 * when the read failed or the bounds below are not met (never, as called).
 * The bounds the verifier needs for data[]: a prefix's pieces start under
 * HS_MAX_CAPTURE and are at most that long; a tail's start under
 * HS_MAX_CAPTURE + HS_MAX_TAIL and are at most HS_MAX_TAIL long. A global
 * function of its own: the walk's running offset then never has to be
 * precise, and the walk's 64 iterations prune (inside it, one iteration
 * verified per offset range: past the instruction limit). */
__noinline __u32 hs_copy_piece(struct io_scratch *s, __u32 off, __u32 len, __u64 src)
{
	if (!s || len == 0)
		return 0;
	if (off < HS_MAX_CAPTURE) {
		if (len > HS_MAX_CAPTURE)
			return 0;
	} else if (off >= HS_MAX_CAPTURE + HS_MAX_TAIL || len > HS_MAX_TAIL) {
		return 0;
	}
	if (bpf_probe_read_user(&s->data[off], len, (const void *)src) != 0)
		return 0;
	return len;
}

/* An iovec array (readv/writev, or a msghdr's): copies `want` bytes of the
 * transfer from its byte `skip` on, in iovec order, into s->data from `dst`
 * on (`to`: dst << 32 | want, a BPF call takes five arguments at most); returns how many, with bit 32 set when a read failed and bit 33 when
 * the walk stopped at the last iovec it may read, short. Called for the
 * prefix (skip 0, dst 0) and for the tail (the transfer's last bytes, right
 * after the prefix). A global function, verified once whatever its callers'
 * state: inlined, the program after it was verified again for every iovec
 * the walk could stop at (exit_writev ~320k instructions at 64 iovecs). */
__noinline __u64 hs_copy_iov(struct io_scratch *s, __u64 iov_ptr, __u64 iovcnt, __u64 skip, __u64 to)
{
	__u32 dst = (__u32)(to >> 32), want = (__u32)to;
	__u64 failed = 0;
	__u32 done = 0;
	__u32 i;

	if (!s)
		return 0;
	for (i = 0; i < HS_MAX_IOV; i++) {
		struct hs_iovec iov;
		__u32 l;

		if (i >= iovcnt || done >= want)
			break;
		if (bpf_probe_read_user(&iov, sizeof(iov), (const void *)(iov_ptr + i * sizeof(iov))) != 0) {
			failed = 1;
			break;
		}
		if (iov.iov_len <= skip) {
			skip -= iov.iov_len;
			continue;
		}
		iov.iov_base += skip;
		iov.iov_len -= skip;
		skip = 0;
		l = want - done;
		if (iov.iov_len < l)
			l = (__u32)iov.iov_len;
		l = hs_copy_piece(s, dst + done, l, iov.iov_base);
		if (!l) {
			failed = 1;
			break;
		}
		done += l;
	}
	if (done < want && i == HS_MAX_IOV && iovcnt > HS_MAX_IOV)
		failed |= 2;
	return done | failed << 32;
}

static __always_inline int exit_iov(struct sys_exit_ctx *ctx, __u16 sys, __u8 dir, int is_msg)
{
	struct inflight inf;
	struct io_scratch *s;
	__u64 now = bpf_ktime_get_ns();
	__s64 ret = ctx->ret;
	__u64 iov_ptr, iovcnt;
	__u32 cap = 0, t = 0, flags = 0;
	__u64 copied;

	if (!unstash(sys, &inf))
		return 0;
	if (ret <= 0)
		return 0;
	s = io_begin(&inf, ret, dir, now);
	if (!s)
		return 0;
	iov_ptr = inf.arg;
	iovcnt = inf.count;
	if (is_msg) {
		struct hs_user_msghdr msg;
		if (bpf_probe_read_user(&msg, sizeof(msg), (const void *)inf.arg) != 0) {
			io_finish(s, (__u64)ret, 0, 0, HS_IO_COPY_FAILED);
			return 0;
		}
		iov_ptr = msg.msg_iov;
		iovcnt = msg.msg_iovlen;
	}
	copied = hs_copy_iov(s, iov_ptr, iovcnt, 0, want_bytes(ret, inf.family));
	if ((copied >> 32) & 1)
		flags |= HS_IO_COPY_FAILED;
	if ((copied >> 32) & 2)
		stat_add(HS_STAT_IOV_TRUNCATED, 1);
	/* At most want <= HS_MAX_CAPTURE: the mask changes nothing but gives the
	 * verifier the bound (a global function's result is any scalar). */
	cap = (__u32)copied & (2 * HS_MAX_CAPTURE - 1);
	/* Its last bytes too, as for one buffer: hyper writes a burst of SSE
	 * events (a Responses API event echoing long instructions is 4 KiB and
	 * more) with one writev, and the burst's last chunks (the response's
	 * usage, the body's end) would otherwise fall past the prefix. */
	if (!flags) {
		t = tail_bytes(ret, cap, inf.family);
		if (t > HS_MAX_TAIL)
			t = HS_MAX_TAIL;
		/* All of it or none: a tail is the transfer's last bytes exactly
		 * (past the 64th iovec the walk cannot reach them). */
		if (t > 0 && hs_copy_iov(s, iov_ptr, iovcnt, (__u64)ret - t, (__u64)cap << 32 | t) != (__u64)t)
			t = 0;
	}
	io_finish(s, (__u64)ret, cap, t, flags);
	return 0;
}

static __always_inline void fill_conn_addrs(struct hs_conn *c, struct sock *sk)
{
	if (!sk)
		return;
	c->local_port = BPF_CORE_READ(sk, __sk_common.skc_num);
	c->peer_port = bpf_ntohs(BPF_CORE_READ(sk, __sk_common.skc_dport));
	if (c->family == HS_AF_INET) {
		__u32 a = BPF_CORE_READ(sk, __sk_common.skc_rcv_saddr);
		__u32 b = BPF_CORE_READ(sk, __sk_common.skc_daddr);
		__builtin_memcpy(c->local_addr, &a, 4);
		__builtin_memcpy(c->peer_addr, &b, 4);
	} else if (c->family == HS_AF_INET6) {
		if (bpf_core_field_exists(sk->__sk_common.skc_v6_daddr)) {
			BPF_CORE_READ_INTO(&c->local_addr, sk, __sk_common.skc_v6_rcv_saddr);
			BPF_CORE_READ_INTO(&c->peer_addr, sk, __sk_common.skc_v6_daddr);
		}
	}
}

static __always_inline int exit_conn(struct sys_exit_ctx *ctx, __u16 kind)
{
	struct inflight inf;
	struct hs_conn c;
	struct sock *sk = NULL;
	__u64 now = bpf_ktime_get_ns();
	__s64 ret = ctx->ret;

	if (!unstash(kind, &inf))
		return 0;
	/* Non-blocking accept with nothing pending: pure noise. */
	if (kind == INF_ACCEPT && ret == -EAGAIN)
		return 0;
	__builtin_memset(&c, 0, sizeof(c));
	fill_hdr(&c.h, now, sizeof(c), HS_KIND_CONN);
	c.enter_ns = inf.enter_ns;
	c.ret = ret;
	if (kind == INF_ACCEPT) {
		c.op = HS_CONN_ACCEPT;
		c.fd = ret >= 0 ? (__s32)ret : inf.fd;
		if (ret >= 0)
			c.sock_ino = fd_socket((int)ret, &sk);
	} else {
		c.op = HS_CONN_CONNECT;
		c.fd = inf.fd;
		c.sock_ino = fd_socket(inf.fd, &sk);
		if (!c.sock_ino)
			return 0;
		if (ret < 0 && ret != -115 /* EINPROGRESS */)
			c.sock_ino = 0;
	}
	c.family = sk_family(sk);
	if (c.sock_ino)
		fill_conn_addrs(&c, sk);
	emit(&c, sizeof(c));
	return 0;
}

/* ---- the syscall programs ---- */

#define DATA_PROGS(name, sys, dir, exit_fn)                                \
	SEC("tracepoint/syscalls/sys_enter_" #name)                        \
	int sys_enter_##name(struct sys_enter_ctx *ctx)                    \
	{                                                                  \
		return enter_data(ctx, sys);                               \
	}                                                                  \
	SEC("tracepoint/syscalls/sys_exit_" #name)                         \
	int sys_exit_##name(struct sys_exit_ctx *ctx)                      \
	{                                                                  \
		return exit_fn;                                            \
	}

DATA_PROGS(read, HS_SYS_READ, HS_DIR_IN, exit_buf(ctx, HS_SYS_READ, HS_DIR_IN))
DATA_PROGS(recvfrom, HS_SYS_RECVFROM, HS_DIR_IN, exit_buf(ctx, HS_SYS_RECVFROM, HS_DIR_IN))
DATA_PROGS(write, HS_SYS_WRITE, HS_DIR_OUT, exit_buf(ctx, HS_SYS_WRITE, HS_DIR_OUT))
DATA_PROGS(sendto, HS_SYS_SENDTO, HS_DIR_OUT, exit_buf(ctx, HS_SYS_SENDTO, HS_DIR_OUT))
DATA_PROGS(readv, HS_SYS_READV, HS_DIR_IN, exit_iov(ctx, HS_SYS_READV, HS_DIR_IN, 0))
DATA_PROGS(writev, HS_SYS_WRITEV, HS_DIR_OUT, exit_iov(ctx, HS_SYS_WRITEV, HS_DIR_OUT, 0))
DATA_PROGS(recvmsg, HS_SYS_RECVMSG, HS_DIR_IN, exit_iov(ctx, HS_SYS_RECVMSG, HS_DIR_IN, 1))
DATA_PROGS(sendmsg, HS_SYS_SENDMSG, HS_DIR_OUT, exit_iov(ctx, HS_SYS_SENDMSG, HS_DIR_OUT, 1))

SEC("tracepoint/syscalls/sys_enter_accept")
int sys_enter_accept(struct sys_enter_ctx *ctx)
{
	return enter_plain(ctx, INF_ACCEPT);
}

SEC("tracepoint/syscalls/sys_exit_accept")
int sys_exit_accept(struct sys_exit_ctx *ctx)
{
	return exit_conn(ctx, INF_ACCEPT);
}

SEC("tracepoint/syscalls/sys_enter_accept4")
int sys_enter_accept4(struct sys_enter_ctx *ctx)
{
	return enter_plain(ctx, INF_ACCEPT);
}

SEC("tracepoint/syscalls/sys_exit_accept4")
int sys_exit_accept4(struct sys_exit_ctx *ctx)
{
	return exit_conn(ctx, INF_ACCEPT);
}

SEC("tracepoint/syscalls/sys_enter_connect")
int sys_enter_connect(struct sys_enter_ctx *ctx)
{
	return enter_plain(ctx, INF_CONNECT);
}

SEC("tracepoint/syscalls/sys_exit_connect")
int sys_exit_connect(struct sys_exit_ctx *ctx)
{
	return exit_conn(ctx, INF_CONNECT);
}

/* close: the fd is gone at exit, so the socket is resolved at entry. */
SEC("tracepoint/syscalls/sys_enter_close")
int sys_enter_close(struct sys_enter_ctx *ctx)
{
	struct inflight inf = {};
	struct sock *sk;

	if (!current_is_target())
		return 0;
	inf.fd = (int)ctx->args[0];
	inf.sock_ino = fd_socket(inf.fd, &sk);
	if (!inf.sock_ino)
		return 0;
	inf.enter_ns = bpf_ktime_get_ns();
	inf.syscall = INF_CLOSE;
	stash(&inf);
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_close")
int sys_exit_close(struct sys_exit_ctx *ctx)
{
	struct inflight inf;
	struct hs_close c;
	__u64 now = bpf_ktime_get_ns();

	if (!unstash(INF_CLOSE, &inf))
		return 0;
	__builtin_memset(&c, 0, sizeof(c));
	fill_hdr(&c.h, now, sizeof(c), HS_KIND_CLOSE);
	c.sock_ino = inf.sock_ino;
	c.fd = inf.fd;
	c.ret = (__s32)ctx->ret;
	emit(&c, sizeof(c));
	return 0;
}

/* ---- process tree ---- */

static __always_inline void emit_proc(struct task_struct *subject, __u32 tgid, __u32 tid, __u32 child_tgid,
				      __u16 op, __s32 exit_code)
{
	struct hs_proc p;

	__builtin_memset(&p, 0, sizeof(p));
	p.h.ts_ns = bpf_ktime_get_ns();
	p.h.tgid = tgid;
	p.h.tid = tid;
	p.h.size = sizeof(p);
	p.h.kind = HS_KIND_PROC;
	p.child_tgid = child_tgid;
	p.op = op;
	p.exit_code = exit_code;
	BPF_CORE_READ_STR_INTO(&p.comm, subject, comm);
	emit(&p, sizeof(p));
}

SEC("tp_btf/sched_process_fork")
int BPF_PROG(sched_process_fork, struct task_struct *parent, struct task_struct *child)
{
	__u32 ptgid, ctgid;
	__u8 one = 1;

	/* A new thread is not a new process: its tgid is already traced. */
	if (child->pid != child->tgid)
		return 0;
	ptgid = task_tgid(parent);
	if (!is_target(ptgid))
		return 0;
	ctgid = task_tgid(child);
	/* Forked into a pid namespace below the agent's without a number in
	 * it cannot happen (a child's namespace descends from its parent's);
	 * 0 would be "nobody", never a target. */
	if (ctgid == 0)
		return 0;
	if (bpf_map_update_elem(&targets, &ctgid, &one, BPF_ANY) != 0)
		stat_add(HS_STAT_TARGETS_FULL, 1);
	targets_changed();
	emit_proc(child, ptgid, task_tid(parent), ctgid, HS_PROC_FORK, 0);
	return 0;
}

SEC("tp_btf/sched_process_exec")
int BPF_PROG(sched_process_exec, struct task_struct *p)
{
	__u32 tgid = task_tgid(p);

	if (!is_target(tgid))
		return 0;
	emit_proc(p, tgid, task_tid(p), tgid, HS_PROC_EXEC, 0);
	return 0;
}

SEC("tp_btf/sched_process_exit")
int BPF_PROG(sched_process_exit, struct task_struct *p)
{
	__u32 tgid;

	/* The thread's `inflight` and `offcpu` slots go with its task; a
	 * syscall entry it spilled and never left goes here. */
	if (inflight_spilled_any) {
		__u32 gtid = p->pid;

		bpf_map_delete_elem(&inflight_spill, &gtid);
	}
	if (p->pid != p->tgid)
		return 0;
	tgid = task_tgid(p);
	if (!is_target(tgid))
		return 0;
	emit_proc(p, tgid, tgid, tgid, HS_PROC_EXIT, p->exit_code);
	bpf_map_delete_elem(&targets, &tgid);
	if (pidns_ino)
		bpf_map_delete_elem(&host_tgids, &tgid);
	targets_changed();
	return 0;
}

/* ---- scheduling: runs on every context switch of the machine ---- */

/* Keeps a switch-out (or first-seen wake-up) whose slot was not allocated. */
static __always_inline void spill(struct task_struct *t, __u64 off_ns, __u64 wake_ns, __u32 state)
{
	struct offcpu_spilled sp = { .off_ns = off_ns, .wake_ns = wake_ns, .prev_state = state };
	__u32 gtid = t->pid;

	if (bpf_map_update_elem(&offcpu_spill, &gtid, &sp, BPF_ANY) == 0)
		stat_add(HS_STAT_SCHED_SPILLED, 1);
	else
		stat_add(HS_STAT_SCHED_MAP_FULL, 1);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(sched_switch, _Bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	__u32 prev_tgid = task_tgid(prev);
	__u32 next_tgid = task_tgid(next);
	__u64 now;

	/* A preemption leaves the task runnable whatever its state: one caught
	 * between setting a sleep state and calling schedule() (the kernel
	 * passes the raw state since 5.18) is not asleep, and no wake-up will
	 * end that interval. The kernel's own sched_switch format reports it as
	 * running too (__trace_sched_switch_state). */
	if (preempt)
		prev_state = 0;
	if (!is_target(prev_tgid)) {
		if (!is_target(next_tgid))
			return 0;
		now = bpf_ktime_get_ns();
	} else {
		struct offcpu *o = bpf_task_storage_get(&offcpu, prev, 0, fail_offcpu_alloc ? 0 : BPF_LOCAL_STORAGE_GET_F_CREATE);

		now = bpf_ktime_get_ns();
		if (o) {
			o->off_ns = now;
			o->wake_ns = 0;
			o->prev_state = prev_state;
			if (pidns_ino && !o->host_noted) {
				__u32 host = prev->tgid;

				o->host_noted = 1;
				bpf_map_update_elem(&host_tgids, &prev_tgid, &host, BPF_ANY);
			}
		} else {
			spill(prev, now, 0, prev_state);
			if (pidns_ino) {
				__u32 host = prev->tgid;

				bpf_map_update_elem(&host_tgids, &prev_tgid, &host, BPF_ANY);
			}
		}
		if (!is_target(next_tgid))
			return 0;
	}

	__u32 next_pid = task_tid(next);
	__u64 off_ns, wake_ns;
	__u32 state;
	struct offcpu *o = bpf_task_storage_get(&offcpu, next, 0, 0);
	if (!o) {
		/* Rare (a spilled switch-out): one lookup for a thread with no
		 * slot yet, which it gets now, interrupts being as off as at
		 * its switch-out but the burst of first switch-outs past. */
		__u32 gtid = next->pid;
		struct offcpu_spilled *sp = bpf_map_lookup_elem(&offcpu_spill, &gtid);

		if (!sp)
			return 0;
		off_ns = sp->off_ns;
		wake_ns = sp->wake_ns;
		state = sp->prev_state;
		bpf_map_delete_elem(&offcpu_spill, &gtid);
		o = bpf_task_storage_get(&offcpu, next, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
		if (o)
			o->off_ns = 0;
	} else {
		if (o->off_ns == 0)
			return 0;
		off_ns = o->off_ns;
		wake_ns = o->wake_ns;
		state = o->prev_state;
		o->off_ns = 0;
	}
	if (now < off_ns)
		return 0;
	/* A preemption (switched out while runnable) does not end a burst, nor
	 * does a wait on a lock (HS_TASK_FREEZABLE): never the epoll wait in
	 * which ZMQ's I/O thread is handed work, and one woken for an ADD that
	 * then blocks on a mutex before it writes was handed the ADD at the first
	 * wake-up (4.5 ms earlier once in CI). As correlate::engine::Woke. */
	if (o && state != 0 && !(state & HS_TASK_FREEZABLE)) {
		o->burst_on_ns = now;
		o->burst_wake_ns = wake_ns;
	}
	__u64 dur = now - off_ns;
	if (dur < min_offcpu_ns) {
		stat_add(HS_STAT_SCHED_SHORT, 1);
		stat_add(HS_STAT_SCHED_SHORT_NS, dur);
		return 0;
	}
	struct hs_sched s;
	__builtin_memset(&s, 0, sizeof(s));
	s.h.ts_ns = now;
	s.h.tgid = next_tgid;
	s.h.tid = next_pid;
	s.h.size = sizeof(s);
	s.h.kind = HS_KIND_SCHED;
	s.off_ns = off_ns;
	s.wake_ns = wake_ns;
	s.prev_state = state;
	s.cpu = bpf_get_smp_processor_id();
	emit(&s, sizeof(s));
	return 0;
}

static __always_inline void note_wakeup(struct task_struct *p)
{
	struct offcpu *o;

	if (!is_target(task_tgid(p)))
		return;
	o = bpf_task_storage_get(&offcpu, p, 0, 0);
	if (!o) {
		__u32 gtid = p->pid;
		struct offcpu_spilled *sp = bpf_map_lookup_elem(&offcpu_spill, &gtid);

		if (sp) {
			if (sp->wake_ns == 0)
				sp->wake_ns = bpf_ktime_get_ns();
			return;
		}
		/* No switch-out seen: asleep since before the attach (a ZMQ I/O
		 * thread idle in epoll_wait when `record --pid` attached). Its
		 * sleep is known from this wake-up on, which is what its next
		 * write's burst needs: without it the first hand-over after an
		 * attach had no wake-up and fell back to estimates. The state
		 * still holds the sleep's kind (the wake-up sets it running
		 * after this tracepoint): a lock wait keeps its exemption. */
		o = bpf_task_storage_get(&offcpu, p, 0, fail_offcpu_alloc ? 0 : BPF_LOCAL_STORAGE_GET_F_CREATE);
		if (!o) {
			__u64 now = bpf_ktime_get_ns();

			spill(p, now, now, p->__state);
			return;
		}
		if (o->off_ns == 0) {
			__u64 now = bpf_ktime_get_ns();

			o->off_ns = now;
			o->wake_ns = now;
			o->prev_state = p->__state;
		}
		return;
	}
	if (o->off_ns != 0 && o->wake_ns == 0)
		o->wake_ns = bpf_ktime_get_ns();
}

/* sched_waking fires in the waker, as it calls try_to_wake_up(): the moment
 * of the hand-over (a frontend's send() waking ZMQ's I/O thread). sched_wakeup
 * fires once the task is queued on its CPU, which for a remote CPU is after an
 * IPI; in a VM whose vCPU is not running that came 1-3 ms later and put the
 * wait into the waker's phase (docs/decisions.md). */
SEC("tp_btf/sched_waking")
int BPF_PROG(sched_waking, struct task_struct *p)
{
	note_wakeup(p);
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(sched_wakeup_new, struct task_struct *p)
{
	note_wakeup(p);
	return 0;
}

/* ---- wire arrival: data became readable on a socket ---- */

/* Layouts from /sys/kernel/tracing/events/sock/{sk_data_ready,inet_sock_set_state}/format
 * (stable tracepoint ABI since 6.6 / 4.16). */
struct sk_data_ready_ctx {
	__u64 common;
	__u64 skaddr;
	__u16 family;
	__u16 protocol;
	__u32 _pad;
	__u64 ip;
};

struct inet_sock_set_state_ctx {
	__u64 common;
	__u64 skaddr;
	__s32 oldstate;
	__s32 newstate;
};

#define HS_TCP_ESTABLISHED 1
#define HS_TCP_SYN_SENT 2
#define HS_TCP_SYN_RECV 3
#define HS_TCP_CLOSE 7

SEC("tracepoint/sock/sk_data_ready")
int sock_sk_data_ready(struct sk_data_ready_ctx *ctx)
{
	__u64 sk = ctx->skaddr;
	__u64 now;

	if (ctx->family != HS_AF_INET && ctx->family != HS_AF_INET6 && ctx->family != HS_AF_UNIX)
		return 0;
	/* Keep the oldest unread arrival: only set when absent or taken. Look
	 * first: an LRU update takes a lock (~350 ns measured), a hit costs a
	 * hash lookup, and sockets nobody reads through a traced process stay
	 * present. A traced socket's entry stays too (reads swap in 0), so its
	 * next arrival is a compare-and-swap, not an insert. */
	__u64 *t = bpf_map_lookup_elem(&ready, &sk);
	if (t) {
		if (*(volatile __u64 *)t == 0)
			__sync_val_compare_and_swap(t, 0, bpf_ktime_get_ns());
		return 0;
	}
	now = bpf_ktime_get_ns();
	bpf_map_update_elem(&ready, &sk, &now, BPF_NOEXIST);
	return 0;
}

struct net_dev_queue_ctx {
	__u64 common;
	__u64 skbaddr;
	__u32 len;
	__u32 name_loc;
};

/* The wire departure of a write: when the call first handed a packet of its
 * socket to a device. The syscall's exit is later by whatever ran in between:
 * on loopback the receiver's whole softirq path, and a preemption by the
 * receiver it just woke (seen: 2.9 ms on a loaded machine, while the peer had
 * the bytes). A packet that leaves after the call (congestion window, pacing)
 * is not seen here, and the record keeps the exit. Runs for every packet the
 * machine sends: one task-storage lookup (no create) decides for tasks that
 * never made a traced syscall. */
SEC("tracepoint/net/net_dev_queue")
int net_net_dev_queue(struct net_dev_queue_ctx *ctx)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
	struct inflight *inf = bpf_task_storage_get(&inflight, task, 0, 0);
	struct sk_buff *skb = (struct sk_buff *)ctx->skbaddr;
	__u16 sys;

	if (!inf || inf->xmit_ns)
		return 0;
	sys = inf->syscall;
	if (sys != HS_SYS_WRITE && sys != HS_SYS_WRITEV && sys != HS_SYS_SENDTO && sys != HS_SYS_SENDMSG)
		return 0;
	if (!inf->sk || (__u64)BPF_CORE_READ(skb, sk) != inf->sk)
		return 0;
	inf->xmit_ns = bpf_ktime_get_ns();
	return 0;
}

/* A new or dead TCP socket must not inherit a stale arrival left by a freed
 * socket at the same address. Not on other transitions: a peer's FIN (to
 * CLOSE_WAIT) must not erase the arrival of data still unread. */
SEC("tracepoint/sock/inet_sock_set_state")
int sock_inet_sock_set_state(struct inet_sock_set_state_ctx *ctx)
{
	__s32 st = ctx->newstate;
	__u64 sk = ctx->skaddr;

	if (st == HS_TCP_ESTABLISHED || st == HS_TCP_SYN_SENT || st == HS_TCP_SYN_RECV || st == HS_TCP_CLOSE)
		bpf_map_delete_elem(&ready, &sk);
	return 0;
}
